// The vocabulary sweep of the SAGE loss on the CPU (docs/loss.md), one token block at a time.
//
// Two operators, driven block by block from sage_kernels/cpu.py:
//   sage_cpu::block_stats  logits z = inner (h W^T + b) by BLAS into a caller-owned [rows, V]
//                          workspace, then one fused pass per row: max, sum-exp and sum p*z (in
//                          chunks, see exp_sums) give lse, logp[y] and the entropy. Under a
//                          softcap (spec.LogitMap) the workspace keeps tanh's argument
//                          x = inner (h W^T + b) and z = outer tanh(x) is formed on the fly.
//   sage_cpu::block_grad   turns the workspace into d(head output) in place in one fused pass,
//                          d z_v = g (1[v = y] - p_v) - c p_v (log p_v + H), times dz/da = inner
//                          (inner outer (1 - tanh^2 x_v) under a softcap, from x: from z, 1 - tanh^2
//                          would cancel where a logit saturates), then the products into grad_hidden,
//                          grad_weight (+=) and grad_bias (+=), each optional.
// Everything is float32; the Python side upcasts low-precision inputs and owns every large
// buffer, so no [N, V] tensor exists and the allocation recorder sees the workspace.
// The per-row loops are plain C++ written so that the compiler vectorises them (`omp simd`),
// including the exponential, which is our own (Cephes-style) so that it vectorises.
//
// The same bits for any number of threads: every result element is computed by one thread in an
// order fixed by the shapes alone. Rows are whole tasks; each product is cut into tiles of fixed
// size (never by the thread count) whose inner dimension is never split, and each tile is one BLAS
// call made on one thread with the BLAS told to use one thread (SequentialBlas); the bias gradient
// sums the rows in order. A BLAS that may use several threads plans its split of a product by that
// number even inside a parallel region, where it then runs the pieces on one thread: MKL's AVX-512
// kernels split the inner dimension of d(hidden) = dZ W (V long) in two for two threads, which
// changes the last bits. at::sum splits by threads too.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// MKL's per-thread thread count, its C entry (mkl_service.h maps mkl_set_num_threads_local to it; the
// lower-case symbol is the Fortran one, which takes a pointer). libtorch_cpu exports it where torch is
// built with MKL, as the x86 wheels are; weak, so that under another BLAS the symbol is null.
extern "C" int MKL_Set_Num_Threads_Local(int nthreads) __attribute__((weak));

namespace {

// The floor of exp_nonpositive's argument: 2^k there has k = -127, whose exponent field is 0, so the
// result is exactly 0 (from x = -87.68 down: exp(x) < 2^-126.5, below the normal floats) with no
// compare or select, and a floored argument stays finite for the products that use it.
constexpr float kExpFloor = -88.0f;

// exp(x) for x <= ~0 (arguments are logits minus their maximum or their log-sum-exp).
// Range reduction x = k ln2 + r, |r| <= ln2/2, a degree-7 polynomial for e^r, then 2^k via the
// exponent bits; relative error ~2 ulp down to -87.3 (the subnormals above -87.68 are rounded there).
// Exactly 0 further down (-inf included): a weight of ~1e-38 there, times a logit of -1e38 (a
// finfo.min bias, a temperature of 1e-37), would move the entropy by whole nats. Callers keep such
// zeros zero: 0 * -inf is NaN, so a probability multiplies a floored logit, or is tested for 0.
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, kExpFloor);
  const float k = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - k * 0.693359375f) + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= 1: finite for every x (e is 0 from |x| = 44 on,
// where tanh is 1 in float32), and vectorised like exp_nonpositive (std::tanh is a library call). Its error is
// absolute, ~1e-7: what a logit c tanh(.) needs (a softmax sees absolute, not relative, logit errors).
inline float tanh_of(float x) {
  const float e = exp_nonpositive(-2.0f * std::fabs(x));
  return std::copysign((1.0f - e) / (1.0f + e), x);
}

// 1 - tanh(x)^2 = 4 e / (1 + e)^2 with the same e: no cancellation where tanh is near +-1.
inline float sech_squared(float x) {
  const float e = exp_nonpositive(-2.0f * std::fabs(x));
  return 4.0f * e / ((1.0f + e) * (1.0f + e));
}

// Rows per thread task: at least ~64K logits, so that small blocks are not split across threads.
int64_t row_grain(int64_t V) { return std::max<int64_t>(1, (int64_t{1} << 16) / V); }

void check_block(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Tile sizes of the products: fixed, so the work split never depends on the thread count.
constexpr int64_t kVocabTile = 512;   // vocabulary rows of W per task (logits, grad_weight, grad_bias)
constexpr int64_t kHiddenTile = 256;  // hidden columns per task (grad_hidden, whose inner dimension is V)

int64_t tiles_of(int64_t size, int64_t tile) { return (size + tile - 1) / tile; }

// While alive, the BLAS plans for one thread on this thread (MKL's thread-local count, restored on exit);
// the global count, which torch.set_num_threads sets, would otherwise decide its split. Other BLAS
// libraries (OpenBLAS) run on one thread inside a parallel region of their own accord.
class SequentialBlas {
 public:
  SequentialBlas() : previous_(MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~SequentialBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous_);
  }
  SequentialBlas(const SequentialBlas&) = delete;
  SequentialBlas& operator=(const SequentialBlas&) = delete;

 private:
  int previous_;
};

// fn(tile) for every tile, each on one thread with a sequential BLAS. At least two tasks, so that the
// region opens whenever there are two or more threads, even for one tile.
template <typename F>
void for_each_tile(int64_t count, const F& fn) {
  at::parallel_for(0, std::max<int64_t>(count, 2), 1, [&](int64_t begin, int64_t end) {
    const SequentialBlas sequential;
    for (int64_t t = begin; t < std::min(end, count); ++t) fn(t);
  });
}

// out[rows, V] = a[rows, D] @ w[V, D]^T, tiled over V.
void logits_product(const at::Tensor& a, const at::Tensor& w, const at::Tensor& out) {
  const int64_t V = w.size(0);
  for_each_tile(tiles_of(V, kVocabTile), [&](int64_t t) {
    const int64_t v0 = t * kVocabTile, width = std::min(kVocabTile, V - v0);
    at::Tensor out_tile = out.narrow(1, v0, width);
    at::mm_out(out_tile, a, w.narrow(0, v0, width).t());
  });
}

// out[rows, D] = d[rows, V] @ w[V, D], tiled over D; each tile's inner product over V is whole.
void hidden_product(const at::Tensor& d, const at::Tensor& w, const at::Tensor& out) {
  const int64_t D = w.size(1);
  for_each_tile(tiles_of(D, kHiddenTile), [&](int64_t t) {
    const int64_t d0 = t * kHiddenTile, width = std::min(kHiddenTile, D - d0);
    at::Tensor out_tile = out.narrow(1, d0, width);
    at::mm_out(out_tile, d, w.narrow(1, d0, width));
  });
}

// acc[V, D] += d[rows, V]^T @ a[rows, D], tiled over V; each tile's inner product over rows is whole.
void weight_product(const at::Tensor& d, const at::Tensor& a, const at::Tensor& acc) {
  const int64_t V = acc.size(0);
  for_each_tile(tiles_of(V, kVocabTile), [&](int64_t t) {
    const int64_t v0 = t * kVocabTile, width = std::min(kVocabTile, V - v0);
    acc.narrow(0, v0, width).addmm_(d.narrow(1, v0, width).t(), a);
  });
}

// acc[V] += sum over rows of d[rows, V], rows in order.
void bias_sum(const at::Tensor& d, const at::Tensor& acc) {
  const int64_t rows = d.size(0), V = d.size(1);
  const float* src = d.data_ptr<float>();
  float* dst = acc.data_ptr<float>();
  for_each_tile(tiles_of(V, kVocabTile), [&](int64_t t) {
    const int64_t v0 = t * kVocabTile, v1 = std::min(V, v0 + kVocabTile);
    for (int64_t i = 0; i < rows; ++i) {
      const float* row = src + i * V;
#pragma omp simd
      for (int64_t v = v0; v < v1; ++v) dst[v] += row[v];
    }
  });
}

// sum e^s and sum e^s s over a row, for s = shifted(v) = z_v - max z <= 0 (sum_ez uses z - max, so it
// stays small). Two levels: chunks of kSumChunk terms whose vector lanes start from zero, their sums
// added in double in order. One float running sum per lane over the whole row drops every term below
// half an ulp of it: at V = 49152 that left lse ~5e-5 low on average, ten times the float32 GEMM's own
// error. The order is fixed by V alone, so the bits do not depend on the thread count.
constexpr int64_t kSumChunk = 256;

struct ExpSums {
  double e = 0.0, ez = 0.0;
  float log_sum() const { return static_cast<float>(std::log(e)); }
  float entropy() const { return static_cast<float>(std::log(e) - ez / e); }  // lse - sum p z, z shifted by max
};

template <typename Shifted>
ExpSums exp_sums(int64_t V, const Shifted& shifted) {
  ExpSums sums;
  for (int64_t v0 = 0; v0 < V; v0 += kSumChunk) {
    const int64_t v1 = std::min(V, v0 + kSumChunk);
    float chunk_e = 0.f, chunk_ez = 0.f;
#pragma omp simd reduction(+ : chunk_e, chunk_ez)
    for (int64_t v = v0; v < v1; ++v) {
      const float s = shifted(v);
      const float e = exp_nonpositive(s);
      chunk_e += e;
      chunk_ez += e * s;
    }
    sums.e += chunk_e;
    sums.ez += chunk_ez;
  }
  return sums;
}

// Per row: z = inner (acc + b) in place, then lse, logp[y] and H = lse - sum p z. Under a softcap the row keeps
// x = inner (acc + b) and z = outer tanh(x) is formed in each pass.
void block_stats(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                 const at::Tensor& targets, double inner, double outer, bool softcap, const at::Tensor& logits,
                 const at::Tensor& logp, const at::Tensor& entropy, const at::Tensor& lse) {
  check_block(logits, "logits", 2);
  const int64_t rows = logits.size(0), V = logits.size(1);
  TORCH_CHECK(hidden.size(0) == rows && weight.size(0) == V, "block_stats: logits must be [rows, V]");
  logits_product(hidden, weight, logits);
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t* y = targets.data_ptr<int64_t>();
  float* out_logp = logp.data_ptr<float>();
  float* out_entropy = entropy.data_ptr<float>();
  float* out_lse = lse.data_ptr<float>();
  const float scale = static_cast<float>(inner), cap = static_cast<float>(outer);
  at::parallel_for(0, rows, row_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* z = logits.data_ptr<float>() + i * V;
      float max_z = -std::numeric_limits<float>::infinity();
      if (softcap) {  // its own loops: the plain logits below keep their cost
        float* x = z;
        if (b) {
#pragma omp simd
          for (int64_t v = 0; v < V; ++v) x[v] = (x[v] + b[v]) * scale;
        } else {
#pragma omp simd
          for (int64_t v = 0; v < V; ++v) x[v] *= scale;
        }
        // z - max z as cap (tanh x - max tanh x) (cap > 0: the same maximum): cap tanh x - max z would be one
        // FMA, subtracting max z, a rounded product, from the exact one, so a row's own maximum would shift to
        // its rounding error, not 0 (V = 1 gave logp and H a few ulp of z off 0, and H < 0, where both are 0)
        float max_t = -1.0f;  // tanh x >= -1
#pragma omp simd reduction(max : max_t)
        for (int64_t v = 0; v < V; ++v) max_t = std::max(max_t, tanh_of(x[v]));
        const ExpSums sums = exp_sums(V, [&](int64_t v) { return cap * (tanh_of(x[v]) - max_t); });  // |z| <= outer
        out_lse[i] = cap * max_t + sums.log_sum();
        out_logp[i] = cap * (tanh_of(x[y[i]]) - max_t) - sums.log_sum();
        out_entropy[i] = sums.entropy();
        continue;
      }
      if (b) {
#pragma omp simd reduction(max : max_z)
        for (int64_t v = 0; v < V; ++v) { z[v] = (z[v] + b[v]) * scale; max_z = std::max(max_z, z[v]); }
      } else {
#pragma omp simd reduction(max : max_z)
        for (int64_t v = 0; v < V; ++v) { z[v] *= scale; max_z = std::max(max_z, z[v]); }
      }
      // z may be -inf (finfo.min / T < 1): the floor keeps e * shifted finite
      const ExpSums sums = exp_sums(V, [&](int64_t v) { return std::max(z[v] - max_z, kExpFloor); });
      out_lse[i] = max_z + sums.log_sum();
      out_logp[i] = z[y[i]] - out_lse[i];
      out_entropy[i] = sums.entropy();
    }
  });
}

// d(head output) in place (the workspace holds z from block_stats), then the three products.
void block_grad(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse, const at::Tensor& entropy,
                const at::Tensor& grad_logp, const at::Tensor& grad_entropy, double inner, double outer, bool softcap,
                const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& grad_hidden,
                const std::optional<at::Tensor>& grad_weight, const std::optional<at::Tensor>& grad_bias) {
  check_block(logits, "logits", 2);
  const int64_t rows = logits.size(0), V = logits.size(1);
  const int64_t* y = targets.data_ptr<int64_t>();
  const float* row_lse = lse.data_ptr<float>();
  const float* row_entropy = entropy.data_ptr<float>();
  const float* g = grad_logp.data_ptr<float>();
  const float* c = grad_entropy.data_ptr<float>();
  const float scale = static_cast<float>(inner * outer), cap = static_cast<float>(outer);
  at::parallel_for(0, rows, row_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* z = logits.data_ptr<float>() + i * V;
      const float m = row_lse[i], gi = g[i] * scale, ci = c[i] * scale, h = row_entropy[i];
      if (softcap) {  // the row holds x (block_stats): d z times 1 - tanh^2 x; its own loop, the plain ones keep their cost
        // g and c times p first, the slope s / T last (as sech^2 x): g times the slope may overflow where
        // p sech^2 x is 0 (a saturated logit, logit_scale 1e38), and 0 * inf is NaN
        float* x = z;
        const float g_row = g[i], c_row = c[i];
        const float slope_y = scale * sech_squared(x[y[i]]);
#pragma omp simd
        for (int64_t v = 0; v < V; ++v) {
          const float log_p = std::max(cap * tanh_of(x[v]) - m, kExpFloor);
          const float p = exp_nonpositive(log_p);
          z[v] = (-(p * g_row) - (p * c_row) * (log_p + h)) * (scale * sech_squared(x[v]));
        }
        z[y[i]] += g_row * slope_y;
        continue;
      }
      if (ci == 0.f) {
#pragma omp simd
        for (int64_t v = 0; v < V; ++v) z[v] = -gi * exp_nonpositive(z[v] - m);
      } else {
#pragma omp simd
        for (int64_t v = 0; v < V; ++v) {
          // floored, and p times ci first: where p is 0, ci (log p + H) may overflow (T = 1e-37)
          const float log_p = std::max(z[v] - m, kExpFloor);
          const float p = exp_nonpositive(log_p);
          z[v] = -(p * gi) - (p * ci) * (log_p + h);
        }
      }
      z[y[i]] += gi;
    }
  });
  if (grad_hidden.has_value()) hidden_product(logits, weight, *grad_hidden);
  if (grad_weight.has_value()) weight_product(logits, hidden, *grad_weight);
  if (grad_bias.has_value()) {
    check_block(*grad_bias, "grad_bias", 1);
    bias_sum(logits, *grad_bias);
  }
}

}  // namespace

TORCH_LIBRARY(sage_cpu, m) {
  m.def("block_stats(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, float inner, float outer, "
        "bool softcap, Tensor(a!) logits, Tensor(b!) logp, Tensor(c!) entropy, Tensor(d!) lse) -> ()");
  m.def("block_grad(Tensor(a!) logits, Tensor targets, Tensor lse, Tensor entropy, Tensor grad_logp, "
        "Tensor grad_entropy, float inner, float outer, bool softcap, Tensor hidden, Tensor weight, "
        "Tensor(b!)? grad_hidden, "
        "Tensor(c!)? grad_weight, Tensor(d!)? grad_bias) -> ()");
}

TORCH_LIBRARY_IMPL(sage_cpu, CPU, m) {
  m.impl("block_stats", &block_stats);
  m.impl("block_grad", &block_grad);
}
