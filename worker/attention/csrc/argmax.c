/* Row-wise argmax of a float32 matrix on the CPU, with torch.argmax's answer: the first index
 * of the row's maximum, or the first NaN of a row that holds one.
 *
 * torch's CPU argmax walks a row one element at a time (~1 ns each); a greedy step over a
 * [128, 8192] logits matrix then spends ~0.9 ms there. Here one vectorised pass finds the
 * maximum (and whether a NaN is present), a second finds its first position: the row is in
 * L1/L2 by then. Built with paged_decode.c into one shared object (native.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
  v8f v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline v8f vmax(v8f a, v8f b) {
  v8i gt = b > a;
  return (v8f)(((v8i)b & gt) | ((v8i)a & ~gt));
}

static inline int any_lane(v8i m) {
  v8i z = {0};
  return memcmp(&m, &z, sizeof m) != 0;
}

static int64_t argmax_row(const float *p, int64_t n) {
  const v8f ninf = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                    -INFINITY, -INFINITY, -INFINITY, -INFINITY};
  v8f m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf; /* four chains: no wait on one compare */
  v8i nan = {0};
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    v8f a = load8(p + j), b = load8(p + j + 8), c = load8(p + j + 16), d = load8(p + j + 24);
    m0 = vmax(m0, a);
    m1 = vmax(m1, b);
    m2 = vmax(m2, c);
    m3 = vmax(m3, d);
    nan |= (a != a) | (b != b) | (c != c) | (d != d);
  }
  for (; j + 8 <= n; j += 8) {
    v8f a = load8(p + j);
    m0 = vmax(m0, a);
    nan |= a != a;
  }
  v8f m = vmax(vmax(m0, m1), vmax(m2, m3));
  float best = -INFINITY;
  int any_nan = any_lane(nan);
  for (int k = 0; k < 8; k++) best = m[k] > best ? m[k] : best;
  for (; j < n; j++) {
    best = p[j] > best ? p[j] : best;
    any_nan |= p[j] != p[j];
  }
  if (any_nan) {
    for (j = 0; j < n; j++)
      if (p[j] != p[j]) return j;
  }
  const v8f target = {best, best, best, best, best, best, best, best};
  for (j = 0; j + 8 <= n; j += 8)
    if (any_lane(load8(p + j) == target)) break;
  for (; j < n; j++)
    if (p[j] == best) return j;
  return 0; /* unreachable: best is one of the elements */
}

/* out[r] = argmax of row r (row r starts at x + r * row_stride). */
void kvc_argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t row_stride,
                         int64_t *out) {
  for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * row_stride, n);
}
