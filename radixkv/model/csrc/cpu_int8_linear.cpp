// y = x (q * s)^T for a decode's few rows of x: int8 weights with one scale per output channel
// (radixkv/model/int8_linear.py), multiplied without dequantizing the weight.
//
// Each weight row n is read once, in order (one sequential stream per thread, rows split between
// torch's threads): its codes are widened to float32 in registers, VW at a time, and multiplied
// into float32 accumulator vectors per row of x (M <= 8; 4 at one row, 2 at two, else 1), which
// are summed at the end, lane-wise then across lanes, and the sum scaled once:
// y[r, n] = s_n * sum_k x[r, k] q[n, k]. The codes are exact in float32, so the only error is
// the float32 summation of K products (lane chains of at most K / VW terms, then their sums) and
// the one product with s_n: within K eps32 sum_k |x_k q_nk s_n| + eps32 |y|,
// the bound tests/test_int8_linear.py checks against the float64 product of the dequantized
// weight. bfloat16 x and s are widened to float32 exactly; y is float32.
//
// ATen's _weight_int8pack_mm, which this replaces at these sizes, took 0.77 ms a call on
// SmolLM2-135M's projections at one row (Zen 3, AVX2, 2 threads): a decode step of ~92 ms.

#include "cpu_int8_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cstring>

#include "cpu_vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using radixkv_vec::hsum;
using radixkv_vec::loadv;
using radixkv_vec::vf;
using radixkv_vec::VW;

constexpr int64_t kMaxRows = 8;
// output rows a worker takes at a time (~90 KB of a 576-wide weight: a parallel_for grain that
// keeps each thread's stretch long)
constexpr int64_t kGrain = 64;

// VW codes widened to float32 (exact).
inline vf widen(const int8_t* p) {
#if defined(__AVX512F__)
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)));
#elif defined(__AVX2__)
  const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
#else
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// Output rows [n0, n1) for MR rows of x. kC accumulators per row of x (kC * MR independent FMA
// chains: 4 at one row, where a single chain would wait on the FMA's latency), each over every
// kC-th vector of K; summed lane-wise at the end, then across lanes.
template <int MR>
void rows_range(const float* x, int64_t k, const int8_t* q, const float* s, float* y, int64_t n,
                int64_t n0, int64_t n1) {
  constexpr int kC = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  const int64_t step = kC * VW;
  const int64_t kv = k / step * step;
  for (int64_t j = n0; j < n1; ++j) {
    const int8_t* w = q + j * k;
    vf acc[MR][kC];
    for (int r = 0; r < MR; ++r) {
      for (int c = 0; c < kC; ++c) acc[r][c] = vf{};
    }
    for (int64_t i = 0; i < kv; i += step) {
      vf wv[kC];
      for (int c = 0; c < kC; ++c) wv[c] = widen(w + i + c * VW);
      for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < kC; ++c) acc[r][c] += wv[c] * loadv(x + r * k + i + c * VW);
      }
    }
    for (int r = 0; r < MR; ++r) {
      vf t = acc[r][0];
      for (int c = 1; c < kC; ++c) t += acc[r][c];
      float sum = hsum(t);
      for (int64_t i = kv; i < k; ++i) sum += static_cast<float>(w[i]) * x[r * k + i];
      y[r * n + j] = sum * s[j];
    }
  }
}

}  // namespace

int64_t int8_linear_max_rows() { return kMaxRows; }

at::Tensor int8_linear_rows(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && s.dim() == 1,
              "int8_linear_rows: x [M, K], q [N, K] and s [N]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(),
              "int8_linear_rows: q must be contiguous int8");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(q.size(1) == k && s.size(0) == n, "int8_linear_rows: x [", m, ", ", k, "], q [",
              q.size(0), ", ", q.size(1), "] and s [", s.size(0), "] do not match");
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "int8_linear_rows: 1 to ", kMaxRows, " rows of x, got ", m);
  for (const at::Tensor* t : {&x, &s}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16,
                "int8_linear_rows: x and s must be float32 or bfloat16");
  }
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && s.device().is_cpu(),
              "int8_linear_rows: CPU tensors only");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sf = s.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const float* sp = sf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
    switch (m) {
      case 1: rows_range<1>(xp, k, qp, sp, yp, n, n0, n1); break;
      case 2: rows_range<2>(xp, k, qp, sp, yp, n, n0, n1); break;
      case 3: rows_range<3>(xp, k, qp, sp, yp, n, n0, n1); break;
      case 4: rows_range<4>(xp, k, qp, sp, yp, n, n0, n1); break;
      case 5: rows_range<5>(xp, k, qp, sp, yp, n, n0, n1); break;
      case 6: rows_range<6>(xp, k, qp, sp, yp, n, n0, n1); break;
      case 7: rows_range<7>(xp, k, qp, sp, yp, n, n0, n1); break;
      default: rows_range<8>(xp, k, qp, sp, yp, n, n0, n1); break;
    }
  });
  return y;
}
