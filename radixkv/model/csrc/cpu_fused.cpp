// Fused elementwise layers of the CPU forward pass, bf16 or float32 rows: each reads and writes its
// activations once instead of once per torch op (an RMSNorm in torch is six passes and three
// temporaries). All arithmetic is float32; bf16 results are rounded to bf16 once. Every tensor of
// one call has the rows' dtype (cos / sin of rope_ are always float32).
//
//   rms_norm(x, w)             y = x / sqrt(mean(x^2) + eps) * w
//   add_rms_norm(res, x, w)    res += x (bf16, in place); y = rms_norm(res, w)
//   silu_mul(gate_up)          y = silu(gate) * up, gate_up = [gate | up] along the last dim
//   rope_(qkv, cos, sin, n, d) rotate-half RoPE, in place, on the first n heads of each row;
//                              sin is sign-folded ([-sin | sin]) as radixkv.model.llama builds it

#include "cpu_fused.h"

#include <ATen/Parallel.h>

#include "cpu_vec.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = uint16_t;

inline float to_f(bf16 x) { return radixkv_vec::loads(&x); }

inline bf16 to_bf(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<bf16>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// The same conversions on a vector of the build's width (cpu_vec.h): bit for bit those above,
// except that AVX512-BF16 builds store float32 subnormals as zero (see store_bf).
using radixkv_vec::hsum;
using radixkv_vec::vf;
using radixkv_vec::VW;
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

inline vf load_bf(const bf16* p) { return radixkv_vec::loadv(p); }

inline void store_bf(bf16* p, vf f) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  // the instruction rounds to nearest even as below, NaN to a quiet NaN; it flushes float32
  // subnormals (|f| < 2^-126) to a signed zero, where the form below keeps their bf16 rounding
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(f))));
#else
  vu u;
  std::memcpy(&u, &f, sizeof(u));
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu nan = (u >> 16) | 0x40u;
  const vu out = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  const vh h = __builtin_convertvector(out, vh);
  std::memcpy(p, &h, sizeof(h));
#endif
}

// The element types' loads and stores: bf16 as above, float32 as it is.
inline vf load_e(const bf16* p) { return load_bf(p); }
inline vf load_e(const float* p) { return radixkv_vec::loadv(p); }
inline void store_e(bf16* p, vf f) { store_bf(p, f); }
inline void store_e(float* p, vf f) { radixkv_vec::storev(p, f); }
inline float to_f(float x) { return x; }
template <class E>
inline E from_f(float f);
template <>
inline bf16 from_f<bf16>(float f) { return to_bf(f); }
template <>
inline float from_f<float>(float f) { return f; }

void check_rows_2d(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() &&
                  (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat) &&
                  t.dim() == 2 && t.stride(1) == 1,
              what, ": expected a CPU bfloat16 or float32 [rows, dim] tensor with contiguous rows");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": expected one dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
}

void check_norm_weight(const at::Tensor& w, const at::Tensor& x, const char* what) {
  TORCH_CHECK(w.numel() == x.size(1) && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              what, ": weight must be a contiguous vector of the row size in the rows' dtype");
}

template <class E>
E* data(const at::Tensor& t) {
  return reinterpret_cast<E*>(t.data_ptr());
}

// Calls fn with a value of the element type of `t` (bf16 or float), for `decltype`.
template <class Fn>
void dispatch_rows(const at::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == at::kFloat) {
    fn(float{});
  } else {
    fn(bf16{});
  }
}

// y[r] = norm(src[r]) * w for rows [begin, end); whole vectors first, then a scalar tail
template <class E>
void norm_rows(const E* src, int64_t src_stride, const E* w, E* dst, int64_t h, float eps,
               int64_t begin, int64_t end) {
  const int64_t hv = h - h % VW;
  for (int64_t r = begin; r < end; ++r) {
    const E* x = src + r * src_stride;
    vf acc{};
    for (int64_t i = 0; i < hv; i += VW) {
      const vf v = load_e(x + i);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (int64_t i = hv; i < h; ++i) ss += to_f(x[i]) * to_f(x[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    E* y = dst + r * h;
    for (int64_t i = 0; i < hv; i += VW) store_e(y + i, load_e(x + i) * inv * load_e(w + i));
    for (int64_t i = hv; i < h; ++i) y[i] = from_f<E>(to_f(x[i]) * inv * to_f(w[i]));
  }
}

// silu(g) * u = g * sigmoid(g) * u, sigmoid from e = exp(-|g|) <= 1 (never overflows):
// 1 / (1 + e) for g >= 0, e / (1 + e) below
inline vf silu_mul_v(vf g, vf u) {
  constexpr float kLog2e = 1.4426950408889634f;
  const vf neg_abs = g < 0.f ? g : -g;
  const vf e = radixkv_vec::exp2v(neg_abs * kLog2e);
  const vf sig = (g < 0.f ? e : radixkv_vec::splat(1.f)) * radixkv_vec::recip(1.f + e);
  return g * sig * u;
}

// residual[r] += x[r], then y[r] = rms_norm(residual[r]) * w, for rows [begin, end).
template <class E>
void add_norm_rows(E* res, int64_t res_stride, const E* xs, int64_t x_stride, const E* w, E* y,
                   int64_t h, float eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    E* dst = res + r * res_stride;
    const E* src = xs + r * x_stride;
    const int64_t hv = h - h % VW;
    for (int64_t i = 0; i < hv; i += VW) store_e(dst + i, load_e(dst + i) + load_e(src + i));
    for (int64_t i = hv; i < h; ++i) dst[i] = from_f<E>(to_f(dst[i]) + to_f(src[i]));
  }
  norm_rows(res, res_stride, w, y, h, eps, begin, end);
}

// y[r] = silu(gate) * up of row r = [gate (n) | up (n)], for rows [begin, end).
template <class E>
void silu_rows(const E* gate_up, int64_t stride, E* y, int64_t n, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const E* g = gate_up + r * stride;
    const E* u = g + n;
    E* dst = y + r * n;
    const int64_t nv = n - n % VW;
    for (int64_t i = 0; i < nv; i += VW) store_e(dst + i, silu_mul_v(load_e(g + i), load_e(u + i)));
    for (int64_t i = nv; i < n; ++i) {
      const float gv = to_f(g[i]);
      dst[i] = from_f<E>(gv / (1.f + std::exp(-gv)) * to_f(u[i]));
    }
  }
}

constexpr int64_t kRowGrain = 16;

}  // namespace

void rms_norm_rows_f32(const float* x, int64_t x_stride, const float* w, float* y, int64_t h,
                       float eps, int64_t begin, int64_t end) {
  norm_rows(x, x_stride, w, y, h, eps, begin, end);
}

void add_rms_norm_rows_f32(float* residual, int64_t residual_stride, const float* x,
                           int64_t x_stride, const float* w, float* y, int64_t h, float eps,
                           int64_t begin, int64_t end) {
  add_norm_rows(residual, residual_stride, x, x_stride, w, y, h, eps, begin, end);
}

void silu_mul_rows_f32(const float* gate_up, int64_t stride, float* y, int64_t n, int64_t begin,
                       int64_t end) {
  silu_rows(gate_up, stride, y, n, begin, end);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows_2d(x, "rms_norm");
  check_norm_weight(weight, x, "rms_norm");
  const int64_t rows = x.size(0), h = x.size(1);
  auto y = at::empty({rows, h}, x.options());
  dispatch_rows(x, [&](auto e0) {
    using E = decltype(e0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
      norm_rows(data<E>(x), x.stride(0), data<E>(weight), data<E>(y), h, static_cast<float>(eps),
                b, e);
    });
  });
  return y;
}

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                        double eps) {
  check_rows_2d(residual, "add_rms_norm (residual)");
  check_rows_2d(x, "add_rms_norm (x)");
  check_same_dtype(residual, x, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual and x shapes differ");
  check_norm_weight(weight, x, "add_rms_norm");
  const int64_t rows = x.size(0), h = x.size(1);
  auto y = at::empty({rows, h}, x.options());
  dispatch_rows(x, [&](auto e0) {
    using E = decltype(e0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
      add_norm_rows(data<E>(residual), residual.stride(0), data<E>(x), x.stride(0),
                    data<E>(weight), data<E>(y), h, static_cast<float>(eps), b, e);
    });
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows_2d(gate_up, "silu_mul");
  const int64_t rows = gate_up.size(0), two = gate_up.size(1);
  TORCH_CHECK(two % 2 == 0, "silu_mul: the last dim must hold gate and up halves");
  const int64_t n = two / 2;
  auto y = at::empty({rows, n}, gate_up.options());
  dispatch_rows(gate_up, [&](auto e0) {
    using E = decltype(e0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
      silu_rows(data<E>(gate_up), gate_up.stride(0), data<E>(y), n, b, e);
    });
  });
  return y;
}

void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
           int64_t head_dim) {
  check_rows_2d(qkv, "rope_");
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1),
              "rope_: num_heads * head_dim exceeds the row");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * head_dim &&
                  sin.numel() == rows * head_dim,
              "rope_: cos and sin must be contiguous float32 [rows, head_dim]");
  const int64_t half = head_dim / 2;
  const int64_t hv = half - half % VW;  // a vector of lo and one of hi at a time up to here
  dispatch_rows(qkv, [&](auto e0) {
    using E = decltype(e0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const float* c = cos.data_ptr<float>() + r * head_dim;
        const float* s = sin.data_ptr<float>() + r * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
          E* x = data<E>(qkv) + r * qkv.stride(0) + h * head_dim;
          for (int64_t i = 0; i < hv; i += VW) {
            const vf lo = load_e(x + i), hi = load_e(x + i + half);
            store_e(x + i, lo * radixkv_vec::loadv(c + i) + hi * radixkv_vec::loadv(s + i));
            store_e(x + i + half,
                    hi * radixkv_vec::loadv(c + i + half) + lo * radixkv_vec::loadv(s + i + half));
          }
          for (int64_t i = hv; i < half; ++i) {
            const float lo = to_f(x[i]), hi = to_f(x[i + half]);
            x[i] = from_f<E>(lo * c[i] + hi * s[i]);
            x[i + half] = from_f<E>(hi * c[i + half] + lo * s[i + half]);
          }
        }
      }
    });
  });
}
