// Quantized KV rows (radixkv/model/kv_quant.py) as the native kernels read them: a (token, head)
// row is D codes (int8, or float8 e4m3 bit patterns) followed by the row's scale, a
// little-endian bfloat16 in its last 2 bytes; the value of element i is code[i] * scale.
//
// Dequantizing is exact in float32: an int8 code or an e4m3 value has at most 8 significant bits
// and the scale 8, so code * scale is the float32 product with no rounding, the same value as
// kv_quant.dequantize (which multiplies in float32 too). e4m3 -> float32: the 7 magnitude bits go
// to bit 20 of a float32 (exponent field low 4 bits, mantissa top 3 bits) and the result is
// multiplied by 2^120 (the bias difference 127 - 7); a subnormal e4m3 lands on a float32
// subnormal with the same mantissa, so this is exact for every code. Vectorized (AVX-512, AVX2)
// from the sign-extended code: shifted left by 20, its bits 20..26 are the magnitude and bit 31
// the sign, and kE4m3Mask clears the sign extension between them. The quantizer never emits
// NaN (0x7f / 0xff would read as +-480).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixkv_kvq {

constexpr int kScaleBytes = 2;
constexpr float kE4m3Bias = 1.329227995784915872903807060280344576e36f;  // 2^120
constexpr int32_t kE4m3Mask = static_cast<int32_t>(0x87f00000u);

// The row's scale (the bfloat16 after its d codes) as a float.
inline float row_scale(const void* row, int64_t d) {
  uint16_t h;
  std::memcpy(&h, static_cast<const char*>(row) + d, sizeof(h));
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The float32 value of an e4m3 bit pattern (exact; see the file comment).
inline float e4m3_to_float(uint8_t b) {
  const uint32_t u =
      (static_cast<uint32_t>(b & 0x7f) << 20) | (static_cast<uint32_t>(b & 0x80) << 24);
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f * kE4m3Bias;
}

#if defined(__AVX512F__)
// The values of the 16 int8 codes at p (without the row's scale), as float32.
inline __m512 codes16_i8(const void* p) {
  const __m128i c = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
}

// The values of the 16 e4m3 codes at p (without the row's scale), as float32.
inline __m512 codes16_fp8(const void* p) {
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(kE4m3Mask));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(kE4m3Bias));
}

// 16 codes at p, times `scale`, as float32.
inline __m512 dequant16_i8(const void* p, __m512 scale) {
  return _mm512_mul_ps(codes16_i8(p), scale);
}

inline __m512 dequant16_fp8(const void* p, __m512 scale) {
  return _mm512_mul_ps(codes16_fp8(p), scale);
}
#endif

#if defined(__AVX2__)
inline __m256 dequant8_i8(const void* p, __m256 scale) {
  const __m128i c = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), scale);
}

inline __m256 dequant8_fp8(const void* p, __m256 scale) {
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(kE4m3Mask));
  const __m256 f = _mm256_castsi256_ps(bits);
  return _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(kE4m3Bias)), scale);
}
#endif

// dst[0 .. d) = the values of the quantized row at `row` (int8 codes, or e4m3 with FP8).
template <bool FP8>
inline void dequant_row(const void* row, int64_t d, float* dst) {
  const float s = row_scale(row, d);
  const int8_t* codes = static_cast<const int8_t*>(row);
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(s);
  for (; i + 16 <= d; i += 16) {
    _mm512_storeu_ps(dst + i, FP8 ? dequant16_fp8(codes + i, sv) : dequant16_i8(codes + i, sv));
  }
#endif
#if defined(__AVX2__)
  const __m256 sv8 = _mm256_set1_ps(s);
  for (; i + 8 <= d; i += 8) {
    _mm256_storeu_ps(dst + i, FP8 ? dequant8_fp8(codes + i, sv8) : dequant8_i8(codes + i, sv8));
  }
#endif
  for (; i < d; ++i) {
    const float c =
        FP8 ? e4m3_to_float(static_cast<uint8_t>(codes[i])) : static_cast<float>(codes[i]);
    dst[i] = c * s;
  }
}

}  // namespace radixkv_kvq
