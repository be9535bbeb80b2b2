// The sharded norms' native kernels (sharded_nn/moments.py): per-channel mean and sum of squared
// deviations in one pass over memory, the group-norm backward's per-row affine map of two arrays,
// the merge of the ranks' statistics with the running-statistics update, and the batch-norm
// backward's sums and input gradient (one pass each).
//
// Why this exists: a sharded GroupNorm or BatchNorm must take its slab's statistics apart from the
// normalization (the statistics are merged across ranks before anything is normalized), while
// torch's fused CPU kernels compute and apply them in one call. With torch's reductions the
// statistics cost two passes over the slab (a sum, then the squared deviations from the mean), as
// much as torch's whole group_norm at P=1 on twice the data: the 2-D UNet forward at P=2 spent a
// quarter of its time there.
//
// Here each row is cut into blocks small enough to stay in the L1 cache; a block is summed (the
// one read from memory), then its deviations from its own mean are summed and squared while it is
// cache-resident (the corrected two-pass form: as stable as the textbook two passes, no
// E[x^2] - E[x]^2 cancellation), and blocks are merged in double precision with Chan's pairwise
// formula. The order of every operation is fixed, so results are deterministic.
//
// Plain C ABI, no torch headers: called through ctypes with the tensors' data pointers.

#include <cstdint>
#include <cstring>

// The loops below are written with explicit vectors and independent accumulators, so that they
// are vectorized without letting the compiler reassociate any sum (no -ffast-math). On x86-64 the entry points are compiled twice,
// for AVX2 and for the baseline, and the loader picks one for the CPU (GCC's target_clones); the
// helpers are always inlined into each clone so that they take its instruction set.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SNN_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SNN_CLONES
#endif
#define SNN_INLINE inline __attribute__((always_inline))
// Vector arguments of the always-inlined helpers never cross a call, so the ABI note is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace {

// 1024 elements: 4 KiB of float (8 KiB of double) per block, re-read from L1 by the second pass;
// each of the 32 float lanes adds 32 terms, so float accumulation stays within ~2e-6 (the
// random-walk error far smaller) before the block's result goes to double.
constexpr int64_t kBlock = 1024;

struct Running {
  double n = 0.0, mean = 0.0, m2 = 0.0;

  SNN_INLINE void merge(double nb, double mean_b, double m2_b) {
    const double total = n + nb;
    const double delta = mean_b - mean;
    mean += delta * (nb / total);
    m2 += m2_b + delta * delta * (n * nb / total);
    n = total;
  }
};

// 32-byte vectors (8 floats, 4 doubles) through GCC/Clang's generic vector extension: AVX
// registers in the AVX2 clone, pairs of SSE registers in the baseline one. Four independent
// accumulators per sum hide the add latency; the lanes are added in a fixed order at the end.
template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(32)));
  static constexpr int width = 32 / sizeof(T);
};

template <typename T>
SNN_INLINE typename Vec<T>::type load(const T* p) {
  typename Vec<T>::type v;
  std::memcpy(&v, p, sizeof(v));  // an unaligned vector load
  return v;
}

template <typename T>
SNN_INLINE T horizontal(const typename Vec<T>::type& a, const typename Vec<T>::type& b,
                        const typename Vec<T>::type& c, const typename Vec<T>::type& d) {
  const typename Vec<T>::type v = (a + b) + (c + d);
  T out = 0;
  for (int j = 0; j < Vec<T>::width; ++j) out += v[j];
  return out;
}

// One block: its sum, then (while it is in cache) the sum and the sum of squares of its
// deviations from the block's own mean. Returns (mean, M2) of the block.
template <typename T>
SNN_INLINE void block_moments(const T* x, int64_t len, double* mean_out, double* m2_out) {
  using V = typename Vec<T>::type;
  constexpr int W = Vec<T>::width;
  constexpr int step = 4 * W;
  V a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + step <= len; i += step) {
    a0 += load(x + i);
    a1 += load(x + i + W);
    a2 += load(x + i + 2 * W);
    a3 += load(x + i + 3 * W);
  }
  const int64_t body = i;
  T total = horizontal<T>(a0, a1, a2, a3);
  for (; i < len; ++i) total += x[i];
  const T shift = total / static_cast<T>(len);

  V d1a = {}, d1b = {}, d2a = {}, d2b = {};
  for (i = 0; i < body; i += step) {
    const V u = load(x + i) - shift, v = load(x + i + W) - shift;
    const V w = load(x + i + 2 * W) - shift, z = load(x + i + 3 * W) - shift;
    d1a += u + v;
    d1b += w + z;
    d2a += u * u + v * v;
    d2b += w * w + z * z;
  }
  const V zero = {};
  T t1 = horizontal<T>(d1a, d1b, zero, zero), t2 = horizontal<T>(d2a, d2b, zero, zero);
  for (; i < len; ++i) {
    const T d = x[i] - shift;
    t1 += d;
    t2 += d * d;
  }
  // The deviations' own sum corrects the rounding of the shift (Chan, Golub & LeVeque 1983).
  const double sum1 = static_cast<double>(t1);
  const double sum2 = static_cast<double>(t2);
  const double n = static_cast<double>(len);
  *mean_out = static_cast<double>(shift) + sum1 / n;
  const double m2 = sum2 - sum1 * sum1 / n;
  *m2_out = m2 > 0.0 ? m2 : 0.0;
}

template <typename T>
SNN_INLINE void moments(const T* x, int64_t outer, int64_t channels, int64_t inner, double* mean, double* m2) {
  for (int64_t k = 0; k < channels; ++k) {
    Running run;
    for (int64_t a = 0; a < outer; ++a) {
      const T* row = x + (a * channels + k) * inner;
      for (int64_t b0 = 0; b0 < inner; b0 += kBlock) {
        const int64_t len = inner - b0 < kBlock ? inner - b0 : kBlock;
        double mb, m2b;
        block_moments(row + b0, len, &mb, &m2b);
        run.merge(static_cast<double>(len), mb, m2b);
      }
    }
    mean[k] = run.mean;
    m2[k] = run.m2;
  }
}

// out = a[r] * g + b[r] * x + c[r] along each row r of contiguous (rows, inner) arrays. No sums:
// the vectorizer takes the loop as written (restrict: the three arrays do not overlap).
template <typename T>
SNN_INLINE void row_affine2(const T* __restrict__ g, const T* __restrict__ x, int64_t rows, int64_t inner,
                            const T* a, const T* b, const T* c, T* __restrict__ out) {
  for (int64_t r = 0; r < rows; ++r) {
    const T ar = a[r], br = b[r], cr = c[r];
    const T* gr = g + r * inner;
    const T* xr = x + r * inner;
    T* o = out + r * inner;
    for (int64_t i = 0; i < inner; ++i) o[i] = (ar * gr[i] + br * xr[i]) + cr;
  }
}

// Chan's merge of per-rank (count, mean, M2) rows, in rank order (every rank gets the same bits):
// rows is a contiguous (ranks, 1 + 2k) array [count, mean (k), M2 (k)] per rank. Writes the
// merged mean and biased variance (in T) and returns the total count. Where rm and rv are given
// and the count exceeds 1, also updates them as torch's batch norm does with momentum `factor`:
// rm = (1 - f) rm + f mean, rv = (1 - f) rv + f var n / (n - 1).
template <typename T>
SNN_INLINE double merge_moments(const double* rows, int64_t ranks, int64_t k, T* mean_out, T* var_out, T* rm, T* rv,
                                double factor) {
  const int64_t width = 1 + 2 * k;
  double count = 0.0;
  for (int64_t r = 0; r < ranks; ++r) count += rows[r * width];
  for (int64_t c = 0; c < k; ++c) {
    double mean = 0.0, m2 = 0.0;
    if (count > 0.0) {
      double s = 0.0;
      for (int64_t r = 0; r < ranks; ++r) s += rows[r * width] * rows[r * width + 1 + c];
      mean = s / count;
      for (int64_t r = 0; r < ranks; ++r) {
        const double d = rows[r * width + 1 + c] - mean;
        m2 += rows[r * width + 1 + k + c] + rows[r * width] * d * d;
      }
    }
    const double var = count > 0.0 ? m2 / count : 0.0;
    mean_out[c] = static_cast<T>(mean);
    var_out[c] = static_cast<T>(var);
    if (rm != nullptr && count > 1.0) {
      rm[c] = static_cast<T>((1.0 - factor) * static_cast<double>(rm[c]) + factor * mean);
      rv[c] = static_cast<T>((1.0 - factor) * static_cast<double>(rv[c]) + factor * var * (count / (count - 1.0)));
    }
  }
  return count;
}

// Per-channel sum(g) and sum(g * (x - mean[c])) of contiguous (outer, channels, inner) arrays,
// in double (blocks of kBlock summed in T lanes, then added in double in a fixed order).
template <typename T>
SNN_INLINE void grad_sums(const T* g, const T* x, int64_t outer, int64_t channels, int64_t inner, const T* mean,
                          double* sum_g, double* sum_gx) {
  using V = typename Vec<T>::type;
  constexpr int W = Vec<T>::width;
  constexpr int step = 2 * W;
  for (int64_t c = 0; c < channels; ++c) {
    const T m = mean[c];
    double sg = 0.0, sgx = 0.0;
    for (int64_t a = 0; a < outer; ++a) {
      const T* gr = g + (a * channels + c) * inner;
      const T* xr = x + (a * channels + c) * inner;
      for (int64_t b0 = 0; b0 < inner; b0 += kBlock) {
        const int64_t len = inner - b0 < kBlock ? inner - b0 : kBlock;
        V g0 = {}, g1 = {}, p0 = {}, p1 = {};
        int64_t i = 0;
        for (; i + step <= len; i += step) {
          const V ga = load(gr + b0 + i), gb = load(gr + b0 + i + W);
          g0 += ga;
          g1 += gb;
          p0 += ga * (load(xr + b0 + i) - m);
          p1 += gb * (load(xr + b0 + i + W) - m);
        }
        const V zero = {};
        T tg = horizontal<T>(g0, g1, zero, zero), tp = horizontal<T>(p0, p1, zero, zero);
        for (; i < len; ++i) {
          tg += gr[b0 + i];
          tp += gr[b0 + i] * (xr[b0 + i] - m);
        }
        sg += static_cast<double>(tg);
        sgx += static_cast<double>(tp);
      }
    }
    sum_g[c] = sg;
    sum_gx[c] = sgx;
  }
}

// The input gradient of a batch norm with global statistics: per channel c, with
// rstd = 1 / sqrt(var + eps), wr = w rstd and the global sums S_g, S_gx = sum(g (x - mean)):
// dx = wr g + a x + b, a = -wr rstd^2 S_gx / n, b = -wr S_g / n - a mean. Coefficients in double,
// one pass over the arrays. w may be null (weight 1).
template <typename T>
SNN_INLINE void bn_input_grad(const T* __restrict__ g, const T* __restrict__ x, int64_t outer, int64_t channels,
                              int64_t inner, const T* w, const T* mean, const T* var, double eps, const double* sum_g,
                              const double* sum_gx, double count, T* __restrict__ out) {
  for (int64_t c = 0; c < channels; ++c) {
    const double rstd = 1.0 / __builtin_sqrt(static_cast<double>(var[c]) + eps);
    const double wr = (w != nullptr ? static_cast<double>(w[c]) : 1.0) * rstd;
    const double a = -wr * rstd * rstd * sum_gx[c] / count;
    const double b = -wr * sum_g[c] / count - a * static_cast<double>(mean[c]);
    const T tw = static_cast<T>(wr), ta = static_cast<T>(a), tb = static_cast<T>(b);
    for (int64_t o = 0; o < outer; ++o) {
      const int64_t base = (o * channels + c) * inner;
      const T* gr = g + base;
      const T* xr = x + base;
      T* dr = out + base;
      for (int64_t i = 0; i < inner; ++i) dr[i] = (tw * gr[i] + ta * xr[i]) + tb;
    }
  }
}

// A batch norm backward's per-channel sums sum(g) and sum(g (x - mean)), into sums[0:C] and
// sums[C:2C] (double: the message the ranks all-reduce); where given, this rank's bias gradient
// sum(g) into db and weight gradient sum(g xhat) = sum(g (x - mean)) / sqrt(var + eps) into dw.
template <typename T>
SNN_INLINE void bn_grad_sums(const T* g, const T* x, int64_t outer, int64_t channels, int64_t inner, const T* mean,
                             const T* var, double eps, double* sums, T* dw, T* db) {
  grad_sums<T>(g, x, outer, channels, inner, mean, sums, sums + channels);
  for (int64_t c = 0; c < channels; ++c) {
    if (db != nullptr) db[c] = static_cast<T>(sums[c]);
    if (dw != nullptr) dw[c] = static_cast<T>(sums[channels + c] / __builtin_sqrt(static_cast<double>(var[c]) + eps));
  }
}

}  // namespace

extern "C" {

// x: a contiguous (outer, channels, inner) array. For each channel k: mean[k] and m2[k], the mean
// and the sum of squared deviations from it over outer x inner elements. outer * inner > 0.
SNN_CLONES void snn_moments_f32(const float* x, int64_t outer, int64_t channels, int64_t inner, double* mean, double* m2) {
  moments<float>(x, outer, channels, inner, mean, m2);
}

SNN_CLONES void snn_moments_f64(const double* x, int64_t outer, int64_t channels, int64_t inner, double* mean, double* m2) {
  moments<double>(x, outer, channels, inner, mean, m2);
}

// The input gradient of a group norm from its output gradient g and input x (rows = N * C, one
// coefficient triple per row): one pass where torch's elementwise ops take three. out may not
// overlap g or x.
SNN_CLONES void snn_row_affine2_f32(const float* g, const float* x, int64_t rows, int64_t inner, const float* a,
                                    const float* b, const float* c, float* out) {
  row_affine2<float>(g, x, rows, inner, a, b, c, out);
}

SNN_CLONES void snn_row_affine2_f64(const double* g, const double* x, int64_t rows, int64_t inner, const double* a,
                                    const double* b, const double* c, double* out) {
  row_affine2<double>(g, x, rows, inner, a, b, c, out);
}

// Chan's merge of the ranks' packed statistics (see merge_moments); rm/rv may be null.
SNN_CLONES double snn_merge_moments_f32(const double* rows, int64_t ranks, int64_t k, float* mean, float* var,
                                        float* rm, float* rv, double factor) {
  return merge_moments<float>(rows, ranks, k, mean, var, rm, rv, factor);
}

SNN_CLONES double snn_merge_moments_f64(const double* rows, int64_t ranks, int64_t k, double* mean, double* var,
                                        double* rm, double* rv, double factor) {
  return merge_moments<double>(rows, ranks, k, mean, var, rm, rv, factor);
}

// A batch norm backward's per-channel sums (see bn_grad_sums).
SNN_CLONES void snn_bn_grad_sums_f32(const float* g, const float* x, int64_t outer, int64_t channels, int64_t inner,
                                     const float* mean, const float* var, double eps, double* sums, float* dw,
                                     float* db) {
  bn_grad_sums<float>(g, x, outer, channels, inner, mean, var, eps, sums, dw, db);
}

SNN_CLONES void snn_bn_grad_sums_f64(const double* g, const double* x, int64_t outer, int64_t channels, int64_t inner,
                                     const double* mean, const double* var, double eps, double* sums, double* dw,
                                     double* db) {
  bn_grad_sums<double>(g, x, outer, channels, inner, mean, var, eps, sums, dw, db);
}

// A batch norm's input gradient from the global sums [S_g (C), S_gx (C)] (see bn_input_grad).
SNN_CLONES void snn_bn_input_grad_f32(const float* g, const float* x, int64_t outer, int64_t channels, int64_t inner,
                                      const float* w, const float* mean, const float* var, double eps,
                                      const double* sums, double count, float* out) {
  bn_input_grad<float>(g, x, outer, channels, inner, w, mean, var, eps, sums, sums + channels, count, out);
}

SNN_CLONES void snn_bn_input_grad_f64(const double* g, const double* x, int64_t outer, int64_t channels,
                                      int64_t inner, const double* w, const double* mean, const double* var,
                                      double eps, const double* sums, double count, double* out) {
  bn_input_grad<double>(g, x, outer, channels, inner, w, mean, var, eps, sums, sums + channels, count, out);
}

}  // extern "C"
