/* Decode attention over the server's slot KV cache (arealite/server/kv_cache.py), CPU.
 *
 * One query token per row, grouped-query attention: for row r, KV head h and each of the g query
 * heads that share it,
 *     out[r, h, j] = softmax_t(scale * q[r, h, j] . k[r, h, t]) @ v[r, h, t],  t in [0, lens[r])
 * (Vaswani et al. 2017, eq. 1; GQA: Ainslie et al. 2023). Only each row's own lens[r] positions
 * are read, not the longest row's, and each row's keys and values are read once for all g query
 * heads. Scores, softmax and the weighted sum are fp32; bf16 inputs are widened exactly and the
 * output is rounded to nearest even, like torch's float -> bfloat16 conversion.
 *
 * Threads: OpenMP over (row, KV head). The server loads this library into a process where torch's
 * libgomp.so.1 is already loaded, so the dynamic linker binds it to that same library and these
 * loops run on torch's own thread pool (no second pool competing for the cores).
 *
 * Built at first use by arealite/native/__init__.py with the machine's C compiler
 * (-O3 -march=native -ffast-math -fopenmp; -ffast-math lets gcc vectorise expf; no infinities
 * occur: masked positions are never read).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define MAX_GROUP 16
#define MAX_DIM 256

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Software prefetch distance [bytes] along a (row, KV head)'s keys, then values: the hardware
 * prefetchers alone left a real decode step at 16 GB/s of KV from DRAM on the 2-core EPYC;
 * 2, 4 and 8 KiB ahead gave 25-28 GB/s (32 rows x 200 positions x 30 layers, bf16). */
#define PREFETCH_BYTES 4096

static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off);
}

/* Each of the g rows of s (len scores each) -> exp(score - row max) in place; sum[j] = row j's sum.
 * The exponent is floored at -87 (exp = 1.6e-38, fp32's smallest normals): libmvec's vector expf
 * takes a scalar path for a whole vector with a lane below about -87.3, and a head whose scores
 * span more than that (attention sinks) would run 10-20x slower; a weight below 1.6e-38 next to
 * the row maximum's 1 changes nothing. */
static inline void softmax_rows(float *s, int64_t g, int64_t len, float *sum) {
    for (int64_t j = 0; j < g; j++) {
        float *sj = s + j * len, m = sj[0], z = 0.f;
        for (int64_t t = 1; t < len; t++) m = sj[t] > m ? sj[t] : m;
        for (int64_t t = 0; t < len; t++) sj[t] = expf(fmaxf(sj[t] - m, -87.0f));
        for (int64_t t = 0; t < len; t++) z += sj[t];
        sum[j] = z;
    }
}

/* One (row, KV head): q [g, d], keys/values at k + t * k_st, v + t * v_st (t < len), out [g, d].
 * s: scratch of g * len floats. */
#define DEFINE_ITEM(NAME, T, LOAD, STORE)                                                          \
    static inline __attribute__((always_inline)) void NAME(                                        \
        const T *q, const T *k, const T *v, T *out, int64_t len, int64_t g, const int64_t d,       \
        int64_t k_st, int64_t v_st, float scale, float *s) {                                       \
        float qf[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM], row[MAX_DIM], sum[MAX_GROUP];     \
        const int64_t pf = PREFETCH_BYTES / (int64_t)(d * sizeof(T)) + 1; /* rows ahead */        \
        for (int64_t i = 0; i < g * d; i++) qf[i] = LOAD(q[i]) * scale;                            \
        for (int64_t t = 0; t < len; t++) {                                                        \
            const T *kt = k + t * k_st;                                                            \
            if (t + pf < len) /* the keys ahead, then the first values */                         \
                prefetch_row(kt + pf * k_st, d * (int64_t)sizeof(T));                              \
            else if (t + pf - len < len)                                                           \
                prefetch_row(v + (t + pf - len) * v_st, d * (int64_t)sizeof(T));                   \
            for (int64_t i = 0; i < d; i++) row[i] = LOAD(kt[i]);                                  \
            for (int64_t j = 0; j < g; j++) {                                                      \
                float dot = 0.f;                                                                   \
                for (int64_t i = 0; i < d; i++) dot += qf[j * d + i] * row[i];                    \
                s[j * len + t] = dot;                                                              \
            }                                                                                      \
        }                                                                                          \
        softmax_rows(s, g, len, sum);                                                              \
        for (int64_t i = 0; i < g * d; i++) acc[i] = 0.f;                                          \
        for (int64_t t = 0; t < len; t++) {                                                        \
            const T *vt = v + t * v_st;                                                            \
            if (t + pf < len) prefetch_row(vt + pf * v_st, d * (int64_t)sizeof(T));               \
            for (int64_t i = 0; i < d; i++) row[i] = LOAD(vt[i]);                                  \
            for (int64_t j = 0; j < g; j++) {                                                      \
                const float p = s[j * len + t];                                                    \
                for (int64_t i = 0; i < d; i++) acc[j * d + i] += p * row[i];                      \
            }                                                                                      \
        }                                                                                          \
        for (int64_t j = 0; j < g; j++) {                                                          \
            const float inv = 1.f / sum[j];                                                        \
            for (int64_t i = 0; i < d; i++) out[j * d + i] = STORE(acc[j * d + i] * inv);          \
        }                                                                                          \
    }

#define F32_ID(x) (x)
DEFINE_ITEM(item_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ITEM(item_f32, float, F32_ID, F32_ID)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16, d = 64 or 128, AVX-512 BF16: the same sums, blocked for the vector units. The generic item
 * above spends one horizontal reduction per (position, query head), which left the kernel at
 * ~17 GB/s of KV on a 2-core AMX Xeon. Here:
 *   scores: per block of 16 positions and query head j, vdpbf16ps of each key row with q_j (the
 *     products of two bf16 numbers are exact in fp32, each step one rounded fp32 add, like fp32
 *     FMAs over widened inputs), then one transpose-reduce turns the 16 vectors into the block's
 *     16 scores (46 shuffles and adds instead of 16 reductions of 8);
 *   values: the weighted sum keeps up to 4 (d = 64) or 2 (d = 128) query heads' accumulators in
 *     registers, each value row widened once per group of heads.
 * Scores, softmax and sums are fp32 as above; only the order of the fp32 additions differs. */
#include <immintrin.h>

/* lane t of the result = the sum of v[t]'s 16 lanes */
static inline __m512 sum16x16(const __m512 *v) {
    __m512 w[8], u[4], z[2];
    for (int i = 0; i < 8; i++) /* [x0+x2, x1+x3, y0+y2, y1+y3] in 128-bit blocks */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* block k: 4 lanes summing to position 4i + k */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* block k: lanes 0-1 position 8i + k, lanes 2-3 8i + k + 4 */
        z[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4k + c holds position k + 4c */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, r);
}

static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* s[j * len + t] = scale * q_j . k_t for t < len (NV2 = d / 32 bf16 pairs-vectors per row) */
#define DEFINE_SCORES(NAME, NV2)                                                                    \
    static inline void NAME(const uint16_t *q, const uint16_t *k, int64_t len, int64_t g,           \
                            int64_t k_st, const uint16_t *v,                                        \
                            int64_t v_st, float scale, float *s) {                                  \
        const int64_t d = 32 * NV2, pf = PREFETCH_BYTES / (d * 2) + 1;                              \
        const __m512 sc = _mm512_set1_ps(scale);                                                    \
        for (int64_t t0 = 0; t0 < len; t0 += 16) {                                                 \
            const int64_t n = len - t0 < 16 ? len - t0 : 16;                                        \
            for (int64_t tt = 0; tt < n; tt++) { /* the keys ahead, then the first values */       \
                const int64_t t = t0 + tt;                                                          \
                if (t + pf < len)                                                                   \
                    prefetch_row(k + (t + pf) * k_st, d * 2);                                       \
                else if (t + pf - len < len)                                                        \
                    prefetch_row(v + (t + pf - len) * v_st, d * 2);                                 \
            }                                                                                       \
            for (int64_t j = 0; j < g; j++) {                                                       \
                __m512bh qv[NV2];                                                                   \
                for (int c = 0; c < NV2; c++)                                                       \
                    qv[c] = (__m512bh)_mm512_loadu_si512(q + j * d + 32 * c);                       \
                __m512 acc[16];                                                                     \
                for (int tt = 0; tt < 16; tt++) {                                                   \
                    acc[tt] = _mm512_setzero_ps();                                                  \
                    if (tt < n) {                                                                   \
                        const uint16_t *kt = k + (t0 + tt) * k_st;                                  \
                        for (int c = 0; c < NV2; c++)                                               \
                            acc[tt] = _mm512_dpbf16_ps(                                             \
                                acc[tt], (__m512bh)_mm512_loadu_si512(kt + 32 * c), qv[c]);         \
                    }                                                                               \
                }                                                                                   \
                _mm512_mask_storeu_ps(s + j * len + t0, (__mmask16)((1u << n) - 1u),                \
                                      _mm512_mul_ps(sum16x16(acc), sc));                            \
            }                                                                                       \
        }                                                                                           \
    }
DEFINE_SCORES(scores_d64, 2)
DEFINE_SCORES(scores_d128, 4)

/* acc[jj * d + i] = sum_t s[(j0 + jj) * len + t] * v[t, i] for jj < JC (NV = d / 16) */
#define DEFINE_VALUES(NAME, NV, JC)                                                                 \
    static inline void NAME(const float *s, const uint16_t *v, int64_t len, int64_t v_st,           \
                            int64_t pf, float *acc_out) {                                           \
        __m512 acc[JC][NV];                                                                         \
        for (int jj = 0; jj < JC; jj++)                                                             \
            for (int c = 0; c < NV; c++) acc[jj][c] = _mm512_setzero_ps();                          \
        for (int64_t t = 0; t < len; t++) {                                                         \
            const uint16_t *vt = v + t * v_st;                                                      \
            if (pf > 0 && t + pf < len) prefetch_row(vt + pf * v_st, 32 * NV);                      \
            __m512 x[NV];                                                                           \
            for (int c = 0; c < NV; c++) x[c] = widen16(vt + 16 * c);                              \
            for (int jj = 0; jj < JC; jj++) {                                                       \
                const __m512 p = _mm512_set1_ps(s[jj * len + t]);                                   \
                for (int c = 0; c < NV; c++) acc[jj][c] = _mm512_fmadd_ps(p, x[c], acc[jj][c]);    \
            }                                                                                       \
        }                                                                                           \
        for (int jj = 0; jj < JC; jj++)                                                             \
            for (int c = 0; c < NV; c++) _mm512_storeu_ps(acc_out + jj * 16 * NV + 16 * c, acc[jj][c]); \
    }
DEFINE_VALUES(values_d64_1, 4, 1)
DEFINE_VALUES(values_d64_2, 4, 2)
DEFINE_VALUES(values_d64_3, 4, 3)
DEFINE_VALUES(values_d64_4, 4, 4)
DEFINE_VALUES(values_d128_1, 8, 1)
DEFINE_VALUES(values_d128_2, 8, 2)

/* One (row, KV head) as item_bf16, for d = 64 or 128. s: scratch of g * len floats. */
static void item_bf16_avx512(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                             uint16_t *out, int64_t len, int64_t g, int64_t d, int64_t k_st,
                             int64_t v_st, float scale, float *s) {
    float acc[MAX_GROUP * MAX_DIM];
    if (d == 64)
        scores_d64(q, k, len, g, k_st, v, v_st, scale, s);
    else
        scores_d128(q, k, len, g, k_st, v, v_st, scale, s);
    float sum[MAX_GROUP];
    softmax_rows(s, g, len, sum);
    const int64_t pf = PREFETCH_BYTES / (d * 2) + 1;
    for (int64_t j0 = 0; j0 < g;) {
        const int64_t left = g - j0;
        const float *sj = s + j0 * len;
        float *aj = acc + j0 * d;
        int64_t jc; /* heads in this pass; only the first pass prefetches the values ahead */
        if (d == 64) {
            jc = left >= 4 ? 4 : left;
            if (jc == 4) values_d64_4(sj, v, len, v_st, j0 ? 0 : pf, aj);
            else if (jc == 3) values_d64_3(sj, v, len, v_st, j0 ? 0 : pf, aj);
            else if (jc == 2) values_d64_2(sj, v, len, v_st, j0 ? 0 : pf, aj);
            else values_d64_1(sj, v, len, v_st, j0 ? 0 : pf, aj);
        } else {
            jc = left >= 2 ? 2 : 1;
            if (jc == 2) values_d128_2(sj, v, len, v_st, j0 ? 0 : pf, aj);
            else values_d128_1(sj, v, len, v_st, j0 ? 0 : pf, aj);
        }
        j0 += jc;
    }
    for (int64_t j = 0; j < g; j++) {
        const float inv = 1.f / sum[j];
        for (int64_t i = 0; i < d; i++) out[j * d + i] = f32_to_bf16(acc[j * d + i] * inv);
    }
}
#define HAVE_AVX512_ITEM 1
#else
#define HAVE_AVX512_ITEM 0
#define item_bf16_avx512 item_bf16
#endif

/* q, out: [b, hkv, g, d] contiguous. k, v: element strides per row (k_sb), per KV head (k_sh) and
 * per position (k_st); the head dimension is contiguous. lens: int64 [b], each in [1, capacity].
 * k_new, v_new: NULL, or this step's keys and values [b, hkv, d] (element strides per row and per
 * KV head, head dimension contiguous), written at position lens[r] - 1 of row r before any row
 * attends (one pass over all rows, then the attention: the server's per-layer KV write without
 * two indexed tensor writes).
 * capacity: positions each row of k and v holds.
 * Returns 0, or -1 when g > MAX_GROUP, d > MAX_DIM or a length is outside [1, capacity] (nothing
 * read or written) or scratch could not be allocated (the caller then uses another
 * implementation; writing the new keys and values again is harmless). */
#define DEFINE_KERNEL(NAME, ITEM, FAST, T)                                                              \
    int NAME(const T *q, T *k, T *v, T *out, const int64_t *lens, int64_t b,                      \
             int64_t hkv, int64_t g, int64_t d, int64_t k_sb, int64_t k_sh, int64_t k_st,          \
             int64_t v_sb, int64_t v_sh, int64_t v_st, float scale, int nthreads,                  \
             const T *k_new, int64_t kn_sb, int64_t kn_sh, const T *v_new, int64_t vn_sb,          \
             int64_t vn_sh, int64_t capacity) {                                                    \
        if (g > MAX_GROUP || d > MAX_DIM || g < 1 || d < 1) return -1;                             \
        int64_t max_len = 1;                                                                       \
        for (int64_t r = 0; r < b; r++) {                                                          \
            if (lens[r] < 1 || lens[r] > capacity) return -1;                                      \
            max_len = lens[r] > max_len ? lens[r] : max_len;                                       \
        }                                                                                          \
        int failed = 0;                                                                            \
        _Pragma("omp parallel num_threads(nthreads)") {                                            \
            if (k_new && v_new) {                                                                  \
                _Pragma("omp for")                                                                 \
                for (int64_t it = 0; it < b * hkv; it++) {                                         \
                    const int64_t r = it / hkv, h = it % hkv, t = lens[r] - 1;                     \
                    memcpy(k + r * k_sb + h * k_sh + t * k_st, k_new + r * kn_sb + h * kn_sh,      \
                           d * sizeof(T));                                                         \
                    memcpy(v + r * v_sb + h * v_sh + t * v_st, v_new + r * vn_sb + h * vn_sh,      \
                           d * sizeof(T));                                                         \
                } /* the loop's implicit barrier: every row's new KV is in before any attends */   \
            }                                                                                      \
            float *s = (float *)malloc(sizeof(float) * g * max_len);                               \
            if (!s) {                                                                              \
                _Pragma("omp atomic write") failed = 1;                                            \
            }                                                                                      \
            _Pragma("omp for schedule(dynamic, 1)")                                                \
            for (int64_t it = 0; it < b * hkv; it++) {                                             \
                if (!s) continue;                                                                  \
                const int64_t r = it / hkv, h = it % hkv;                                          \
                const T *qi = q + it * g * d;                                                      \
                const T *ki = k + r * k_sb + h * k_sh, *vi = v + r * v_sb + h * v_sh;              \
                T *oi = out + it * g * d;                                                          \
                if (FAST && (d == 64 || d == 128))                                                 \
                    ITEM##_avx512(qi, ki, vi, oi, lens[r], g, d, k_st, v_st, scale, s);            \
                else if (d == 64)                                                                  \
                    ITEM(qi, ki, vi, oi, lens[r], g, 64, k_st, v_st, scale, s);                    \
                else if (d == 128)                                                                 \
                    ITEM(qi, ki, vi, oi, lens[r], g, 128, k_st, v_st, scale, s);                   \
                else                                                                               \
                    ITEM(qi, ki, vi, oi, lens[r], g, d, k_st, v_st, scale, s);                     \
            }                                                                                      \
            free(s);                                                                               \
        }                                                                                          \
        return failed ? -1 : 0;                                                                    \
    }

DEFINE_KERNEL(decode_attention_bf16, item_bf16, HAVE_AVX512_ITEM, uint16_t)
#define item_f32_avx512 item_f32
DEFINE_KERNEL(decode_attention_f32, item_f32, 0, float)
