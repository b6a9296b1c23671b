/* Paged KV kernels for the CPU, fp32: store new K/V rows, and decode and prefill attention
 * that read keys and values in place through the page tables.
 *
 * The torch reference has to copy every sequence's pages out into a contiguous tensor
 * before its batched matmuls; on a small model that copy and the per-layer op overhead are
 * most of the attention time. Here one thread takes a sequence at a time and reads its
 * pages where they lie: keys row by row for every query head at once, values head by head,
 * and nothing is copied. Decode attention is bound by memory bandwidth, and this reads
 * each byte of K and V about once.
 *
 * Prefill does the same for chunks of queries: each row of K and V read serves a block of
 * them (prefill_attention_f32).
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
    /* One sequence is one thread's work: no team to wake and wait for. */
#pragma omp parallel if (batch > 1)
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

/* Prefill attention (the engine leaves long prompts to SDPA): a task is one sequence's block
 * of up to QUERY_BLOCK query tokens on one KV head, all the query heads of its group
 * together, so each row of K and V read through the page table serves the whole block. Keys
 * go in blocks of KEY_BLOCK with an online softmax, so the scratch stays small however long
 * the context. The block's queries are transposed once, so scores come out eight queries to
 * a vector and the softmax runs down those vectors, with no horizontal sum per score. */
enum { QUERY_BLOCK = 16, KEY_BLOCK = 64 };

typedef struct {
    const int32_t *pages, *ranges, *bits; /* bits: the row of the block's first query */
    int64_t prefix, num_ranges, tree_start, words;
} seq_t;

/* out[row] = softmax(scores) @ V for rows r = (i - i0) * group + h, i in [i0, i1) of the
 * sequence's queries and h in the group of KV head g; query i sits at KV index prefix + i and
 * sees keys up to it, except excluded ones and, from tree_start on, those whose bit in its row
 * is clear. `scratch` has room for (head_dim + KEY_BLOCK + 4) * width + rows * head_dim
 * floats, width being rows rounded up to a multiple of 8. */
static void attend_block(const cache_t *c, const seq_t *s, const float *q, int64_t stride_qt,
                         int64_t stride_qh, int group, int g, int64_t i0, int64_t i1,
                         float scale, float *scratch, float *out, int64_t stride_ot)
{
    const int d_len = c->head_dim, size = c->page_size;
    const int64_t rows = (i1 - i0) * group, width = (rows + 7) / 8 * 8, kv_end = s->prefix + i1;
    float *qt = scratch, *scores = qt + d_len * width, *top = scores + KEY_BLOCK * width;
    float *total = top + width, *next = total + width, *alpha = next + width;
    float *acc = alpha + width;
    const float *krow[KEY_BLOCK], *vrow[KEY_BLOCK];
    /* qt[d][r], scaled; padding rows are zero and never written out. */
    memset(qt, 0, d_len * width * sizeof(float));
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q + (i0 + r / group) * stride_qt + (g * group + r % group) * stride_qh;
        for (int d = 0; d < d_len; d++)
            qt[d * width + r] = qr[d] * scale;
    }
    memset(acc, 0, rows * d_len * sizeof(float));
    for (int64_t r = 0; r < width; r++) {
        top[r] = -INFINITY;
        total[r] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < kv_end; j0 += KEY_BLOCK) {
        const int64_t nb = kv_end - j0 < KEY_BLOCK ? kv_end - j0 : KEY_BLOCK;
        for (int64_t jj = 0; jj < nb; jj++) {
            int64_t j = j0 + jj, at = s->pages[j / size] * c->stride_page
                                      + (j % size) * c->stride_slot + g * c->stride_head;
            krow[jj] = c->k + at;
            vrow[jj] = c->v + at;
        }
        for (int64_t jj = nb; jj % 8; jj++) /* scores past nb are computed, never read */
            krow[jj] = krow[0];
        /* Eight keys by eight queries at a time: eight independent sums per loaded vector. */
        for (int64_t r0 = 0; r0 < width; r0 += 8)
            for (int64_t jj = 0; jj < nb; jj += 8) {
                const float **k = krow + jj;
                v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
                for (int d = 0; d < d_len; d++) {
                    const v8 x = *(const v8 *)(qt + d * width + r0);
                    a0 += k[0][d] * x;
                    a1 += k[1][d] * x;
                    a2 += k[2][d] * x;
                    a3 += k[3][d] * x;
                    a4 += k[4][d] * x;
                    a5 += k[5][d] * x;
                    a6 += k[6][d] * x;
                    a7 += k[7][d] * x;
                }
                float *sc = scores + jj * width + r0;
                *(v8 *)sc = a0;
                *(v8 *)(sc + width) = a1;
                *(v8 *)(sc + 2 * width) = a2;
                *(v8 *)(sc + 3 * width) = a3;
                *(v8 *)(sc + 4 * width) = a4;
                *(v8 *)(sc + 5 * width) = a5;
                *(v8 *)(sc + 6 * width) = a6;
                *(v8 *)(sc + 7 * width) = a7;
            }
        /* Masks: causality (key j is past the rows before (j - prefix - i0) * group), the
         * excluded ranges, then the tree. */
        for (int64_t jj = 0; jj < nb; jj++) {
            int64_t past = (j0 + jj - s->prefix - i0) * group;
            for (int64_t r = 0; r < (past < width ? past : width); r++)
                scores[jj * width + r] = -INFINITY;
        }
        for (int64_t e = 0; e < s->num_ranges; e++) {
            int64_t start = s->ranges[2 * e] - j0, end = s->ranges[2 * e + 1] - j0;
            for (int64_t jj = start < 0 ? 0 : start; jj < (end > nb ? nb : end); jj++)
                for (int64_t r = 0; r < width; r++)
                    scores[jj * width + r] = -INFINITY;
        }
        for (int64_t jj = s->tree_start - j0 < 0 ? 0 : s->tree_start - j0; jj < nb; jj++) {
            const int64_t t = j0 + jj - s->tree_start;
            const uint32_t *bits = (const uint32_t *)s->bits + t / 32;
            for (int64_t r = 0; r < rows; r++)
                if (!((bits[(r / group) * s->words] >> (t % 32)) & 1))
                    scores[jj * width + r] = -INFINITY;
        }
        /* Online softmax; a row with nothing allowed yet keeps top = -inf and subtracts 0
         * instead, so its weights are exp(-inf) = 0, not NaN. */
        memcpy(next, top, width * sizeof(float));
        for (int64_t jj = 0; jj < nb; jj++) {
            const float *sc = scores + jj * width;
#pragma omp simd
            for (int64_t r = 0; r < width; r++)
                next[r] = sc[r] > next[r] ? sc[r] : next[r];
        }
#pragma omp simd
        for (int64_t r = 0; r < width; r++) {
            const float m = next[r], safe = m == -INFINITY ? 0.0f : m;
            alpha[r] = exp_f32(top[r] - safe);
            total[r] *= alpha[r];
            top[r] = m;
            next[r] = safe;
        }
        for (int64_t jj = 0; jj < nb; jj++) {
            float *sc = scores + jj * width;
#pragma omp simd
            for (int64_t r = 0; r < width; r++) {
                sc[r] = exp_f32(sc[r] - next[r]);
                total[r] += sc[r];
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            const float a = alpha[r], *p = scores + r;
            float *ar = acc + r * d_len;
            int d0 = 0;
            for (; d0 + 32 <= d_len; d0 += 32) {
                v8 a0 = *(v8 *)(ar + d0) * a, a1 = *(v8 *)(ar + d0 + 8) * a;
                v8 a2 = *(v8 *)(ar + d0 + 16) * a, a3 = *(v8 *)(ar + d0 + 24) * a;
                for (int64_t jj = 0; jj < nb; jj++) {
                    const float w = p[jj * width], *v = vrow[jj] + d0;
                    a0 += w * *(const v8 *)v;
                    a1 += w * *(const v8 *)(v + 8);
                    a2 += w * *(const v8 *)(v + 16);
                    a3 += w * *(const v8 *)(v + 24);
                }
                *(v8 *)(ar + d0) = a0;
                *(v8 *)(ar + d0 + 8) = a1;
                *(v8 *)(ar + d0 + 16) = a2;
                *(v8 *)(ar + d0 + 24) = a3;
            }
            for (; d0 + 8 <= d_len; d0 += 8) {
                v8 a0 = *(v8 *)(ar + d0) * a;
                for (int64_t jj = 0; jj < nb; jj++)
                    a0 += p[jj * width] * *(const v8 *)(vrow[jj] + d0);
                *(v8 *)(ar + d0) = a0;
            }
            for (; d0 < d_len; d0++) {
                float sum = ar[d0] * a;
                for (int64_t jj = 0; jj < nb; jj++)
                    sum += p[jj * width] * vrow[jj][d0];
                ar[d0] = sum;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f; /* nothing seen: zeros */
        float *o = out + (i0 + r / group) * stride_ot + (int64_t)(g * group + r % group) * d_len;
        for (int d = 0; d < d_len; d++)
            o[d] = acc[r * d_len + d] * inv;
    }
}

/* q [tokens, num_q_heads, head_dim] (head_dim contiguous) -> out, contiguous, same shape;
 * rows outside every sequence are left as they are. Sequence b's queries are rows
 * [q_start[b], q_start[b + 1]); it has kv_lens[b] rows of K/V, the new ones last, and
 * excluded ranges as in decode_attention_f32. tree_start ([batch]; NULL for no trees) and
 * tree_bits ([tokens, words], contiguous) as in kernels/prefill_attention.py.
 * Returns 0; -1 if the per-sequence arguments disagree, or a sequence needs more pages than
 * the table has, a page outside the pool or more tree bits than given; -2 out of memory. */
int prefill_attention_f32(const cache_t *c, const float *q, int64_t stride_qt,
                          int64_t stride_qh, const int32_t *page_table, int64_t stride_pt,
                          int64_t table_width, const int32_t *q_start, const int32_t *kv_lens,
                          const int32_t *excluded, int64_t num_ranges,
                          const int32_t *tree_start, const int32_t *tree_bits, int64_t words,
                          float *out, int64_t batch, int64_t num_tokens, int num_q_heads,
                          float scale)
{
    const int group = num_q_heads / c->num_kv_heads;
    int64_t blocks = 0;
    for (int64_t b = 0; b < batch; b++) {
        int64_t q_len = (int64_t)q_start[b + 1] - q_start[b], n = kv_lens[b];
        int64_t ts = tree_start ? tree_start[b] : INT32_MAX;
        if (q_start[b] < 0 || q_len < 0 || q_start[b + 1] > num_tokens || q_len > n
                || n > table_width * c->page_size || ts < 0
                || (ts < n && (n - ts + 31) / 32 > words))
            return -1;
        for (int64_t p = 0; p * c->page_size < n; p++) {
            const int32_t page = page_table[b * stride_pt + p];
            if (page < 0 || page >= c->num_pages)
                return -1;
        }
        int64_t nb = (q_len + QUERY_BLOCK - 1) / QUERY_BLOCK;
        blocks = nb > blocks ? nb : blocks;
    }
    const int64_t tasks = blocks * c->num_kv_heads, rows = (int64_t)QUERY_BLOCK * group;
    const int64_t room = (c->head_dim + KEY_BLOCK + 4) * ((rows + 7) / 8 * 8)
                         + rows * c->head_dim;
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(room * sizeof(float));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = -2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < batch * tasks; task++) {
            const int64_t b = task / tasks, i0 = task % tasks / c->num_kv_heads * QUERY_BLOCK;
            const int g = task % c->num_kv_heads;
            const int64_t first = q_start[b], q_len = q_start[b + 1] - first;
            const int64_t stride_ot = (int64_t)num_q_heads * c->head_dim;
            if (scratch == NULL || i0 >= q_len)
                continue;
            const int64_t i1 = q_len - i0 < QUERY_BLOCK ? q_len : i0 + QUERY_BLOCK;
            seq_t s = {page_table + b * stride_pt,
                       excluded ? excluded + b * num_ranges * 2 : NULL,
                       tree_bits ? tree_bits + (first + i0) * words : NULL,
                       kv_lens[b] - q_len, excluded ? num_ranges : 0,
                       tree_start ? tree_start[b] : INT64_MAX, words};
            attend_block(c, &s, q + first * stride_qt, stride_qt, stride_qh, group, g, i0, i1,
                         scale, scratch, out + first * stride_ot, stride_ot);
        }
        free(scratch);
    }
    return failed;
}
