// y = x W^T with W in GGML's block-quantized formats (Q4_0, Q4_1, Q8_0), kept as the GGUF file's
// raw rows, and x quantized to int8 per 32-block: llama.cpp's way of multiplying a quantized
// model (its Q8_0 / Q8_1 activations), with a float32 scale for x where llama.cpp rounds it to
// fp16.
//
// Each row of x is quantized once per call: block b of 32 values gets d_b = amax_b / 127 (float32)
// and codes q_k = clamp(rint(x_k / d_b), -127, 127) (0 where amax_b = 0), plus, for Q4_1, the
// block's sum s_b = d_b * sum_k q_k (float32). Then each output row n and row r of x sums over
// blocks
//   Q8_0, Q4_0: (d_w d_b) * dot(c, q)              c = the signed weight codes (Q4_0: nibble - 8)
//   Q4_1:       (d_w d_b) * dot(c, q) + m_w * s_b  c = the nibbles 0..15
// the dots exact 32-bit integers (|dot| <= 32 * 128 * 127 < 2^24, so exact as float32 too).
//
// Error bound (what tests/test_quant_dot.py checks, against y64 = sum_k x_k w_k in float64 with
// w = GGML's dequantized weight): with u = eps32 / 2,
//   x's quantization: x_k / d_b is rounded once (u relative), so |q_k - x_k / d_b| <= 1/2 +
//     u |x_k / d_b| and, with x^_k = d_b q_k, |x_k - x^_k| <= d_b / 2 + u |x_k|;
//   the sums: each block term is (d_w d_b) p or m_w s_b (p an exact integer: one rounding for
//     d_w d_b, one for s_b), added to one of at most 9 float32 chains of <= nb = K / 32 terms
//     (8 vector lanes, the minimum term's chain) summed at the end by 4 more additions, so the
//     computed sum is off sum_k x^_k w_k by at most gamma_{nb+6} sum |terms|, and
//     sum |terms| <= sum_k mu_k |x^_k| with mu_k = |d_w c_k| + |m_w| (m_w = 0 for the signed
//     formats) the size of the weight's decomposition (mu_k = |w_k| for Q8_0 and Q4_0; for Q4_1
//     it can exceed |w_k| when d q and m cancel).
// Together, with |x^_k| <= |x_k| + d_b / 2 and (nb + 6) u <= K eps32 / 8 for K >= 32:
//   |y - y64| <= sum_b (d_b / 2) sum_{k in b} |w_k| + c K eps32 sum_k mu_k (|x_k| + d_b / 2),
// c = 1 (covering the 1/8 above, the u |x_k w_k| of x's rounding and gamma's second order with
// room). The first term is the activation quantization llama.cpp also makes (a float path has
// none); the second is below the float path's own K eps32 sum |x w| bound where mu ~ |w|.
// (Subnormal amax_b is outside this analysis: d_b loses relative precision; the clamp keeps the
// codes in int8 and the error is below 1e-38 |w|.)
//
// AVX2: a block's 32 codes are one 256-bit vector; _mm256_maddubs_epi16 needs one unsigned
// operand: Q4_1's nibbles are unsigned as they stand, Q4_0's (nibble - 8) and Q8_0's signed codes
// go through the sign trick (|c| and sign(q, c), as llama.cpp). _mm256_madd_epi16 against ones
// leaves 8 int32 lanes, converted and FMA'd with the broadcast scale into a per-row float32 vector
// accumulator. Workers own contiguous runs of output rows and multiply each weight block, loaded
// once, against all M (<= 8) rows of x. The portable build runs the same integer dots in scalar
// code (one float accumulator per row: results equal up to float summation order).

#include "cpu_quant_dot.h"

#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_quant_linear.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RADIXKV_QDOT_AVX2 1
#else
#define RADIXKV_QDOT_AVX2 0
#endif

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kQBlock = 32;  // x's quantization block = every served format's block

enum DotType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

inline float half_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
#if RADIXKV_QDOT_AVX2
  return _cvtsh_ss(v);
#else
  return c10::detail::fp16_ieee_to_fp32_value(v);
#endif
}

// x [m, k] quantized per 32-block. Codes row-major [m, k]; scales and (Q4_1) scaled code sums
// block-major [nb, kMaxRows] so one block's values for every row are adjacent.
struct QuantizedRows {
  int64_t m = 0, nb = 0;
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

void quantize_rows(const float* x, int64_t m, int64_t k, QuantizedRows& out) {
  out.m = m;
  out.nb = k / kQBlock;
  out.q.assign(m * k, 0);
  out.d.assign(out.nb * kMaxRows, 0.f);
  out.s.assign(out.nb * kMaxRows, 0.f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < out.nb; ++b) {
      const float* xb = x + r * k + b * kQBlock;
      int8_t* qb = out.q.data() + r * k + b * kQBlock;
      float amax = 0.f;
      for (int64_t i = 0; i < kQBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f;
      int32_t sum = 0;
      if (amax > 0.f) {
        for (int64_t i = 0; i < kQBlock; ++i) {
          // nearbyint: round half to even (the default rounding mode), as numpy's rint
          const float t = std::nearbyint(xb[i] / d);
          const int32_t c = static_cast<int32_t>(std::min(127.f, std::max(-127.f, t)));
          qb[i] = static_cast<int8_t>(c);
          sum += c;
        }
      }
      out.d[b * kMaxRows + r] = d;
      out.s[b * kMaxRows + r] = d * static_cast<float>(sum);
    }
  }
}

// Formats: kBytes per 32 weights. codes(block, ...) gives d_w, m_w (0 for the signed formats)
// and the 32 codes in order.
struct FmtQ4_0 {
  static constexpr int64_t kBytes = 18;
  static constexpr bool kMin = false;
};
struct FmtQ4_1 {
  static constexpr int64_t kBytes = 20;
  static constexpr bool kMin = true;
};
struct FmtQ8_0 {
  static constexpr int64_t kBytes = 34;
  static constexpr bool kMin = false;
};

#if RADIXKV_QDOT_AVX2
// The sum of v's 8 lanes (once per output: hadd's latency is not on the block loop's path).
inline float hsum8(__m256 v) {
  const __m128 halves = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  const __m128 pairs = _mm_hadd_ps(halves, halves);
  return _mm_cvtss_f32(_mm_hadd_ps(pairs, pairs));
}

// The 32 codes of a block, in weight order (nibble formats: low nibbles are weights 0-15, high
// nibbles 16-31).
template <class F>
inline __m256i block_codes(const uint8_t* b) {
  if constexpr (std::is_same_v<F, FmtQ8_0>) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (F::kMin ? 4 : 2)));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i nib =
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
    if constexpr (F::kMin) return nib;
    return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
  }
}

// Rows [0, MR) of the quantized x times weight row w; y[r * ldy] gets row r's sum.
template <class F, int MR>
inline void dot_rows(const uint8_t* w, const QuantizedRows& xq, int64_t k, float* y,
                     int64_t ldy) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  __m256 macc = _mm256_setzero_ps();  // Q4_1's m_w s_b terms, lane r for row r
  const int64_t nb = xq.nb;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * F::kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(blk) + 512, _MM_HINT_T0);
    const __m256 dw = _mm256_set1_ps(half_at(blk));
    const __m256i c = block_codes<F>(blk);
    // the unsigned operand: nibbles as they are; |c| for signed codes (sign moved onto x)
    const __m256i cu = F::kMin ? c : _mm256_sign_epi8(c, c);
    const int8_t* qb = xq.q.data() + b * kQBlock;
    const float* db = xq.d.data() + b * kMaxRows;
    for (int r = 0; r < MR; ++r) {
      __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + r * k));
      if constexpr (!F::kMin) qx = _mm256_sign_epi8(qx, c);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(cu, qx), ones);
      const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(db + r));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]);
    }
    if constexpr (F::kMin) {
      macc = _mm256_fmadd_ps(_mm256_set1_ps(half_at(blk + 2)),
                             _mm256_loadu_ps(xq.s.data() + b * kMaxRows), macc);
    }
  }
  alignas(32) float mins[8];
  _mm256_store_ps(mins, macc);
  for (int r = 0; r < MR; ++r) y[r * ldy] = hsum8(acc[r]) + (F::kMin ? mins[r] : 0.f);
}

template <class F>
void dot_range(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, int64_t k, float* y,
               int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float* yn = y + n;
    switch (xq.m) {
      case 1: dot_rows<F, 1>(wr, xq, k, yn, ldy); break;
      case 2: dot_rows<F, 2>(wr, xq, k, yn, ldy); break;
      case 3: dot_rows<F, 3>(wr, xq, k, yn, ldy); break;
      case 4: dot_rows<F, 4>(wr, xq, k, yn, ldy); break;
      case 5: dot_rows<F, 5>(wr, xq, k, yn, ldy); break;
      case 6: dot_rows<F, 6>(wr, xq, k, yn, ldy); break;
      case 7: dot_rows<F, 7>(wr, xq, k, yn, ldy); break;
      default: dot_rows<F, 8>(wr, xq, k, yn, ldy); break;
    }
  }
}
#else
// The same integer dots, scalar.
template <class F>
void dot_range(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, int64_t k, float* y,
               int64_t ldy, int64_t n0, int64_t n1) {
  int8_t c[kQBlock];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float acc[kMaxRows] = {};
    for (int64_t b = 0; b < xq.nb; ++b) {
      const uint8_t* blk = wr + b * F::kBytes;
      const float dw = half_at(blk), mw = F::kMin ? half_at(blk + 2) : 0.f;
      if constexpr (std::is_same_v<F, FmtQ8_0>) {
        std::memcpy(c, blk + 2, kQBlock);
      } else {
        const uint8_t* qs = blk + (F::kMin ? 4 : 2);
        const int off = F::kMin ? 0 : 8;
        for (int i = 0; i < 16; ++i) {
          c[i] = static_cast<int8_t>((qs[i] & 0xF) - off);
          c[i + 16] = static_cast<int8_t>((qs[i] >> 4) - off);
        }
      }
      for (int64_t r = 0; r < xq.m; ++r) {
        const int8_t* qx = xq.q.data() + r * k + b * kQBlock;
        int32_t p = 0;
        for (int i = 0; i < kQBlock; ++i) p += static_cast<int32_t>(c[i]) * qx[i];
        acc[r] += (dw * xq.d[b * kMaxRows + r]) * static_cast<float>(p);
        if constexpr (F::kMin) acc[r] += mw * xq.s[b * kMaxRows + r];
      }
    }
    for (int64_t r = 0; r < xq.m; ++r) y[r * ldy + n] = acc[r];
  }
}
#endif

template <class F>
void gemm_q8(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
             float* y, int64_t ldy) {
  QuantizedRows xq;
  quantize_rows(x, m, k, xq);
  // runs of output rows in multiples of 4 (a worker's outputs share no cache line with another's
  // in rows of 16 floats and more)
  const int64_t units = (n + 3) / 4;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t wk = w0; wk < w1; ++wk) {
      const int64_t n0 = std::min(n, units * wk / workers * 4);
      const int64_t n1 = std::min(n, units * (wk + 1) / workers * 4);
      dot_range<F>(w, row_bytes, xq, k, y, ldy, n0, n1);
    }
  });
}

template <class Fn>
void with_dot_format(int64_t ggml_type, Fn&& fn) {
  switch (ggml_type) {
    case kQ4_0: fn(FmtQ4_0{}, "Q4_0"); return;
    case kQ4_1: fn(FmtQ4_1{}, "Q4_1"); return;
    case kQ8_0: fn(FmtQ8_0{}, "Q8_0"); return;
    default:
      TORCH_CHECK(false, "quant_gemm_q8_into: GGML type ", ggml_type,
                  " is not supported (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 are)");
  }
}

}  // namespace

std::vector<int64_t> quant_dot_types() { return {kQ4_0, kQ4_1, kQ8_0}; }

int64_t quant_dot_max_rows() { return kMaxRows; }

void quant_gemm_q8_into(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type,
                        const at::Tensor& out) {
  static constexpr const char* fn = "quant_gemm_q8_into";
  with_dot_format(ggml_type, [&](auto f, const char* name) {
    using F = decltype(f);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte, fn,
                ": w must be a 2-D uint8 tensor of raw GGML rows [N, row_bytes], got ",
                w.scalar_type(), " ", w.sizes());
    TORCH_CHECK(w.is_contiguous(), fn, ": w must be contiguous");
    TORCH_CHECK(w.size(1) % F::kBytes == 0, fn, ": a ", name, " row is whole blocks of ",
                F::kBytes, " bytes, but w's rows have ", w.size(1), " bytes");
    const int64_t k = w.size(1) / F::kBytes * kQBlock;
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, fn,
                ": x must be 2-D float32 rows [M, K], got ", x.scalar_type(), " ", x.sizes());
    TORCH_CHECK(x.is_contiguous(), fn, ": x must be contiguous");
    TORCH_CHECK(x.size(0) <= kMaxRows, fn, ": at most ", kMaxRows, " rows of x, got ",
                x.size(0), " (use quant_gemm_into)");
    TORCH_CHECK(x.size(1) == k, fn, ": x has K = ", x.size(1), " inputs, but w's rows of ",
                w.size(1), " bytes hold ", k, " ", name, " weights");
    const int64_t m = x.size(0), n = w.size(0);
    TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) >= n, fn,
                ": out must be [M, >= N] = [", m, ", >= ", n, "], got ", out.sizes());
    TORCH_CHECK(out.scalar_type() == at::kFloat, fn, ": out must be float32, got ",
                out.scalar_type());
    TORCH_CHECK(out.stride(1) == 1 || out.size(1) <= 1, fn,
                ": out's last stride must be 1, got ", out.strides());
    if (m == 0 || n == 0) return;
    gemm_q8<F>(x.data_ptr<float>(), m, k, w.data_ptr<uint8_t>(), n, w.size(1),
               out.data_ptr<float>(), out.stride(0));
  });
}

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t ggml_type,
                        int64_t int8_rows) {
  TORCH_CHECK(x_in.dim() == 2, "quant_linear: x must be 2-D rows [M, K], got ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0);
  const bool served = ggml_type == kQ4_0 || ggml_type == kQ4_1 || ggml_type == kQ8_0;
  if (!(served && x.scalar_type() == at::kFloat && m > 0 && m <= std::min(int8_rows, kMaxRows))) {
    return quant_gemm(x, w, ggml_type);
  }
  at::Tensor out = at::empty({m, w.size(0)}, x.options());
  quant_gemm_q8_into(x, w, ggml_type, out);
  return out;
}
