// Float vectors of the build's width for radixkv's native CPU kernels: GCC vector extensions of
// 16 floats with AVX-512, 8 otherwise (AVX2, or the portable baseline, where the compiler splits
// them), so one source serves every ISA level. Shared by the float32 attention kernel, the
// sampler's draw, and (for bf16 reads) the fused layers and the KV store.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixkv_vec {

#if defined(__AVX512F__)
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

// Broadcast. (Not `vf{} + x`: 0 + x is not x for x = -0, so the compiler must emit a scalar add
// before every broadcast, one in the innermost loops.)
inline vf splat(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(x));
#elif defined(__AVX__)
  return reinterpret_cast<vf>(_mm256_set1_ps(x));
#else
  return x - vf{};  // x - 0 == x for every x, so this folds to a broadcast
#endif
}

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// The sum of v's lanes, added in lane order (one serial chain: the same result on every build of
// one width).
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}

// Elements of a row that is float32 or bf16 (the bits of a bfloat16, as uint16_t), read as float32
// (exact: a bf16 widens by shifting its bits up 16): one vector, or one element.
inline vf loadv(const uint16_t* p) {
#if defined(__AVX512F__)
  // one zero-extending load and a shift (the vector extension's form below compiles to two
  // half-width widenings and an insert here)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<vf>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  typedef uint16_t vh __attribute__((vector_size(VW * 2)));
  typedef uint32_t vu __attribute__((vector_size(VW * 4)));
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
#endif
}
inline float loads(const float* p) { return *p; }
inline float loads(const uint16_t* p) {
  const uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// 1 / d, lane-wise: the hardware's reciprocal estimate (2^-14 relative with AVX-512, 2^-12 with
// AVX) and one Newton step, within about two float32 roundings of the quotient; a division
// elsewhere. (A 16-lane division issues once every ~16 cycles; it bounded silu_mul.)
inline vf recip(vf d) {
#if defined(__AVX512F__)
  const __m512 x = reinterpret_cast<__m512>(d);
  const __m512 r = _mm512_rcp14_ps(x);
  return reinterpret_cast<vf>(_mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.f))));
#elif defined(__AVX__) && defined(__FMA__)
  const __m256 x = reinterpret_cast<__m256>(d);
  const __m256 r = _mm256_rcp_ps(x);
  return reinterpret_cast<vf>(_mm256_mul_ps(r, _mm256_fnmadd_ps(x, r, _mm256_set1_ps(2.f))));
#else
  return splat(1.f) / d;
#endif
}

// 2^x for x <= 0 (clamped at -126): x = n + f, f in [-0.5, 0.5], 2^f = 1 + f P(f).
inline vf exp2v(vf x0) {
  const vf lo = splat(-126.f);
  const vf x = x0 < lo ? lo : x0;
  const vf magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x + magic) - magic;
  const vf f = x - n;
  vf y = splat(1.535336188319500e-4f);  // minimax on [-0.5, 0.5] (Cephes exp2f), ~2e-8
  y = y * f + 1.339887440266574e-3f;
  y = y * f + 9.618437357674640e-3f;
  y = y * f + 5.550332471162809e-2f;
  y = y * f + 2.402264791363012e-1f;
  y = y * f + 6.931472028550421e-1f;
  y = y * f + 1.f;  // 2^f = 1 + f P(f)
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return x0 < lo ? vf{} : y * scale;  // masked keys (-inf) give exactly 0
}

}  // namespace radixkv_vec
