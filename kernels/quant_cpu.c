/* Matrix multiplies on weights kept in GGUF's blocks of 32, for the CPU: y = x W^T with x
 * and y fp32 and W as the file stores it, Q4_0, Q4_1 or Q8_0. Decoding a token reads every
 * weight once, and at batch 1 the time goes in reading them: the engine's fp32 copy of a
 * weight is 4.3 to 6.4 times these bytes.
 *
 * Each weight is dequantized in registers as the file's reader dequantizes it (a Q4 block's
 * 16 values d * q + m computed once, then looked up by nibble; a Q8_0 weight d * q) and
 * multiplied with the fp32 activations: the result is the dequantized model's up to the
 * order of the sums. That order depends on K alone, never on the batch a row came in.
 *
 * Layouts, one row of W an output, row-major:
 *   Q4: qs [N, K/2] bytes, block b's byte j holds element 32b+j (low nibble) and 32b+16+j
 *       (high); scales [N, K/32, 2] fp16 (d, m): element = d * nibble + m (Q4_0: m = -8d).
 *   Q8: qs [N, K] int8; scales [N, K/32] fp16 d: element = d * q.
 * x [M, K], y [M, N], contiguous. K is a multiple of 32.
 *
 * Written for AVX-512 (quant_simd() says whether this build has it: the compiler's target,
 * -march=native, has AVX512F). The portable code computes the same sums with plain C (fp16
 * scales read as bits, no _Float16, no intrinsics), so that the file builds with any C
 * compiler on any CPU; it is not fast, and the engine then keeps to fp32 matmuls.
 *
 * q4_dequantize_f32 and q8_dequantize_f32 write a matrix out in fp32, each weight the float
 * gguf's reader computes (d * q, then + m: two roundings), for batches large enough that
 * fp32 matmuls on a copy made for the call beat the block kernels.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLOCK 32
#define ROWS 4 /* rows of x a block of W is unpacked for at once */
#define COLS 8 /* rows of W that meet a tile of x while both are in L1 */

int quant_simd(void)
{
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* An IEEE half (as its bits) as a float, exactly: the portable path's conversion. */
static inline float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 31) /* inf, nan */
        v.u = sign | 0x7f800000 | man << 13;
    else if (exp) /* normal */
        v.u = sign | (exp + 112) << 23 | man << 13;
    else { /* zero, subnormal: man * 2^-24 */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
}

#if defined(__AVX512F__)

static inline void to_floats(const uint16_t *h, float *f, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
    for (; i < n; i++)
        f[i] = half_to_float(h[i]);
}

/* The block's 32 weights as two vectors: elements 0-15, 16-31. A Q4 block's 16 values are
 * one vector, looked up by nibble (vpermps reads an index's low 4 bits alone). */
static inline void q4_block(const uint8_t *qs, const float *dm, __m512 *lo, __m512 *hi)
{
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(dm[0]), iota, _mm512_set1_ps(dm[1]));
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    *lo = _mm512_permutexvar_ps(bytes, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

static inline void q8_block(const int8_t *qs, float d, __m512 *lo, __m512 *hi)
{
    __m512 scale = _mm512_set1_ps(d);
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128((const __m128i *)qs))), scale);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128((const __m128i *)(qs + 16)))), scale);
}

/* y[r * N] = x[r] . W[n] for r < rows (rows <= ROWS); x advanced to row 0, y to column n,
 * qs and s (the scales as floats) to row n. Two sums a row, of the blocks' first and second
 * halves: two chains of FMAs, not one. */
#define DOT_ROWS(NAME, UNPACK)                                                              \
    static inline __attribute__((always_inline)) void NAME(                               \
        const float *x, int64_t K, const int rows, const void *qs, const float *s,        \
        float *y, int64_t N)                                                              \
    {                                                                                     \
        __m512 acc[ROWS][2];                                                              \
        for (int r = 0; r < ROWS; r++)                                                    \
            acc[r][0] = acc[r][1] = _mm512_setzero_ps();                                  \
        for (int64_t b = 0; b < K / BLOCK; b++) {                                         \
            __m512 lo, hi;                                                                \
            UNPACK;                                                                       \
            for (int r = 0; r < rows; r++) {                                              \
                const float *xr = x + r * K + b * BLOCK;                                  \
                acc[r][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r][0]);          \
                acc[r][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r][1]);     \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < rows; r++)                                                    \
            y[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));         \
    }

DOT_ROWS(q4_dot, q4_block((const uint8_t *)qs + b * 16, s + 2 * b, &lo, &hi))
DOT_ROWS(q8_dot, q8_block((const int8_t *)qs + b * BLOCK, s[b], &lo, &hi))

#else /* portable: the same sums, one block dequantized to 32 floats at a time */

static inline void to_floats(const uint16_t *h, float *f, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        f[i] = half_to_float(h[i]);
}

static inline void q4_block(const uint8_t *qs, const float *dm, float *w)
{
    for (int j = 0; j < 16; j++) {
        w[j] = dm[0] * (float)(qs[j] & 15) + dm[1];
        w[16 + j] = dm[0] * (float)(qs[j] >> 4) + dm[1];
    }
}

static inline void q8_block(const int8_t *qs, float d, float *w)
{
    for (int j = 0; j < BLOCK; j++)
        w[j] = d * (float)qs[j];
}

#define DOT_ROWS(NAME, UNPACK)                                                              \
    static inline void NAME(const float *x, int64_t K, const int rows, const void *qs,    \
                            const float *s, float *y, int64_t N)                          \
    {                                                                                     \
        float acc[ROWS][16] = {{0}};                                                      \
        for (int64_t b = 0; b < K / BLOCK; b++) {                                         \
            float w[BLOCK];                                                               \
            UNPACK;                                                                       \
            for (int r = 0; r < rows; r++) {                                              \
                const float *xr = x + r * K + b * BLOCK;                                  \
                for (int l = 0; l < 16; l++)                                              \
                    acc[r][l] += w[l] * xr[l] + w[16 + l] * xr[16 + l];                   \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < rows; r++) {                                                  \
            float sum = 0.0f;                                                             \
            for (int l = 0; l < 16; l++)                                                  \
                sum += acc[r][l];                                                         \
            y[r * N] = sum;                                                               \
        }                                                                                 \
    }

DOT_ROWS(q4_dot, q4_block((const uint8_t *)qs + b * 16, s + 2 * b, w))
DOT_ROWS(q8_dot, q8_block((const int8_t *)qs + b * BLOCK, s[b], w))

#endif

/* W in blocks of COLS rows, each against the rows of x ROWS at a time. DOT gets the count of
 * rows as a constant, so that its sums stay in registers. */
#define LINEAR(NAME, DOT, QTYPE, BYTES_A_ROW, SCALES_A_ROW)                                  \
    void NAME(const float *x, int64_t M, int64_t K, const QTYPE *qs,                       \
              const uint16_t *scales, float *y, int64_t N)                                 \
    {                                                                                      \
        _Pragma("omp parallel for if (N * K >= 65536) schedule(static)")                   \
        for (int64_t n0 = 0; n0 < N; n0 += COLS)                                           \
            for (int64_t r = 0; r < M; r += ROWS)                                          \
                for (int64_t n = n0; n < n0 + COLS && n < N; n++) {                        \
                    float s[SCALES_A_ROW];                                                 \
                    to_floats(scales + n * (SCALES_A_ROW), s, SCALES_A_ROW);               \
                    const QTYPE *q = qs + n * (BYTES_A_ROW);                               \
                    const float *xr = x + r * K;                                           \
                    float *yr = y + r * N + n;                                             \
                    switch (M - r < ROWS ? M - r : ROWS) {                                 \
                    case 1: DOT(xr, K, 1, q, s, yr, N); break;                             \
                    case 2: DOT(xr, K, 2, q, s, yr, N); break;                             \
                    case 3: DOT(xr, K, 3, q, s, yr, N); break;                             \
                    default: DOT(xr, K, ROWS, q, s, yr, N);                                \
                    }                                                                      \
                }                                                                          \
    }

LINEAR(q4_linear_f32, q4_dot, uint8_t, K / 2, K / BLOCK * 2)
LINEAR(q8_linear_f32, q8_dot, int8_t, K, K / BLOCK)

/* W [N, K] in fp32, as gguf's reader dequantizes it. GCC would fuse d * q + m into one
 * rounding (-ffp-contract=fast, its default); the reader rounds twice. */
#if defined(__GNUC__) && !defined(__clang__)
#define TWO_ROUNDINGS __attribute__((optimize("fp-contract=off")))
#else
#define TWO_ROUNDINGS
#endif

TWO_ROUNDINGS void q4_dequantize_f32(const uint8_t *qs, const uint16_t *scales, float *w,
                                     int64_t N, int64_t K)
{
    _Pragma("omp parallel for if (N * K >= 65536) schedule(static)")
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < K / BLOCK; b++) {
            const uint8_t *q = qs + n * (K / 2) + b * 16;
            const float d = half_to_float(scales[(n * (K / BLOCK) + b) * 2]);
            const float m = half_to_float(scales[(n * (K / BLOCK) + b) * 2 + 1]);
            float *out = w + n * K + b * BLOCK;
#if defined(__AVX512F__) /* q4_block's lookup, its table rounded twice */
            const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                              1, 0);
            __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), iota),
                                         _mm512_set1_ps(m));
            __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
            _mm512_storeu_ps(out, _mm512_permutexvar_ps(bytes, table));
            _mm512_storeu_ps(out + 16,
                             _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table));
#else
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)(q[j] & 15) + m;
                out[16 + j] = d * (float)(q[j] >> 4) + m;
            }
#endif
        }
}

void q8_dequantize_f32(const int8_t *qs, const uint16_t *scales, float *w, int64_t N,
                       int64_t K)
{
    _Pragma("omp parallel for if (N * K >= 65536) schedule(static)")
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < K / BLOCK; b++) {
            const float d = half_to_float(scales[n * (K / BLOCK) + b]);
            for (int j = 0; j < BLOCK; j++)
                w[n * K + b * BLOCK + j] = d * (float)qs[n * K + b * BLOCK + j];
        }
}

/* ---------------------------------------------------------------------------------------
 * A whole decode step of a Llama-family model whose every matrix is in blocks above: the
 * layers, the final norm and the logits of the rows asked for, in one call. At batch 1 the
 * Python between a layer's ten kernels took longer than the layer's matmuls. The other
 * kernels are layer_cpu.c's and paged_cpu.c's, called through the pointers given, in the
 * order and with the arguments that symphony/engine/model.py gives them. */

typedef struct {
    int32_t format; /* 4: Q4 layout, 8: Q8 */
    const void *qs;
    const uint16_t *scales; /* fp16 bits */
    int64_t rows, cols;
} qmat_t;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *qkv_bias;               /* [rows of qkv] or NULL */
    const float *q_norm, *k_norm;        /* [head_dim] or NULL */
    const void *cache;                   /* paged_cpu.c's cache_t of this layer */
    qmat_t qkv, o, gate_up, down;
} layer_t;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    const layer_t *layers;
    const float *final_norm;
    qmat_t logits;
    void (*add_rms_norm)(const float *, float *, const float *, float *, int64_t, int64_t,
                         float);
    void (*silu_mul)(const float *, float *, int64_t, int64_t);
    void (*rotary)(float *, int64_t, int64_t, const float *, const float *, int64_t, int64_t,
                   int64_t);
    int (*store_kv)(const void *, const float *, const float *, int64_t, int64_t, int64_t,
                    int64_t, const int64_t *, int64_t);
    int (*decode)(const void *, const float *, int64_t, int64_t, const int32_t *, int64_t,
                  int64_t, const int32_t *, const int32_t *, int64_t, float *, int64_t, int,
                  float);
} model_t;

static void qlinear(const qmat_t *w, const float *x, int64_t rows, float *y)
{
    if (w->format == 4)
        q4_linear_f32(x, rows, w->cols, w->qs, w->scales, y, w->rows);
    else
        q8_linear_f32(x, rows, w->cols, w->qs, w->scales, y, w->rows);
}

/* x: [B, hidden], the tokens' embeddings, overwritten. cos, sin: [B, head_dim]; slots: [B];
 * page_table [B, width] (row stride stride_pt), kv_lens [B], excluded [B, num_ranges, 2] or
 * NULL: as paged_cpu.c takes them. logits: [n_rows, rows of m->logits], of x's rows `rows`.
 * Returns 0; -1 a slot, page or length out of bounds (nothing more is done); -2 no memory. */
int decode_step_f32(const model_t *m, float *x, int64_t B, const float *cos, const float *sin,
                    const int64_t *slots, const int32_t *page_table, int64_t stride_pt,
                    int64_t width, const int32_t *kv_lens, const int32_t *excluded,
                    int64_t num_ranges, const int64_t *rows, int64_t n_rows, float *logits)
{
    const int64_t H = m->hidden, D = m->head_dim, heads = m->heads + 2 * m->kv_heads;
    const int64_t q_size = m->heads * D, qkv_size = heads * D;
    int64_t sizes[] = {B * H, B * H, B * qkv_size, B * q_size, B * 2 * m->inter, B * m->inter,
                       n_rows * H};
    int64_t total = 0;
    for (int i = 0; i < 7; i++)
        total += sizes[i];
    float *buf = malloc(total * sizeof(float));
    if (buf == NULL)
        return -2;
    float *residual = buf, *h = residual + B * H, *qkv = h + B * H, *attn = qkv + B * qkv_size;
    float *gate_up = attn + B * q_size, *act = gate_up + B * 2 * m->inter;
    float *picked = act + B * m->inter;
    int err = 0;
    memcpy(residual, x, B * H * sizeof(float));
    for (int64_t i = 0; i < m->num_layers && !err; i++) {
        const layer_t *l = &m->layers[i];
        /* layer 0: no residual yet (the embeddings are it); after: residual += x */
        m->add_rms_norm(i ? x : residual, residual, l->input_norm, h, B, H, m->eps);
        qlinear(&l->qkv, h, B, qkv);
        if (l->qkv_bias)
            for (int64_t t = 0; t < B; t++)
                for (int64_t j = 0; j < qkv_size; j++)
                    qkv[t * qkv_size + j] += l->qkv_bias[j];
        if (l->q_norm)
            for (int64_t t = 0; t < B; t++) {
                float *q = qkv + t * qkv_size, *k = q + q_size;
                m->add_rms_norm(q, q, l->q_norm, q, m->heads, D, m->eps);
                m->add_rms_norm(k, k, l->k_norm, k, m->kv_heads, D, m->eps);
            }
        m->rotary(qkv, qkv_size, D, cos, sin, B, m->heads + m->kv_heads, D);
        const float *k = qkv + q_size, *v = k + m->kv_heads * D;
        err = m->store_kv(l->cache, k, v, qkv_size, D, qkv_size, D, slots, B);
        if (!err)
            err = m->decode(l->cache, qkv, qkv_size, D, page_table, stride_pt, width, kv_lens,
                            excluded, num_ranges, attn, B, (int)m->heads, m->scale);
        if (err)
            break;
        qlinear(&l->o, attn, B, x);
        m->add_rms_norm(x, residual, l->post_norm, h, B, H, m->eps);
        qlinear(&l->gate_up, h, B, gate_up);
        m->silu_mul(gate_up, act, B, m->inter);
        qlinear(&l->down, act, B, x);
    }
    if (!err) {
        m->add_rms_norm(x, residual, m->final_norm, h, B, H, m->eps);
        for (int64_t r = 0; r < n_rows; r++)
            memcpy(picked + r * H, h + rows[r] * H, H * sizeof(float));
        qlinear(&m->logits, picked, n_rows, logits);
    }
    free(buf);
    return err;
}
