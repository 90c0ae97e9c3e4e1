/* Native passes of a bf16 model's elementwise layers (arealite/native/layers.py): the SwiGLU
 * activation and transformers' Llama RMSNorm, forward and backward. Both sections below. */

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

/* SwiGLU, h = silu(gate) * up, of bf16 tensors on the CPU, forward and backward, one pass each
 * (the MLP activation of Llama, Qwen2/3, Mistral: Shazeer 2020, "GLU Variants Improve
 * Transformer", eq. 5 with silu = x * sigmoid(x), Elfwing et al. 2017). torch runs it as silu,
 * then a product in forward, and two products and silu's backward in backward: 5 and 9 passes over
 * [tokens, intermediate] bf16 tensors (the widest activations of the model) against 3 and 5 here.
 *
 * The roundings are torch's (HF's `act_fn(gate) * up` in a bf16 model), so the results equal
 * torch's up to the exp in the sigmoid (glibc's libmvec here, Sleef in torch): s below can round
 * the other way where silu(g) lies within an fp32 ulp of a bf16 tie, one bf16 ulp of s, so h and
 * the gradients lie within two bf16 ulps of torch's (99.9 % of them equal; tests/test_fused_mlp.py).
 *     s  = bf16(g / (1 + exp(-g)))               forward: h  = bf16(s * u)
 *     ds = bf16(dh * u),  du = bf16(dh * s)      backward (torch's MulBackward)
 *     dg = bf16(ds * sig(g) * (1 + g * (1 - sig(g)))),  sig(g) = 1 / (1 + exp(-g))  (silu_backward)
 * Every product and sum is fp32. The exp argument is clamped to [-80, 80]: libmvec's vector expf
 * takes a scalar path for a whole vector with a lane beyond about 87, and gcc's -ffast-math may
 * assume no infinities. Then sig(g) is exactly 1 for g > 80 (as in fp32 anyway), and for g < -80
 * sig(g) and silu(g) are taken as 0 (torch: at most 1.5e-33 in magnitude, and 0 below -88).
 *
 * Threads: OpenMP over blocks of elements, on torch's libgomp (see arealite/native/__init__.py).
 * Returns 0.
 */
static inline float exp_neg(float x) { return expf(fminf(fmaxf(-x, -80.0f), 80.0f)); } /* exp(-x) */

#define BLOCK 4096

int swiglu_fwd_bf16(const uint16_t *g, const uint16_t *u, uint16_t *h, int64_t n, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < n; b += BLOCK) {
        const int64_t e = b + BLOCK < n ? b + BLOCK : n;
        for (int64_t i = b; i < e; i++) {
            const float x = bf16f(g[i]), silu = x < -80.0f ? 0.0f : x / (1.0f + exp_neg(x));
            h[i] = rne(bf16f(rne(silu)) * bf16f(u[i]));
        }
    }
    return 0;
}

int swiglu_bwd_bf16(const uint16_t *dh, const uint16_t *g, const uint16_t *u, uint16_t *dg, uint16_t *du,
                    int64_t n, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < n; b += BLOCK) {
        const int64_t e = b + BLOCK < n ? b + BLOCK : n;
        for (int64_t i = b; i < e; i++) {
            const float x = bf16f(g[i]), d = bf16f(dh[i]), en = exp_neg(x);
            const float sg = x < -80.0f ? 0.0f : 1.0f / (1.0f + en), silu = x < -80.0f ? 0.0f : x / (1.0f + en);
            const float ds = bf16f(rne(d * bf16f(u[i])));
            du[i] = rne(d * bf16f(rne(silu)));
            dg[i] = rne(ds * (sg * (1.0f + x * (1.0f - sg))));
        }
    }
    return 0;
}

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
