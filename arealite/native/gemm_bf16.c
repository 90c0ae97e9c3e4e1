/* C = A . B^T of bfloat16 operands with float32 sums and a float32 result, CPU (AVX-512 BF16).
 *
 *     C[m, n] = sum_k A[m, k] * B[n, k]     A [M, K] bf16, B [N, K] bf16, C [M, N] fp32
 *
 * Used for the LM head of a bf16 model, whose logits arealite keeps in fp32 (MiniMax-M1,
 * arXiv:2506.13585, section 3.3): torch 2.13 has no CPU matmul with bf16 inputs and an fp32
 * output, so the head otherwise widens both operands to fp32 and runs at the fp32 GEMM rate.
 * A product of two bf16 numbers is exact in fp32; vdpbf16ps adds pairs of them into fp32
 * accumulators, so C equals the widened fp32 GEMM up to the order of the fp32 additions.
 *
 * Blocking (Goto & van de Geijn, "Anatomy of high-performance matrix multiplication", 2008):
 * B is packed per thread into panels of NR = 32 columns (two zmm) in the VNNI pair layout
 * [k/2][32][2] for KC values of k at a time, PG panels together (PG x 48 KiB, in L2); a
 * micro-kernel keeps an MR x 32 block of C in 28 zmm accumulators and, per pair of k, loads the
 * two B vectors once and broadcasts one (k, k+1) pair of each of the MR rows of A. K longer than
 * KC accumulates into C. Threads: OpenMP over groups of panels, on torch's libgomp (see
 * arealite/native/__init__.py).
 *
 * Returns 0, -1 when built for a CPU without AVX-512 BF16 (the caller uses the fp32 GEMM),
 * -2 for odd K, -3 when a buffer could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define NR 32
#define MR 14
#define KC 768
#define PG 8

#ifdef __AVX512BF16__
/* panel: [kc/2][NR][2] bf16 from B rows n0..n0+nr (K contiguous, ldb), columns k0..k0+kc */
static void pack_panel(const uint16_t *B, int64_t ldb, int64_t n0, int64_t nr, int64_t k0, int64_t kc, uint32_t *panel) {
    for (int64_t j = 0; j < NR; j++) {
        if (j < nr) {
            const uint32_t *src = (const uint32_t *)(B + (n0 + j) * ldb + k0);
            for (int64_t k2 = 0; k2 < kc / 2; k2++) panel[k2 * NR + j] = src[k2];
        } else {
            for (int64_t k2 = 0; k2 < kc / 2; k2++) panel[k2 * NR + j] = 0;
        }
    }
}

static inline __attribute__((always_inline)) void micro(
    const int mr, const uint16_t *A, int64_t lda, const uint32_t *panel, int64_t kc2,
    float *C, int64_t ldc, int accumulate, __mmask16 m0, __mmask16 m1) {
    __m512 c0[MR], c1[MR];
#pragma GCC unroll 14
    for (int i = 0; i < mr; i++) {
        if (accumulate) { c0[i] = _mm512_maskz_loadu_ps(m0, C + i * ldc); c1[i] = _mm512_maskz_loadu_ps(m1, C + i * ldc + 16); }
        else { c0[i] = _mm512_setzero_ps(); c1[i] = _mm512_setzero_ps(); }
    }
    for (int64_t k2 = 0; k2 < kc2; k2++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + k2 * NR);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + k2 * NR + 16);
#pragma GCC unroll 14
        for (int i = 0; i < mr; i++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(A + i * lda + 2 * k2));
            c0[i] = _mm512_dpbf16_ps(c0[i], a, b0);
            c1[i] = _mm512_dpbf16_ps(c1[i], a, b1);
        }
    }
#pragma GCC unroll 14
    for (int i = 0; i < mr; i++) {
        _mm512_mask_storeu_ps(C + i * ldc, m0, c0[i]);
        _mm512_mask_storeu_ps(C + i * ldc + 16, m1, c1[i]);
    }
}
#endif

#ifdef __AVX512BF16__
/* The tile loop: B from its rows (B, ldb; packed here per thread) or pre-packed (Bp, layout of
 * pack_bf16_vnni). */
static int gemm_core(const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb, const uint32_t *Bp,
                     float *C, int64_t ldc, int64_t M, int64_t N, int64_t K, int nthreads) {
    int64_t npanels = (N + NR - 1) / NR;
    int64_t pg = npanels / (4 * (int64_t)nthreads);
    pg = pg < 1 ? 1 : pg > PG ? PG : pg;
    int64_t ngroups = (npanels + pg - 1) / pg;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint32_t *panels = Bp ? NULL : aligned_alloc(64, (size_t)PG * (KC / 2) * NR * 4);
        if (!Bp && panels == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t gi = 0; gi < ngroups; gi++) {
            if (!Bp && panels == NULL) continue;
            int64_t p0 = gi * pg, p1 = p0 + pg < npanels ? p0 + pg : npanels;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                int64_t kc = K - k0 < KC ? K - k0 : KC;
                int acc = k0 > 0;
                if (!Bp)
                    for (int64_t p = p0; p < p1; p++) {
                        int64_t n0 = p * NR, nr = N - n0 < NR ? N - n0 : NR;
                        pack_panel(B, ldb, n0, nr, k0, kc, panels + (p - p0) * (KC / 2) * NR);
                    }
                for (int64_t m = 0; m < M; m += MR) {
                    int64_t rest = M - m < MR ? M - m : MR;
                    const uint16_t *a = A + m * lda + k0;
                    for (int64_t p = p0; p < p1; p++) {
                        int64_t n0 = p * NR, nr = N - n0 < NR ? N - n0 : NR;
                        __mmask16 m0 = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
                        __mmask16 m1 = nr >= 32 ? 0xffff : nr <= 16 ? 0 : (__mmask16)((1u << (nr - 16)) - 1);
                        const uint32_t *panel = Bp ? Bp + p * (K / 2) * NR + (k0 / 2) * NR
                                                   : panels + (p - p0) * (KC / 2) * NR;
                        float *c = C + m * ldc + n0;
                        switch (rest) {
#define CASE(R) case R: micro(R, a, lda, panel, kc / 2, c, ldc, acc, m0, m1); break;
                        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14)
                        default: break;
                        }
                    }
                }
            }
        }
        free(panels);
    }
    return failed ? -3 : 0;
}
#endif

/* Row strides lda, ldb, ldc are in elements; the last dimension of each matrix is contiguous. */
int gemm_bf16_f32(const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb, float *C, int64_t ldc,
                  int64_t M, int64_t N, int64_t K, int nthreads) {
#ifndef __AVX512BF16__
    return -1;
#else
    if (K % 2) return -2;
    return gemm_core(A, lda, B, ldb, NULL, C, ldc, M, N, K, nthreads);
#endif
}

/* B [N, K] (row stride ldb) into Bp: ceil(N / 32) panels of [K/2][32] bf16 pairs (zero columns
 * past N), i.e. ceil(N / 32) * 32 * K bf16 values. For a weight multiplied many times (the
 * server's LM head): gemm_bf16_f32_packed then skips the per-call packing. */
int pack_bf16_vnni(const uint16_t *B, int64_t ldb, int64_t N, int64_t K, uint32_t *Bp, int nthreads) {
#ifndef __AVX512BF16__
    return -1;
#else
    if (K % 2) return -2;
    int64_t npanels = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < npanels; p++) {
        int64_t n0 = p * NR, nr = N - n0 < NR ? N - n0 : NR;
        pack_panel(B, ldb, n0, nr, 0, K, Bp + p * (K / 2) * NR);
    }
    return 0;
#endif
}

/* gemm_bf16_f32 with B given as pack_bf16_vnni's Bp. */
int gemm_bf16_f32_packed(const uint16_t *A, int64_t lda, const uint32_t *Bp, float *C, int64_t ldc,
                         int64_t M, int64_t N, int64_t K, int nthreads) {
#ifndef __AVX512BF16__
    return -1;
#else
    if (K % 2) return -2;
    return gemm_core(A, lda, NULL, 0, Bp, C, ldc, M, N, K, nthreads);
#endif
}
