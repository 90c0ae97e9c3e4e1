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
#include <stdint.h>
#include <string.h>
#include <math.h>

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
