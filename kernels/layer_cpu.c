/* The per-token work of a decoder layer between its matrix multiplies, for the CPU, fp32:
 * residual add with RMSNorm, rotary embedding, SiLU-gated product.
 *
 * In eager torch each of these is several ops (the norm alone is five), and at decode
 * batch sizes each op costs more in dispatch and thread wake-ups than in arithmetic. One
 * pass over the rows here does what those ops do, in the order they do it.
 */

#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

/* Sums row `x` of length n in eight lanes; the same order for every row and thread count,
 * so a token's result does not depend on the batch it came in. */
static inline float sum_squares(const float *x, int64_t n)
{
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            acc[l] += x[i + l] * x[i + l];
    for (; i < n; i++)
        acc[0] += x[i] * x[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* residual += x (when residual is given; else residual = x), then
 * out = residual / rms(residual) * weight. All [rows, n], contiguous. */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                      int64_t rows, int64_t n, float eps)
{
#pragma omp parallel for if (rows * n >= 32768) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *res = residual + r * n, *o = out + r * n;
        if (res != xr)
            for (int64_t i = 0; i < n; i++)
                res[i] += xr[i];
        float inv = 1.0f / sqrtf(sum_squares(res, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++)
            o[i] = res[i] * inv * weight[i];
    }
}

/* out[r] = silu(gate_up[r, :n]) * gate_up[r, n:]; gate_up [rows, 2n], out [rows, n]. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t n)
{
#pragma omp parallel for if (rows * n >= 32768) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}

/* In place on x [tokens, heads, head_dim] (head_dim contiguous, the given strides in
 * floats): the halves rotation x * cos + (x2, x1) * sin, with sin's first half negated by
 * the caller; cos and sin are [tokens, head_dim], contiguous. */
void rotary_f32(float *x, int64_t stride_t, int64_t stride_h, const float *cos_t,
                const float *sin_t, int64_t tokens, int64_t heads, int64_t head_dim)
{
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (tokens * heads * head_dim >= 32768) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * head_dim, *s = sin_t + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * stride_t + h * stride_h, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] + b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}
