/* Row-wise softmax statistics and logprob gradients of fp32 logits, CPU: the non-GEMM half of
 * the trainer's chunked LM head (arealite/train_engine/lm_head.py) fused into two passes per row
 * (one row of a 49k-152k vocabulary, 0.2-0.6 MB, stays in L2 between them), instead of the 5-6
 * whole-chunk tensor ops (logsumexp, sub, exp, bmm; exp, mul, scatter, cast) and the 300 MB
 * temporaries they allocate per chunk.
 *
 * With z = s * logits (s = 1 / temperature), p = softmax(z), y the label of the row:
 *     lse      = log sum_j exp(z_j)                = s * zmax + log sum_j exp(s * (logits_j - zmax))
 *     logprob  = z_y - lse                         = s * (logits_y - zmax) - log sum_j ...
 *     entropy  = -sum_j p_j log p_j                = log S - (sum_j e_j d_j) / S, with d_j = s * (logits_j
 *                                                  - zmax) <= 0, e_j = exp(d_j), S = sum_j e_j: both terms
 *                                                  are >= 0, so nothing cancels (lse - sum p z would, at low
 *                                                  entropy), and one exp per element serves sum and entropy
 *     g_j      = s * g_lp * (1[j = y] - p_j)       d(g_lp * logprob) / d logits_j
 *
 * Threads: OpenMP over rows, on torch's libgomp (see arealite/native/__init__.py).
 * Built with -ffast-math: gcc vectorises expf (glibc's libmvec); no infinities occur for finite
 * logits (exp of values <= 0 only). The caller checks 0 <= labels < V. Returns 0.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

/* exp of x <= 0, its argument floored at -87 (exp(-87) = 1.6e-38, fp32's smallest normals):
 * libmvec's vector expf computes a whole vector on a scalar path when one lane is below about
 * -87.3, which made a row whose logits span more than 87 (a confident policy, a low temperature)
 * 10-20x slower (2026-12-05, 2-core Xeon: 393 ms against 20 ms for [512, 49152]). The floor
 * changes a probability below 1.6e-38 into 1.6e-38: V of them add less than 1e-32 to a sum >= 1. */
static inline float exp_neg(float x) { return expf(fmaxf(x, -87.0f)); }

static inline uint16_t f32_to_bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* finite inputs only (|g| <= |s * g_lp|) */
    return (uint16_t)(u >> 16);
}

/* logits [M, V] fp32 (row stride ld), labels [M] int64 -> logprob, entropy, lse [M] fp32. */
int softmax_stats_f32(const float *logits, int64_t ld, const int64_t *labels, int64_t M, int64_t V,
                      float s, float *logprob, float *entropy, float *lse, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < M; i++) {
        const float *z = logits + i * ld;
        float zmax = z[0]; /* V >= 1; no -INFINITY under -ffast-math */
        for (int64_t j = 1; j < V; j++) zmax = fmaxf(zmax, z[j]);
        float sum = 0.0f, ed = 0.0f; /* sum_j e_j and sum_j e_j d_j, e_j = exp(d_j), d_j <= 0 */
        for (int64_t j = 0; j < V; j++) {
            const float d = s * (z[j] - zmax), e = exp_neg(d);
            sum += e;
            ed += e * d;
        }
        const float log_sum = logf(sum); /* in [0, log V] */
        lse[i] = s * zmax + log_sum;
        logprob[i] = s * (z[labels[i]] - zmax) - log_sum;
        entropy[i] = log_sum - ed / sum; /* two terms >= 0: nothing cancels */
    }
    return 0;
}

/* g [M, V] bf16 (row stride ldg) = s * g_lp * (onehot(labels) - exp(s * logits - lse)). */
int logprob_grad_bf16(const float *logits, int64_t ld, const float *lse, const float *g_lp,
                      const int64_t *labels, int64_t M, int64_t V, float s, uint16_t *g, int64_t ldg,
                      int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < M; i++) {
        const float *z = logits + i * ld;
        uint16_t *out = g + i * ldg;
        const float l = lse[i], c = -s * g_lp[i];
        for (int64_t j = 0; j < V; j++) out[j] = f32_to_bf16_rne(c * exp_neg(s * z[j] - l));
        out[labels[i]] = f32_to_bf16_rne(c * exp_neg(s * z[labels[i]] - l) + s * g_lp[i]);
    }
    return 0;
}
