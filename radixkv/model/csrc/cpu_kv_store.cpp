// The write side of quantized KV pages (radixkv/model/kv_quant.py), per layer and step:
//
//   hadamard_rows(x [..., D] f32/bf16, scale) -> x H * scale, same dtype: H the +-1 block
//     Hadamard matrix of kv_quant.hadamard (Sylvester blocks of b = D & -D), by the fast
//     Walsh-Hadamard butterflies in float32 (one rounding to the dtype at the end). The rotation
//     of q, k, v and of the attention output around a backend over quantized pages.
//   hadamard_rows_(x, scale): the same, in place.
//   rope_hadamard_(qkv bf16 [T, W] rows at any stride, cos, sin float32 [T, D], rope_heads,
//     heads, D): in place, each of the first `heads` heads of a row rotated by H, the first
//     `rope_heads` of them after rotate-half RoPE (cos, sin as rope_ in cpu_fused.cpp takes
//     them: sin sign-folded): the bits of rope_ then hadamard_rows(., 1) (RoPE's result rounded
//     to bf16, the rotation in float32 rounded once), in one pass over the fused QKV output
//     instead of RoPE's pass, a copy and the rotation's.
//   store_kv_quant_(k, v [T, Hkv, D] f32/bf16, tokens at any stride, k_cache, v_cache int8/uint8
//     [pages, P, Hkv, D+2], slots int64 [T]): each (token, head) row quantized exactly as
//     kv_quant.quantize does (scale = absmax * ((1 + 2^-8) / qmax) rounded to nearest bf16,
//     code = round-half-even(x / s) clamped for int8, float8_e4m3fn of x / s clamped to 448
//     for uint8) and written with its scale to slot slots[t]: the same bytes as the torch path,
//     checked bit for bit by tests/test_kv_quant_native.py.
//   store_kv_(k, v [T, Hkv, D], k_cache, v_cache [pages, P, Hkv, D] of k's dtype, slots int64
//     [T]): each token's Hkv x D row copied to slot slots[t] as it is (bf16 / float32 / fp16
//     pools), tokens at any stride (k, v may be column slices of the fused QKV output), one
//     pass for both caches instead of two index_copy_ calls and the copies they take.
//   copy_pages_(caches [pages, ...] list, src, dst int64 [n]): page src[i] copied to dst[i] in
//     every cache of the list (all of one shape and dtype, contiguous): a pool's copy-on-write
//     of pages in one call instead of two torch ops per layer and cache.

#include "cpu_kv_store.h"

#include "cpu_kv_quant.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
float load(const T* p) {
  return static_cast<float>(*p);
}

// Butterfly stages with len < VW run inside a vector: lane j becomes v[j ^ len] + (j & len ?
// -v[j] : v[j]); stages with len >= VW add and subtract whole vectors. The lane permutations
// are compile-time constants, so the compiler picks in-lane shuffles (vpermilps) and lane
// swaps (vshuff32x4) for them rather than a general permute from a loaded index vector.
template <int LEN>
__attribute__((always_inline)) inline radixkv_vec::vf in_vector_stage(radixkv_vec::vf x) {
  using radixkv_vec::vf;
  using radixkv_vec::vi;
#if defined(__AVX512F__)
  constexpr vi perm = {0 ^ LEN, 1 ^ LEN, 2 ^ LEN,  3 ^ LEN,  4 ^ LEN,  5 ^ LEN,  6 ^ LEN,  7 ^ LEN,
                       8 ^ LEN, 9 ^ LEN, 10 ^ LEN, 11 ^ LEN, 12 ^ LEN, 13 ^ LEN, 14 ^ LEN, 15 ^ LEN};
#else
  constexpr vi perm = {0 ^ LEN, 1 ^ LEN, 2 ^ LEN, 3 ^ LEN, 4 ^ LEN, 5 ^ LEN, 6 ^ LEN, 7 ^ LEN};
#endif
  vf sign;
  for (int j = 0; j < radixkv_vec::VW; ++j) sign[j] = (j & LEN) ? -1.f : 1.f;
  return x * sign + __builtin_shuffle(x, perm);
}

// The butterflies of one block held in v[0 .. nv): the log2(VW) in-vector stages, then the
// cross-vector ones (whole vectors added and subtracted). Inlined, so where nv is a constant
// the block stays in registers.
__attribute__((always_inline)) inline void butterfly_block(radixkv_vec::vf* v, int64_t nv) {
  using namespace radixkv_vec;
  // unrolled fully where nv is a constant (the fixed-width callers), so v stays in registers
#pragma GCC unroll 16
  for (int64_t i = 0; i < nv; ++i) {
    vf x = in_vector_stage<2>(in_vector_stage<1>(v[i]));
    x = in_vector_stage<4>(x);
    if constexpr (VW == 16) x = in_vector_stage<8>(x);
    v[i] = x;
  }
#pragma GCC unroll 8
  for (int64_t step = 1; step < nv; step <<= 1) {
#pragma GCC unroll 16
    for (int64_t i = 0; i < nv; i += 2 * step) {
#pragma GCC unroll 16
      for (int64_t j = i; j < i + step; ++j) {
        const vf a = v[j], c = v[j + step];
        v[j] = a + c;
        v[j + step] = a - c;
      }
    }
  }
}

bool butterflies_vec(float* x, int64_t d) {
  using namespace radixkv_vec;
  const int64_t b = d & -d;
  if (b < VW || b > 64 * VW) return false;
  const int64_t nv = b / VW;
  vf v[64];
  for (int64_t base = 0; base < d; base += b) {
    float* y = x + base;
    for (int64_t i = 0; i < nv; ++i) v[i] = loadv(y + i * VW);
    butterfly_block(v, nv);
    for (int64_t i = 0; i < nv; ++i) storev(y + i * VW, v[i]);
  }
  return true;
}

void butterflies(float* x, int64_t d) {
  if (butterflies_vec(x, d)) return;
  const int64_t b = d & -d;
  for (int64_t base = 0; base < d; base += b) {
    float* y = x + base;
    for (int64_t len = 1; len < b; len <<= 1) {
      for (int64_t i = 0; i < b; i += 2 * len) {
        for (int64_t j = i; j < i + len; ++j) {
          const float a = y[j], c = y[j + len];
          y[j] = a + c;
          y[j + len] = a - c;
        }
      }
    }
  }
}

// bf16 <-> float32 a vector at a time: widening is exact (the bits shifted up by 16); narrowing
// rounds to nearest even and maps NaN to 0x7fc0, as c10::BFloat16(float) does, so the vector and
// scalar paths write the same bits (torch's .to(bfloat16) rounds the same way; its vectorized
// cast keeps other NaN bits).
typedef uint16_t vh __attribute__((vector_size(radixkv_vec::VW * 2)));
typedef uint32_t vu __attribute__((vector_size(radixkv_vec::VW * 4)));

inline radixkv_vec::vf widen_bf16(const c10::BFloat16* p) {
  return radixkv_vec::loadv(reinterpret_cast<const uint16_t*>(p));
}

inline void narrow_bf16(c10::BFloat16* p, radixkv_vec::vf x) {
  const vu bits = reinterpret_cast<vu>(x);
  const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vu nan = reinterpret_cast<vu>(x != x);  // all ones where x is NaN
  const vh h = __builtin_convertvector((rounded & ~nan) | (nan & 0x7fc0u), vh);
  std::memcpy(p, &h, sizeof(h));
}

// x rounded to the nearest bf16 (ties to even), kept as float32: narrow_bf16 then widen_bf16
// without the trip through memory (a NaN lane stays NaN; the carry could make it infinite).
inline radixkv_vec::vf round_to_bf16(radixkv_vec::vf x) {
  const vu bits = reinterpret_cast<vu>(x);
  const auto rounded =
      reinterpret_cast<radixkv_vec::vf>((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);
  return x != x ? x : rounded;
}

// dst[0 .. d) = the row at src as float32.
template <typename T>
void load_row(const T* src, int64_t d, float* dst) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; j + radixkv_vec::VW <= d; j += radixkv_vec::VW) {
      radixkv_vec::storev(dst + j, widen_bf16(src + j));
    }
  }
  for (; j < d; ++j) dst[j] = load(src + j);
}

// dst[0 .. d) = src * scale, rounded once to T.
template <typename T>
void store_row(const float* src, int64_t d, float scale, T* dst) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const radixkv_vec::vf sv = radixkv_vec::splat(scale);
    for (; j + radixkv_vec::VW <= d; j += radixkv_vec::VW) {
      narrow_bf16(dst + j, radixkv_vec::loadv(src + j) * sv);
    }
  }
  for (; j < d; ++j) dst[j] = static_cast<T>(src[j] * scale);
}

inline radixkv_vec::vf load_vec(const float* p) { return radixkv_vec::loadv(p); }
inline radixkv_vec::vf load_vec(const c10::BFloat16* p) { return widen_bf16(p); }
inline void store_vec(float* p, radixkv_vec::vf x) { radixkv_vec::storev(p, x); }
inline void store_vec(c10::BFloat16* p, radixkv_vec::vf x) { narrow_bf16(p, x); }

// Rows of d = blocks of NV vectors rotated in registers, straight from src to dst: butterfly_block
// as butterflies_vec runs it (so the same values), with every loop bound known at compile time
// and no float32 buffer between the load, the butterflies and the store.
template <typename T, int NV>
void hadamard_rows_fixed(const T* src, T* dst, int64_t begin, int64_t end, int64_t d,
                         float scale) {
  using namespace radixkv_vec;
  const vf sv = splat(scale);
  for (int64_t base = begin * d; base < end * d; base += NV * VW) {
    vf v[NV];
    for (int i = 0; i < NV; ++i) v[i] = load_vec(src + base + i * VW);
    butterfly_block(v, NV);
    for (int i = 0; i < NV; ++i) store_vec(dst + base + i * VW, v[i] * sv);
  }
}

// hadamard_rows_fixed for the block widths of the common head dims; false for the others.
template <typename T>
bool hadamard_rows_unrolled(const T* src, T* dst, int64_t begin, int64_t end, int64_t d,
                            float scale) {
  using radixkv_vec::VW;
  const int64_t b = d & -d;
  if (b < VW) return false;
  switch (b / VW) {
    case 1:
      hadamard_rows_fixed<T, 1>(src, dst, begin, end, d, scale);
      return true;
    case 2:
      hadamard_rows_fixed<T, 2>(src, dst, begin, end, d, scale);
      return true;
    case 4:
      hadamard_rows_fixed<T, 4>(src, dst, begin, end, d, scale);
      return true;
    case 8:
      hadamard_rows_fixed<T, 8>(src, dst, begin, end, d, scale);
      return true;
    default:
      return false;
  }
}

template <typename T>
void hadamard_impl(const T* src, T* dst, int64_t rows, int64_t d, float scale) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    if (hadamard_rows_unrolled(src, dst, begin, end, d, scale)) return;
    std::vector<float> buf(d);
    for (int64_t r = begin; r < end; ++r) {
      load_row(src + r * d, d, buf.data());
      butterflies(buf.data(), d);
      store_row(buf.data(), d, scale, dst + r * d);
    }
  });
}

uint16_t bf16_bits_nearest(float s) {
  const c10::BFloat16 b(s);  // round to nearest even, as torch's .to(bfloat16)
  return b.x;
}

typedef int8_t vc __attribute__((vector_size(radixkv_vec::VW)));
typedef uint8_t vcu __attribute__((vector_size(radixkv_vec::VW)));

#if defined(__AVX512F__) || defined(__AVX__)
// Each lane rounded to the nearest integer, ties to even.
inline radixkv_vec::vf round_even(radixkv_vec::vf y) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#if defined(__AVX512F__)
  return reinterpret_cast<radixkv_vec::vf>(
      _mm512_roundscale_ps(reinterpret_cast<__m512>(y), kMode));
#else
  return reinterpret_cast<radixkv_vec::vf>(_mm256_round_ps(reinterpret_cast<__m256>(y), kMode));
#endif
}
#endif

// Rotate-half RoPE of one head held as float32 in x[0 .. 2 half), in place: lo' = lo c + hi s,
// hi' = hi c' + lo s' with c = cos[0 .. half), c' = cos[half ..), s, s' likewise (sin
// sign-folded, so no negation here), each rounded to bf16: rope_ of cpu_fused.cpp, value for
// value, so that RoPE then the rotation give the bits the two ops give one after the other.
void rope_row(float* __restrict x, const float* __restrict c, const float* __restrict s,
              int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float lo = x[i], hi = x[i + half];
    x[i] = static_cast<float>(c10::BFloat16(lo * c[i] + hi * s[i]));
    x[i + half] = static_cast<float>(c10::BFloat16(hi * c[i + half] + lo * s[i + half]));
  }
}

// A head of D = NV vectors (D a power of two, VW | D / 2): loaded, RoPE'd (rope; rounded to
// bf16 as rope_ rounds), rotated and stored back rounded, without leaving registers.
template <int NV>
void rope_hadamard_head(c10::BFloat16* x, const float* c, const float* s, bool rope) {
  using namespace radixkv_vec;
  constexpr int kHalf = NV / 2;
  vf v[NV];
  for (int i = 0; i < NV; ++i) v[i] = widen_bf16(x + i * VW);
  if (rope) {
    for (int i = 0; i < kHalf; ++i) {
      const vf lo = v[i], hi = v[i + kHalf];
      v[i] = round_to_bf16(lo * loadv(c + i * VW) + hi * loadv(s + i * VW));
      v[i + kHalf] =
          round_to_bf16(hi * loadv(c + (i + kHalf) * VW) + lo * loadv(s + (i + kHalf) * VW));
    }
  }
  butterfly_block(v, NV);
  for (int i = 0; i < NV; ++i) narrow_bf16(x + i * VW, v[i]);
}

template <int NV>
void rope_hadamard_rows_fixed(c10::BFloat16* base, int64_t stride, const float* cos,
                              const float* sin, int64_t rope_heads, int64_t heads, int64_t begin,
                              int64_t end) {
  constexpr int64_t d = NV * radixkv_vec::VW;
  for (int64_t r = begin; r < end; ++r) {
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    for (int64_t h = 0; h < heads; ++h) {
      rope_hadamard_head<NV>(base + r * stride + h * d, c, s, h < rope_heads);
    }
  }
}

// The largest |x| of the d floats at x.
float abs_max(const float* x, int64_t d) {
  using namespace radixkv_vec;
  int64_t j = 0;
  float amax = 0.f;
  if (d >= VW) {
    vf m{};
    for (; j + VW <= d; j += VW) {
      const vf a = loadv(x + j);
      const vf abs = a < vf{} ? -a : a;
      m = abs > m ? abs : m;
    }
    for (int l = 0; l < VW; ++l) amax = std::max(amax, m[l]);
  }
  for (; j < d; ++j) amax = std::max(amax, std::fabs(x[j]));
  return amax;
}

// Row r of x is token r / hkv, head r % hkv: tokens `token_stride` elements apart, each token's
// hkv x d heads contiguous.
template <typename T, bool kInt8>
void quantize_rows(const T* x, int64_t token_stride, int64_t rows, int64_t d,
                   const int64_t* row_slot, int64_t hkv, int8_t* cache) {
  constexpr float kQmax = kInt8 ? 127.f : 448.f;
  const float widen = static_cast<float>((1.0 + 1.0 / 256.0) / (kInt8 ? 127.0 : 448.0));
  const int64_t row_bytes = d + 2;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    using namespace radixkv_vec;
    std::vector<float> buf(d);
    for (int64_t r = begin; r < end; ++r) {
      load_row(x + (r / hkv) * token_stride + (r % hkv) * d, d, buf.data());
      const float amax = abs_max(buf.data(), d);
      const uint16_t sbits = bf16_bits_nearest(amax * widen);
      int8_t* dst = cache + (row_slot[r / hkv] * hkv + r % hkv) * row_bytes;
      std::memcpy(dst + d, &sbits, sizeof(sbits));
      const float sf = radixkv_kvq::row_scale(dst, d);  // the scale as every reader decodes it
      const float inv = sf > 0.f ? 1.f / sf : 0.f;
      int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX__)
      if constexpr (kInt8) {
        // x / scale rounded to float, then to the nearest integer, ties to even: what
        // std::nearbyint gives (a round instruction, not an add, so nothing fuses the product
        // into it and skips its rounding)
        const vf iv = splat(inv), hi = splat(kQmax), lo = -hi;
        for (; j + VW <= d; j += VW) {
          vf q = round_even(loadv(buf.data() + j) * iv);
          q = q > hi ? hi : q;
          q = q < lo ? lo : q;
          const vc codes = __builtin_convertvector(__builtin_convertvector(q, vi), vc);
          std::memcpy(dst + j, &codes, sizeof(codes));
        }
      } else {
        // x / scale clamped to +-448, then to e4m3 with ties to even, as c10::Float8_e4m3fn:
        // a normal (|c| >= 2^-6) keeps the top 3 mantissa bits, rounded, and rebiases the
        // exponent (bias 127 -> 7: 120 << 3 off the code); a subnormal is |c| / 2^-9 rounded to
        // an integer code 0..8 (8 being 2^-6); the sign goes to bit 7.
        const vf iv = splat(inv), hi = splat(kQmax), lo = -hi;
        for (; j + VW <= d; j += VW) {
          vf c = loadv(buf.data() + j) * iv;
          c = c > hi ? hi : c;
          c = c < lo ? lo : c;
          const vu u = reinterpret_cast<vu>(c);
          const vu a = u & 0x7fffffffu;
          const vu normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
          const vf sub_f = round_even(reinterpret_cast<vf>(a) * splat(512.f));
          const vu sub = reinterpret_cast<vu>(__builtin_convertvector(sub_f, vi));
          const vu code = (a >= 0x3c800000u ? normal : sub) | ((u >> 24) & 0x80u);
          const vcu bytes = __builtin_convertvector(code, vcu);
          std::memcpy(dst + j, &bytes, sizeof(bytes));
        }
      }
#endif
      for (; j < d; ++j) {
        const float y = buf[j] * inv;
        if constexpr (kInt8) {
          const float q = std::min(kQmax, std::max(-kQmax, std::nearbyint(y)));
          dst[j] = static_cast<int8_t>(q);
        } else {
          const float c = std::min(kQmax, std::max(-kQmax, y));
          dst[j] = static_cast<int8_t>(c10::Float8_e4m3fn(c).x);
        }
      }
    }
  });
}

template <typename T>
void quantize_dispatch(const at::Tensor& x, const int64_t* slots, at::Tensor& cache) {
  const int64_t hkv = x.size(1), d = x.size(2), rows = x.size(0) * hkv, ts = x.stride(0);
  int8_t* dst = static_cast<int8_t*>(cache.data_ptr());
  if (cache.scalar_type() == at::kChar) {
    quantize_rows<T, true>(x.data_ptr<T>(), ts, rows, d, slots, hkv, dst);
  } else {
    quantize_rows<T, false>(x.data_ptr<T>(), ts, rows, d, slots, hkv, dst);
  }
}

// The slots of a store: a contiguous int64 [T] tensor, each a slot of `cache` ([pages, P, ...]);
// raises naming `what` otherwise.
const int64_t* checked_slots(const at::Tensor& slots, int64_t T, const at::Tensor& cache,
                             const char* what) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == T &&
                  slots.is_contiguous(),
              what, ": slots must be a contiguous int64 [T] tensor");
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < num_slots, what, ": a slot is outside the pool");
  }
  return s;
}

// out = x H * scale; out is x (in place) or a tensor like it. `what` names the op in errors.
void hadamard_into(const at::Tensor& x, at::Tensor& out, double scale, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0, what,
              ": x must be a contiguous CPU tensor [..., D]");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  if (x.scalar_type() == at::kFloat) {
    hadamard_impl<float>(x.data_ptr<float>(), out.data_ptr<float>(), rows, d, float(scale));
  } else if (x.scalar_type() == at::kBFloat16) {
    hadamard_impl<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows,
                                 d, float(scale));
  } else {
    TORCH_CHECK(false, what, ": x must be float32 or bfloat16");
  }
}

}  // namespace

at::Tensor hadamard_rows(const at::Tensor& x, double scale) {
  auto out = at::empty_like(x);
  hadamard_into(x, out, scale, "hadamard_rows");
  return out;
}

void hadamard_rows_(at::Tensor& x, double scale) { hadamard_into(x, x, scale, "hadamard_rows_"); }

void rope_hadamard_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    int64_t rope_heads, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kBFloat16 && qkv.dim() == 2 &&
                  qkv.stride(1) == 1,
              "rope_hadamard_: qkv must be a bf16 CPU [T, W] tensor with contiguous rows");
  const int64_t rows = qkv.size(0), d = head_dim;
  TORCH_CHECK(d > 0 && d % 2 == 0 && 0 <= rope_heads && rope_heads <= heads &&
                  heads * d <= qkv.size(1),
              "rope_hadamard_: need an even head_dim and rope_heads <= heads, heads * head_dim "
              "within the row");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * d &&
                  sin.numel() == rows * d,
              "rope_hadamard_: cos and sin must be contiguous float32 [rows, head_dim]");
  using radixkv_vec::VW;
  auto* base = qkv.data_ptr<c10::BFloat16>();
  const int64_t stride = qkv.stride(0);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    if (d == 4 * VW) {
      return rope_hadamard_rows_fixed<4>(base, stride, c, s, rope_heads, heads, begin, end);
    }
    if (d == 8 * VW) {
      return rope_hadamard_rows_fixed<8>(base, stride, c, s, rope_heads, heads, begin, end);
    }
    if (d == 2 * VW) {
      return rope_hadamard_rows_fixed<2>(base, stride, c, s, rope_heads, heads, begin, end);
    }
    std::vector<float> buf(d);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        c10::BFloat16* x = base + r * stride + h * d;
        load_row(x, d, buf.data());
        if (h < rope_heads) rope_row(buf.data(), c + r * d, s + r * d, d / 2);
        butterflies(buf.data(), d);
        store_row(buf.data(), d, 1.f, x);
      }
    }
  });
}

void store_kv_quant_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                     at::Tensor& v_cache, const at::Tensor& slots) {
  const auto rows_contiguous = [](const at::Tensor& x) {  // tokens at any stride
    return x.stride(2) == 1 && x.stride(1) == x.size(2);
  };
  TORCH_CHECK(k.device().is_cpu() && k.dim() == 3 && v.sizes() == k.sizes() &&
                  rows_contiguous(k) && rows_contiguous(v) && v.scalar_type() == k.scalar_type(),
              "store_kv_quant_: k, v must be CPU [T, Hkv, D] tensors of one dtype, each token's "
              "Hkv x D heads contiguous");
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16,
              "store_kv_quant_: k, v must be float32 or bfloat16");
  TORCH_CHECK((k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kByte) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "store_kv_quant_: caches must be contiguous int8 / uint8 [pages, P, Hkv, D + 2]");
  const int64_t T = k.size(0), hkv = k.size(1), d = k.size(2);
  TORCH_CHECK(k_cache.size(2) == hkv && k_cache.size(3) == d + 2,
              "store_kv_quant_: a cache row must be D + 2 bytes for ", hkv, " heads of ", d);
  const int64_t* s = checked_slots(slots, T, k_cache, "store_kv_quant_");
  if (k.scalar_type() == at::kFloat) {
    quantize_dispatch<float>(k, s, k_cache);
    quantize_dispatch<float>(v, s, v_cache);
  } else {
    quantize_dispatch<c10::BFloat16>(k, s, k_cache);
    quantize_dispatch<c10::BFloat16>(v, s, v_cache);
  }
}

void store_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slots) {
  TORCH_CHECK(k.device().is_cpu() && k.dim() == 3 && v.sizes() == k.sizes() &&
                  v.scalar_type() == k.scalar_type() && k_cache.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "store_kv_: k, v and the caches must be CPU tensors of one dtype, k, v [T, Hkv, D]");
  const int64_t T = k.size(0), hkv = k.size(1), d = k.size(2);
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == d,
                "store_kv_: each token's [Hkv, D] row of k and v must be contiguous");
  }
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(2) == hkv && k_cache.size(3) == d,
              "store_kv_: caches must be contiguous [pages, P, Hkv, D] of k's heads and dim");
  const int64_t* s = checked_slots(slots, T, k_cache, "store_kv_");
  const int64_t es = k.element_size(), row = hkv * d * es;
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t kst = k.stride(0) * es, vst = v.stride(0) * es;
  // a decode step's few KB are not worth waking the threads for; a long prefill's are
  at::parallel_for(0, T, 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      std::memcpy(kc + s[t] * row, ks + t * kst, row);
      std::memcpy(vc + s[t] * row, vs + t * vst, row);
    }
  });
}

void copy_pages_(std::vector<at::Tensor> caches, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong && src.dim() == 1 &&
                  dst.sizes() == src.sizes() && src.is_contiguous() && dst.is_contiguous(),
              "copy_pages_: src and dst must be contiguous int64 [n] tensors of one size");
  if (caches.empty() || src.numel() == 0) return;
  const at::Tensor& first = caches.front();
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.sizes() == first.sizes() &&
                    c.scalar_type() == first.scalar_type() && c.dim() >= 1,
                "copy_pages_: caches must be contiguous CPU tensors of one shape and dtype");
  }
  const int64_t pages = first.size(0), n = src.numel();
  const int64_t bytes = first.numel() / std::max<int64_t>(pages, 1) * first.element_size();
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < pages && d[i] >= 0 && d[i] < pages,
                "copy_pages_: a page index is outside the cache");
  }
  for (const at::Tensor& c : caches) {
    char* base = static_cast<char*>(c.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memmove(base + d[i] * bytes, base + s[i] * bytes, bytes);
  }
}
