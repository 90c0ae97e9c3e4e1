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
        for (int64_t j = 0; j < g; j++) {                                                          \
            float *sj = s + j * len, m = sj[0], z = 0.f;                                           \
            for (int64_t t = 1; t < len; t++) m = sj[t] > m ? sj[t] : m;                           \
            for (int64_t t = 0; t < len; t++) sj[t] = expf(sj[t] - m);                             \
            for (int64_t t = 0; t < len; t++) z += sj[t];                                          \
            sum[j] = z;                                                                            \
        }                                                                                          \
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

/* q, out: [b, hkv, g, d] contiguous. k, v: element strides per row (k_sb), per KV head (k_sh) and
 * per position (k_st); the head dimension is contiguous. lens: int64 [b], each in [1, capacity].
 * Returns 0, or -1 when g > MAX_GROUP, d > MAX_DIM or scratch could not be allocated (the caller
 * then uses another implementation). */
#define DEFINE_KERNEL(NAME, ITEM, T)                                                                \
    int NAME(const T *q, const T *k, const T *v, T *out, const int64_t *lens, int64_t b,          \
             int64_t hkv, int64_t g, int64_t d, int64_t k_sb, int64_t k_sh, int64_t k_st,          \
             int64_t v_sb, int64_t v_sh, int64_t v_st, float scale, int nthreads) {                \
        if (g > MAX_GROUP || d > MAX_DIM || g < 1 || d < 1) return -1;                             \
        int64_t max_len = 1;                                                                       \
        for (int64_t r = 0; r < b; r++) max_len = lens[r] > max_len ? lens[r] : max_len;           \
        int failed = 0;                                                                            \
        _Pragma("omp parallel num_threads(nthreads)") {                                            \
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
                if (d == 64)                                                                       \
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

DEFINE_KERNEL(decode_attention_bf16, item_bf16, uint16_t)
DEFINE_KERNEL(decode_attention_f32, item_f32, float)
