/* Paged decode attention on the CPU, float32: one new token per sequence attends to its
 * context read in place through the block table (no gather into a contiguous copy).
 *
 * Built and loaded by worker/attention/native.py (cc -O3 -march=native -ffast-math -shared);
 * called through ctypes, which releases the GIL, so Python threads split the work items.
 *
 * Layouts (element strides, float32):
 *   q / out   row r, head h at  base + r * row_stride + h * head_stride, head_dim contiguous
 *   k/v cache [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables  int32, row i of sequence i at  block_tables + i * table_stride
 *   rows      int64 [n]: the q/out row of decode i;   seq_lens int32 [n]: its context length
 * A work item is (decode i, kv head g): the heads sharing that kv head (GQA group) are done
 * together, so every K/V row is read once per item. Scores use a two-pass softmax in a
 * per-item buffer of group * seq_len floats.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; j++) acc[j] += a[d + j] * b[d + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < n; d++) s += a[d] * b[d];
  return s;
}

/* Items [item_begin, item_end) of n * num_kv_heads; returns 0, or -1 if out of memory. */
int kvc_paged_decode_f32(const float *q, int64_t q_row_stride, int64_t q_head_stride,
                         float *out, int64_t out_row_stride, int64_t out_head_stride,
                         const int64_t *rows, const float *k_cache, const float *v_cache,
                         const int32_t *block_tables, int64_t table_stride,
                         const int32_t *seq_lens, int64_t item_begin, int64_t item_end,
                         int num_heads, int num_kv_heads, int head_dim, int block_size,
                         float scale, int window) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
  int64_t cap = 0;
  float *scores = NULL;
  float *acc = (float *)malloc(sizeof(float) * group * head_dim);
  if (!acc) return -1;
  for (int64_t item = item_begin; item < item_end; item++) {
    const int64_t i = item / num_kv_heads;
    const int kvh = (int)(item % num_kv_heads);
    const int len = seq_lens[i];
    const int start = (window > 0 && len > window) ? len - window : 0;
    const int span = len - start;
    if ((int64_t)group * span > cap) {
      cap = (int64_t)group * span * 2;
      free(scores);
      scores = (float *)malloc(sizeof(float) * cap);
      if (!scores) { free(acc); return -1; }
    }
    const int32_t *table = block_tables + i * table_stride;
    const float *qi = q + rows[i] * q_row_stride + (int64_t)kvh * group * q_head_stride;
    for (int t = start; t < len; t++) {
      const float *k = k_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) *
                                     token_stride + (int64_t)kvh * head_dim;
      for (int g = 0; g < group; g++)
        scores[(int64_t)g * span + (t - start)] = dot(qi + g * q_head_stride, k, head_dim) * scale;
    }
    float inv_sum[64];
    float *inv = group <= 64 ? inv_sum : (float *)malloc(sizeof(float) * group);
    if (!inv) { free(scores); free(acc); return -1; }
    for (int g = 0; g < group; g++) {
      float *s = scores + (int64_t)g * span;
      float m = s[0];
      for (int t = 1; t < span; t++) m = s[t] > m ? s[t] : m;
      float sum = 0.0f;
      for (int t = 0; t < span; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
      inv[g] = 1.0f / sum;
    }
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int t = start; t < len; t++) {
      const float *v = v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) *
                                     token_stride + (int64_t)kvh * head_dim;
      for (int g = 0; g < group; g++) {
        const float p = scores[(int64_t)g * span + (t - start)];
        float *a = acc + g * head_dim;
        for (int d = 0; d < head_dim; d++) a[d] += p * v[d];
      }
    }
    float *oi = out + rows[i] * out_row_stride + (int64_t)kvh * group * out_head_stride;
    for (int g = 0; g < group; g++)
      for (int d = 0; d < head_dim; d++)
        oi[g * out_head_stride + d] = acc[g * head_dim + d] * inv[g];
    if (inv != inv_sum) free(inv);
  }
  free(scores);
  free(acc);
  return 0;
}
