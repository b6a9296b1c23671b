/* Paged KV kernels for the CPU, fp32: store new K/V rows, and decode attention that reads
 * keys and values in place through the page tables.
 *
 * The torch reference has to copy every sequence's pages out into a contiguous tensor
 * before its batched matmuls; on a small model that copy and the per-layer op overhead are
 * most of the attention time. Here one thread takes a sequence at a time and reads its
 * pages where they lie: keys row by row for every query head at once, values head by head,
 * and nothing is copied. Decode attention is bound by memory bandwidth, and this reads
 * each byte of K and V about once.
 *
 * Built by kernels/paged_cpu.py with OpenMP; torch's libgomp is already loaded by then, so
 * both share one thread team.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

/* A layer's cache is [pages, page_size, kv_heads, head_dim]; the strides are in floats and
 * head_dim is contiguous. */
typedef struct {
    float *k, *v;
    int64_t num_pages, stride_page, stride_slot, stride_head;
    int32_t page_size, num_kv_heads, head_dim;
} cache_t;

/* Returns -1, having stored nothing, if a slot lies outside the pool. */
int store_kv_f32(const cache_t *c, const float *k, const float *v, int64_t stride_kt,
                  int64_t stride_kh, int64_t stride_vt, int64_t stride_vh,
                  const int64_t *slots, int64_t num_tokens)
{
    size_t row = (size_t)c->head_dim * sizeof(float);
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= c->num_pages * c->page_size)
            return -1;
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slots[t];
        if (slot < 0)
            continue; /* a padding token: nothing to store */
        int64_t base = (slot / c->page_size) * c->stride_page
                     + (slot % c->page_size) * c->stride_slot;
        for (int h = 0; h < c->num_kv_heads; h++) {
            memcpy(c->k + base + h * c->stride_head, k + t * stride_kt + h * stride_kh, row);
            memcpy(c->v + base + h * c->stride_head, v + t * stride_vt + h * stride_vh, row);
        }
    }
    return 0;
}

/* Eight floats, loaded from any address: GCC lowers it to one AVX register, or to two SSE
 * ones without AVX, and keeps running sums in registers where plain arrays spill. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float hsum(v8 a)
{
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* Four independent running sums, so consecutive FMAs do not wait on each other. */
static inline float dot(const float *a, const float *b, int len)
{
    v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int d = 0;
    for (; d + 32 <= len; d += 32) {
        s0 += *(const v8 *)(a + d) * *(const v8 *)(b + d);
        s1 += *(const v8 *)(a + d + 8) * *(const v8 *)(b + d + 8);
        s2 += *(const v8 *)(a + d + 16) * *(const v8 *)(b + d + 16);
        s3 += *(const v8 *)(a + d + 24) * *(const v8 *)(b + d + 24);
    }
    for (; d + 8 <= len; d += 8)
        s0 += *(const v8 *)(a + d) * *(const v8 *)(b + d);
    float s = hsum((s0 + s1) + (s2 + s3));
    for (; d < len; d++)
        s += a[d] * b[d];
    return s;
}

/* Attention of one sequence's query heads over its first n rows: scores for every row (each
 * row's heads are contiguous, so rows stream in order), excluded rows set to -inf, softmax,
 * then the weighted sum of values. `scores` has room for num_q_heads * n floats. Returns -1,
 * having read nothing, if a page lies outside the pool. */
static int attend_sequence(const cache_t *c, const float *q, int64_t stride_qh,
                           int num_q_heads, const int32_t *pages, int64_t n,
                           const int32_t *ranges, int64_t num_ranges, float scale,
                           float *scores, float *out)
{
    const int d_len = c->head_dim, size = c->page_size, group = num_q_heads / c->num_kv_heads;
    for (int64_t j0 = 0; j0 < n; j0 += size)
        if (pages[j0 / size] < 0 || pages[j0 / size] >= c->num_pages)
            return -1;
    for (int64_t j0 = 0; j0 < n; j0 += size) {
        const float *row = c->k + pages[j0 / size] * c->stride_page;
        int64_t rows = n - j0 < size ? n - j0 : size;
        for (int64_t r = 0; r < rows; r++, row += c->stride_slot)
            for (int h = 0; h < num_q_heads; h++)
                scores[h * n + j0 + r] =
                    dot(q + h * stride_qh, row + (h / group) * c->stride_head, d_len) * scale;
    }
    for (int64_t e = 0; e < num_ranges; e++) {
        int64_t start = ranges[2 * e] < 0 ? 0 : ranges[2 * e];
        int64_t end = ranges[2 * e + 1] > n ? n : ranges[2 * e + 1];
        for (int h = 0; h < num_q_heads; h++)
            for (int64_t j = start; j < end; j++)
                scores[h * n + j] = -INFINITY;
    }
    float totals[num_q_heads];
    for (int h = 0; h < num_q_heads; h++) {
        float *sh = scores + h * n, top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < n; j++)
            top = sh[j] > top ? sh[j] : top;
        totals[h] = 0.0f;
        if (top == -INFINITY) { /* nothing to attend to: zeros, as the reference gives */
            memset(sh, 0, n * sizeof(float));
            continue;
        }
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < n; j++) {
            sh[j] = exp_f32(sh[j] - top);
            total += sh[j];
        }
        totals[h] = total;
    }
    /* Page by page, so a page of V is read from memory once and then from cache by every
     * head; within a page, head by head, 32 dims at a time with the running sums in
     * registers. Normalised at the end, once per output rather than once per row. */
    memset(out, 0, (size_t)num_q_heads * d_len * sizeof(float));
    for (int64_t j0 = 0; j0 < n; j0 += size) {
        const float *page = c->v + pages[j0 / size] * c->stride_page;
        const int64_t rows = n - j0 < size ? n - j0 : size;
        for (int h = 0; h < num_q_heads; h++) {
            const float *sh = scores + h * n + j0, *base = page + (h / group) * c->stride_head;
            float *oh = out + (int64_t)h * d_len;
            int d0 = 0;
            for (; d0 + 32 <= d_len; d0 += 32) {
                v8 a0 = *(v8 *)(oh + d0), a1 = *(v8 *)(oh + d0 + 8);
                v8 a2 = *(v8 *)(oh + d0 + 16), a3 = *(v8 *)(oh + d0 + 24);
                const float *row = base + d0;
                for (int64_t r = 0; r < rows; r++, row += c->stride_slot) {
                    const float p = sh[r];
                    a0 += p * *(const v8 *)row;
                    a1 += p * *(const v8 *)(row + 8);
                    a2 += p * *(const v8 *)(row + 16);
                    a3 += p * *(const v8 *)(row + 24);
                }
                *(v8 *)(oh + d0) = a0;
                *(v8 *)(oh + d0 + 8) = a1;
                *(v8 *)(oh + d0 + 16) = a2;
                *(v8 *)(oh + d0 + 24) = a3;
            }
            for (; d0 + 8 <= d_len; d0 += 8) {
                v8 a0 = *(v8 *)(oh + d0);
                const float *row = base + d0;
                for (int64_t r = 0; r < rows; r++, row += c->stride_slot)
                    a0 += sh[r] * *(const v8 *)row;
                *(v8 *)(oh + d0) = a0;
            }
            for (; d0 < d_len; d0++) {
                float acc = oh[d0];
                const float *row = base + d0;
                for (int64_t r = 0; r < rows; r++, row += c->stride_slot)
                    acc += sh[r] * *row;
                oh[d0] = acc;
            }
        }
    }
    for (int h = 0; h < num_q_heads; h++) {
        const float inv = totals[h] > 0.0f ? 1.0f / totals[h] : 0.0f;
        for (int d = 0; d < d_len; d++)
            out[(int64_t)h * d_len + d] *= inv;
    }
    return 0;
}

/* q [batch, num_q_heads, head_dim] (head_dim contiguous) -> out, contiguous, same shape.
 * Sequence b attends to its rows [0, kv_lens[b]) except its `num_ranges` half-open
 * `excluded` ranges ([batch, num_ranges, 2], contiguous; (0, 0) pads), through the first
 * pages of its row of the page table ([batch, table_width]).
 * Returns 0; -1 if a sequence needs more pages than the table has or a page outside the
 * pool; -2 out of memory. */
int decode_attention_f32(const cache_t *c, const float *q, int64_t stride_qb,
                         int64_t stride_qh, const int32_t *page_table, int64_t stride_pt,
                         int64_t table_width,
                         const int32_t *kv_lens, const int32_t *excluded, int64_t num_ranges,
                         float *out, int64_t batch, int num_q_heads, float scale)
{
    int failed = 0;
    for (int64_t b = 0; b < batch; b++)
        if (kv_lens[b] > table_width * c->page_size)
            return -1;
#pragma omp parallel
    {
        float *scores = NULL;
        int64_t room = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++) {
            int64_t n = kv_lens[b] > 0 ? kv_lens[b] : 0;
            if (n * num_q_heads > room) {
                free(scores);
                room = n * num_q_heads;
                scores = malloc(room * sizeof(float));
                room = scores == NULL ? 0 : room;
            }
            int err = n > 0 && scores == NULL ? -2 : 0;
            if (err == 0)
                err = attend_sequence(c, q + b * stride_qb, stride_qh, num_q_heads,
                                      page_table + b * stride_pt, n,
                                      excluded ? excluded + b * num_ranges * 2 : NULL,
                                      num_ranges, scale, scores, out + b * num_q_heads * c->head_dim);
            if (err) {
#pragma omp atomic write
                failed = err;
            }
        }
        free(scores);
    }
    return failed;
}
