/* RMSNorm of bf16 rows on the CPU, forward and backward, one pass over each row (Zhang & Sennrich
 * 2019, "Root Mean Square Layer Normalization", eq. 4), with transformers' Llama roundings:
 *     r = 1 / sqrt(mean_j x_j^2 + eps)                      fp32, kept per row for backward
 *     y_j = bf16(w_j * bf16(x_j * r))                        forward
 *     dn_j = bf16(dy_j * w_j),  s = sum_j dn_j * x_j          backward, fp32 sums
 *     dx_j = bf16(dn_j * r - x_j * s * r^3 / H)              (torch's autograd of the same ops)
 *     dw_j = sum over rows of bf16(dy_j * bf16(x_j * r))      (when the weight trains)
 * torch runs the forward as 8 ops (cast, square, mean, add, rsqrt, product, cast, product) and the
 * backward as about as many, each a pass over [tokens, hidden]. Sums run in another order than
 * torch's and gcc's -ffast-math computes 1/sqrt with rsqrt and a Newton step, so r differs from
 * torch's in the last fp32 bits: results within one or two bf16 ulps of torch's, mostly equal.
 *
 * Threads: OpenMP over rows, on torch's libgomp (see arealite/native/__init__.py); the weight
 * gradient is summed per thread into dw_part [nthreads, H] fp32 (zeroed by the caller) and the
 * caller adds the rows. Returns 0.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>

static inline float bf16f(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t rne(float f) { /* finite inputs only */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

int rmsnorm_fwd_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, float *rstd, int64_t M, int64_t H,
                     float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < M; i++) {
        const uint16_t *xi = x + i * H;
        uint16_t *yi = y + i * H;
        float ss = 0.0f;
        for (int64_t j = 0; j < H; j++) {
            const float v = bf16f(xi[j]);
            ss += v * v;
        }
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        rstd[i] = r;
        for (int64_t j = 0; j < H; j++) yi[j] = rne(bf16f(w[j]) * bf16f(rne(bf16f(xi[j]) * r)));
    }
    return 0;
}

int rmsnorm_bwd_bf16(const uint16_t *dy, const uint16_t *x, const uint16_t *w, const float *rstd, uint16_t *dx,
                     float *dw_part, int64_t M, int64_t H, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        float *dw = dw_part ? dw_part + (int64_t)omp_get_thread_num() * H : 0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) {
            const uint16_t *dyi = dy + i * H, *xi = x + i * H;
            uint16_t *dxi = dx + i * H;
            const float r = rstd[i];
            float s = 0.0f;
            for (int64_t j = 0; j < H; j++) s += bf16f(rne(bf16f(dyi[j]) * bf16f(w[j]))) * bf16f(xi[j]);
            const float c = s * r * r * r / (float)H;
            for (int64_t j = 0; j < H; j++) {
                const float xj = bf16f(xi[j]);
                dxi[j] = rne(bf16f(rne(bf16f(dyi[j]) * bf16f(w[j]))) * r - xj * c);
            }
            if (dw)
                for (int64_t j = 0; j < H; j++) dw[j] += bf16f(rne(bf16f(dyi[j]) * bf16f(rne(bf16f(xi[j]) * r))));
        }
    }
    return 0;
}
