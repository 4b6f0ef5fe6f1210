/* Paged decode attention on the CPU, float32: one new token per sequence attends to its
 * context read in place through the block table (no gather into a contiguous copy).
 *
 * Built and loaded by worker/attention/native.py (cc -O3 -march=native, see CFLAGS there);
 * called through ctypes, which releases the GIL, so Python threads split the work items.
 *
 * Layouts (element strides, float32):
 *   q / out   row r, head h at  base + r * row_stride + h * head_stride, head_dim contiguous
 *   k/v cache [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables  int32, row i of sequence i at  block_tables + i * table_stride
 *   rows      int64 [n]: the q/out row of decode i;   seq_lens int32 [n]: its context length
 * A work item is one decode: token by token it reads the K (then V) row of all kv heads at
 * once — contiguous memory, 16 rows per block — which streams about twice as fast as walking
 * one kv head at a time (a 1 KB stride). Scores use a two-pass softmax in a per-item buffer of
 * num_heads * seq_len floats; the exponentials are computed 8 at a time (exp8: Cephes' expf
 * polynomial, within 2 ulp of expf; libm's scalar expf was a fifth of the kernel's time).
 * Head dims that are a multiple of 16 take 16-wide paths (one AVX-512 register, or two AVX2
 * ones): q . k with one reduction per score, and p . V with the output of a head kept in
 * registers across the tokens (64 dims at a time) instead of loaded and stored per token.
 * Tokens are walked block by block (no division per token).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline float hsum8(v8f acc) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static inline v8f load8(const float *p) {
  v8f v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
  v8f acc0 = {0}, acc1 = {0};
  int d = 0;
  for (; d + 16 <= n; d += 16) {
    acc0 += load8(a + d) * load8(b + d);
    acc1 += load8(a + d + 8) * load8(b + d + 8);
  }
  if (d + 8 <= n) {
    acc0 += load8(a + d) * load8(b + d);
    d += 8;
  }
  float s = hsum8(acc0 + acc1);
  for (; d < n; d++) s += a[d] * b[d];
  return s;
}

typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));

static inline v16f load16(const float *p) {
  v16f v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

static inline float hsum16(v16f a) {
  v8f lo, hi;
  memcpy(&lo, &a, sizeof lo);
  memcpy(&hi, (const char *)&a + sizeof lo, sizeof hi);
  return hsum8(lo + hi);
}

/* q . k over n dims, n a multiple of 16 */
static inline float dot16(const float *restrict a, const float *restrict b, int n) {
  v16f acc0 = {0}, acc1 = {0};
  int d = 0;
  for (; d + 32 <= n; d += 32) {
    acc0 += load16(a + d) * load16(b + d);
    acc1 += load16(a + d + 16) * load16(b + d + 16);
  }
  if (d < n) acc0 += load16(a + d) * load16(b + d);
  return hsum16(acc0 + acc1);
}

/* e^x for 8 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' degree-7 polynomial, 2^n by
 * the exponent bits. Inputs below -87.3 (softmax terms ~1e-38 of the maximum) give ~1e-38. */
static inline v8f exp8(v8f x) {
  const v8f hi = {88.37626f, 88.37626f, 88.37626f, 88.37626f,
                  88.37626f, 88.37626f, 88.37626f, 88.37626f};
  const v8f lo = {-87.33654f, -87.33654f, -87.33654f, -87.33654f,
                  -87.33654f, -87.33654f, -87.33654f, -87.33654f};
  v8i gt = x > hi, lt = x < lo;
  x = (v8f)(((v8i)hi & gt) | ((v8i)x & ~gt));
  x = (v8f)(((v8i)lo & lt) | ((v8i)x & ~lt));
  v8f fx = x * 1.44269504088896341f + 0.5f;
  v8i n = __builtin_convertvector(fx, v8i); /* truncates: floor for fx >= 0 */
  v8f fn = __builtin_convertvector(n, v8f);
  v8i over = fn > fx; /* fx < 0 and not whole: one less */
  n += over;          /* (-1 where true) */
  fn = __builtin_convertvector(n, v8f);
  x = x - fn * 0.693359375f - fn * -2.12194440e-4f;
  v8f z = x * x;
  v8f y = x * 1.9875691500E-4f + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * z + x + 1.0f;
  v8i bits = (n + 127) << 23;
  return y * (v8f)bits;
}

/* s[0..n) = e^(s - m) in place; returns their sum. */
static inline float exp_sum(float *s, int n, float m) {
  v8f acc = {0};
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    v8f e = exp8(load8(s + j) - m);
    memcpy(s + j, &e, sizeof e);
    acc += e;
  }
  float sum = hsum8(acc);
  for (; j < n; j++) {
    s[j] = expf(s[j] - m);
    sum += s[j];
  }
  return sum;
}

static inline float max_of(const float *s, int n) {
  float m = s[0];
  for (int j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
  return m;
}

/* out[0..head_dim) = inv * sum_t p[t] v_t[voff ..] for one head (head_dim a multiple of 16):
 * 64 dims at a time in four registers across all tokens, block by block. */
static void pv_wide(const float *p, const float *v_cache, const int32_t *table, int start,
                    int len, int block_size, int64_t token_stride, int64_t voff, int head_dim,
                    float inv, float *out) {
  for (int d0 = 0; d0 < head_dim; d0 += 64) {
    const int width = head_dim - d0 < 64 ? head_dim - d0 : 64;
    v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    const float *pt = p;
    for (int t = start; t < len;) {
      const int off = t % block_size;
      const int run = block_size - off < len - t ? block_size - off : len - t;
      const float *v =
          v_cache + ((int64_t)table[t / block_size] * block_size + off) * token_stride + voff + d0;

      if (width == 64) {
        for (int j = 0; j < run; j++, v += token_stride) {
          const v16f w = (v16f){0} + pt[j];
          a0 += w * load16(v);
          a1 += w * load16(v + 16);
          a2 += w * load16(v + 32);
          a3 += w * load16(v + 48);
        }
      } else {
        for (int j = 0; j < run; j++, v += token_stride) {
          const v16f w = (v16f){0} + pt[j];
          a0 += w * load16(v);
          if (width > 16) a1 += w * load16(v + 16);
          if (width > 32) a2 += w * load16(v + 32);
        }
      }
      pt += run;
      t += run;
    }
    store16(out + d0, a0 * inv);
    if (width > 16) store16(out + d0 + 16, a1 * inv);
    if (width > 32) store16(out + d0 + 32, a2 * inv);
    if (width > 48) store16(out + d0 + 48, a3 * inv);
  }
}

/* Items [item_begin, item_end) are decodes (sequences). Returns 0, or -1 if out of memory. */
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
  float *acc = (float *)malloc(sizeof(float) * num_heads * head_dim);
  float *inv = (float *)malloc(sizeof(float) * num_heads);
  if (!acc || !inv) { free(acc); free(inv); return -1; }
  for (int64_t i = item_begin; i < item_end; i++) {
    const int len = seq_lens[i];
    const int start = (window > 0 && len > window) ? len - window : 0;
    const int span = len - start;
    if ((int64_t)num_heads * span > cap) {
      cap = (int64_t)num_heads * span * 2;
      free(scores);
      scores = (float *)malloc(sizeof(float) * cap);
      if (!scores) { free(acc); free(inv); return -1; }
    }
    const int32_t *table = block_tables + i * table_stride;
    const float *qi = q + rows[i] * q_row_stride;
    float *oi = out + rows[i] * out_row_stride;
    /* scores[h][t] = q_h . k_t * scale, token by token (one contiguous row of all kv heads),
     * block by block */
    const int wide = head_dim % 16 == 0;
    for (int t = start; t < len;) {
      const int off = t % block_size;
      const int run = block_size - off < len - t ? block_size - off : len - t;
      const float *k = k_cache + ((int64_t)table[t / block_size] * block_size + off) * token_stride;

      for (int j = 0; j < run; j++, k += token_stride) {
        float *st = scores + (t + j - start);
        for (int h = 0; h < num_heads; h++) {
          const float *qh = qi + h * q_head_stride, *kh = k + (int64_t)(h / group) * head_dim;
          st[(int64_t)h * span] = (wide ? dot16(qh, kh, head_dim) : dot(qh, kh, head_dim)) * scale;
        }
      }
      t += run;
    }
    /* softmax numerators in place, 1 / denominator per head */
    for (int h = 0; h < num_heads; h++) {
      float *s = scores + (int64_t)h * span;
      inv[h] = 1.0f / exp_sum(s, span, max_of(s, span));
    }
    if (wide) {
      for (int h = 0; h < num_heads; h++)
        pv_wide(scores + (int64_t)h * span, v_cache, table, start, len, block_size, token_stride,
                (int64_t)(h / group) * head_dim, head_dim, inv[h], oi + h * out_head_stride);
      continue;
    }
    /* acc[h] = sum_t p[h][t] v_t */
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int t = start; t < len; t++) {
      const float *v = v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) *
                                     token_stride;
      for (int h = 0; h < num_heads; h++) {
        const float p = scores[(int64_t)h * span + (t - start)];
        const float *restrict vh = v + (int64_t)(h / group) * head_dim;
        float *restrict a = acc + (int64_t)h * head_dim;
        for (int d = 0; d < head_dim; d++) a[d] += p * vh[d];
      }
    }
    for (int h = 0; h < num_heads; h++)
      for (int d = 0; d < head_dim; d++)
        oi[h * out_head_stride + d] = acc[(int64_t)h * head_dim + d] * inv[h];
  }
  free(scores);
  free(acc);
  free(inv);
  return 0;
}
