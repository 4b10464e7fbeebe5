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
//     d_w d_b, one for s_b), added to a float32 chain of <= nb = K / 32 terms: on AVX2's groups
//     of 8 output rows, one chain (a vector lane) of the dot terms and one of Q4_1's min terms,
//     added at the end (gamma_{nb+1}); otherwise (the portable build; AVX2's N % 8 last rows and
//     Q8_0 at M = 1) one of at most 9 chains (8 vector lanes, the min terms' chain) summed at
//     the end by 4 more additions. Either way the computed sum is off sum_k x^_k w_k by at most
//     gamma_{nb+6} sum |terms|, and
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
// Two terms (terms = 2, at most 4 rows of x): row r is also quantized a second time as what its
// codes leave, e_k = x_k - d_b q_k (float32, |e_k| <= d_b / 2 + u |x_k|), with its own scales
// d2_b = amax(e_b) / 127 <= d_b / 254 (+ rounding); the second term is kernel row m + r, whose
// sum the stores add to row r's. x^ = d_b q + d2_b q2, so the bound above holds with d_b / 2
// replaced by d2_b / 2 (<= amax_b / 64516) in the quantization term and the float32 chains twice
// as long (2 nb terms: still within K eps32 / 8 for K >= 64). tests/test_quant_dot.py checks it.
//
// AVX2, as llama.cpp's repacked gemv kernels (ggml-cpu repack.cpp) but on the file's own rows:
// output rows go in groups of 8 (rows 8i..8i+7; the N % 8 last rows one at a time), and per
// block and row of x one int -> float conversion and one FMA, with the 8 rows' d_w times d_b,
// serve the 8 outputs (lane j of a float32 vector = row j), plus for Q4_1 one FMA of the 8 rows'
// m_w times s_b. _mm256_maddubs_epi16 needs one unsigned operand: Q4_0 / Q4_1: the 8 rows' 16
// nibble bytes are transposed so a vector holds 4 bytes of each row (lane j = row j), its low and
// high nibbles multiplied with x's 4 matching codes broadcast; a lane's 8 int16 products are
// summed (< 2^15) and widened once, giving row j's dot in lane j with no horizontal sum; Q4_0
// uses the nibbles and subtracts 8 sum(q) (exact in int32). Q8_0's signed codes go through the
// sign trick (|c| and sign(q, c), as llama.cpp), each row's 8 int32 lanes reduced across the 8
// rows by a hadd tree (M <= 4) or the 8 rows' codes transposed as above (M >= 5); at M = 1 (a
// DRAM-bound lm_head) rows go one at a time (dot_rows: a plain sequential stream reads faster).
// The fp16 scales of a group's 8 rows are gathered with scalar loads and unpacks (no side table).
// A group's rows are 8 short interleaved streams the hardware prefetcher misses: each block step
// prefetches a slice of the next group. Workers own whole groups (runs of output rows in
// multiples of 8), so which rows are grouped, and every output's summation order, does not depend
// on the thread count. Each weight block is loaded once against all M (<= 8) rows of x. The
// portable build runs the same integer dots in scalar code (one float accumulator per row:
// results equal up to float summation order).
// Measured (Zen 3 host, 2 cores shared, bench: weights streamed from DRAM, min over calls, 1
// thread, us, before -> after this layout; Q4_1 unless named): M = 1: qkv 960x576 46 -> 29,
// o_proj 576x576 25 -> 16, gate_up 3072x576 137 -> 92, down 576x1536 61 -> 39, lm_head Q8_0
// 49152x576 2377 -> 2056 (prefetch 2048 B ahead, not 512), gate_up Q4_0 133 -> 74; M = 4:
// 80 -> 43, 50 -> 27, 252 -> 136, 124 -> 71, lm_head 5149 -> 4803; M = 8: 190 -> 99, 91 -> 50,
// 464 -> 241, 207 -> 126, lm_head 7056 -> 5446, gate_up Q4_0 474 -> 206. At M = 1 the Q4 groups
// read ~14 GB/s, near this host's ~16 GB/s single-thread read; Q8_0 at M >= 2 is bound by the
// sign trick's 4 ops per 32 products (1.1-1.3x).

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
#include "cpu_work.h"

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

using radixkv_qdot::QuantizedRows;

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

// Row r of the kernel's x is output row r (r < out_m) or, for two-term activations, the second
// term of output row r - out_m, whose sum is added to the first's (stored before it: r ascends).
inline void fold_store(float* y, int64_t ldy, int64_t r, int64_t out_m, float v) {
  if (r < out_m) {
    y[r * ldy] = v;
  } else {
    y[(r - out_m) * ldy] += v;
  }
}

#if RADIXKV_QDOT_AVX2
inline void fold_store(float* y, int64_t ldy, int64_t r, int64_t out_m, __m256 v) {
  if (r < out_m) {
    _mm256_storeu_ps(y + r * ldy, v);
  } else {
    float* p = y + (r - out_m) * ldy;
    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), v));
  }
}

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
    _mm_prefetch(reinterpret_cast<const char*>(blk) + 2048, _MM_HINT_T0);
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
  for (int r = 0; r < MR; ++r) {
    fold_store(y, ldy, r, xq.out_m, hsum8(acc[r]) + (F::kMin ? mins[r] : 0.f));
  }
}

// weight rows multiplied together: one float vector lane each
constexpr int64_t kGroup = radixkv_qdot::kGroupRows;
// Q8_0 groups at this many rows of x and more transpose the 8 rows' codes (hadd tree below)
constexpr int kQ8TransposeRows = 5;

inline __m256i load_pair(const uint8_t* lo, const uint8_t* hi) {
  return _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}

inline __m256i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// The fp16 fields at byte 0 (d_w) and, for Q4_1, byte 2 (m_w) of a block in 8 rows (blk in row
// 0, stride rb) as float32 vectors, lane j = row j. (As fast as 16 pinsrw here, and faster than
// vpgatherdd on Zen 3.)
template <class F>
inline void group_scales(const uint8_t* blk, int64_t rb, __m256& dw, __m256& mw) {
  auto ld = [](const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm_cvtsi32_si128(v);
  };
  // [d_j m_j 0 ...] in 16-bit lanes, interleaved to [d0 d1 d2 d3 m0 m1 m2 m3] and rows 4-7
  const __m128i u01 = _mm_unpacklo_epi16(ld(blk), ld(blk + rb));
  const __m128i u23 = _mm_unpacklo_epi16(ld(blk + 2 * rb), ld(blk + 3 * rb));
  const __m128i u45 = _mm_unpacklo_epi16(ld(blk + 4 * rb), ld(blk + 5 * rb));
  const __m128i u67 = _mm_unpacklo_epi16(ld(blk + 6 * rb), ld(blk + 7 * rb));
  const __m128i w03 = _mm_unpacklo_epi32(u01, u23), w47 = _mm_unpacklo_epi32(u45, u67);
  dw = _mm256_cvtph_ps(_mm_unpacklo_epi64(w03, w47));
  if constexpr (F::kMin) mw = _mm256_cvtph_ps(_mm_unpackhi_epi64(w03, w47));
}

// A group's 8 rows are one contiguous run of 8 rb bytes, read block by block in 8 places at once:
// each row too short a stream for the hardware prefetcher to pick up (streamed from DRAM, the
// groups ran no faster than one row at a time without this). While block b of a group is
// multiplied, the b-th slice (8 blocks' bytes) of the next group is prefetched. (Past the last
// group this touches other rows or addresses past w's end: prefetches do not fault.)
template <class F>
inline void prefetch_next_group(const uint8_t* w, int64_t rb, int64_t b) {
  const char* p = reinterpret_cast<const char*>(w) + kGroup * rb + b * kGroup * F::kBytes;
  for (int64_t off = 0; off < kGroup * F::kBytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// Output rows n .. n+7 (weight rows w + j rb) for rows [0, MR) of x; y[r ldy + j] gets output j
// of x row r. Q4_0 / Q4_1: the 8 rows' 16 nibble bytes are transposed into 4 vectors, vector g
// holding bytes 4g..4g+3 of row j in lane j: its low nibbles are weights 4g..4g+3, its high ones
// 16+4g..16+4g+3, multiplied (maddubs) with x's codes of those weights broadcast to every lane.
// A lane's 8 products are summed in int16 (|maddubs| <= 2 * 15 * 127, 8 of them < 2^15) and
// widened once to int32: lane j is row j's integer dot, no horizontal sum. Q4_0's codes are the
// nibbles minus 8: the nibbles' dot less 8 sum(q), exact in int32. One int -> float conversion
// and one FMA (scale d_w d_b, lane j with row j's d_w) per block and x row serve 8 outputs;
// Q4_1's m_w s_b terms go to a second chain per x row.
template <class F, int MR>
inline void dot_group_nib(const uint8_t* w, int64_t rb, const QuantizedRows& xq, int64_t k,
                          float* y, int64_t ldy) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR], macc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  const int64_t nb = xq.nb;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * F::kBytes;
    prefetch_next_group<F>(w, rb, b);
    __m256 dw, mw = _mm256_setzero_ps();
    group_scales<F>(blk, rb, dw, mw);
    const uint8_t* qs = blk + (F::kMin ? 4 : 2);
    // rows j and j + 4 in the two 128-bit lanes; a 4x4 transpose of dwords in each lane
    const __m256i y0 = load_pair(qs, qs + 4 * rb), y1 = load_pair(qs + rb, qs + 5 * rb);
    const __m256i y2 = load_pair(qs + 2 * rb, qs + 6 * rb);
    const __m256i y3 = load_pair(qs + 3 * rb, qs + 7 * rb);
    const __m256i t0 = _mm256_unpacklo_epi32(y0, y1), t1 = _mm256_unpackhi_epi32(y0, y1);
    const __m256i t2 = _mm256_unpacklo_epi32(y2, y3), t3 = _mm256_unpackhi_epi32(y2, y3);
    const __m256i g[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                          _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    __m256i lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      lo[i] = _mm256_and_si256(g[i], m4);
      hi[i] = _mm256_and_si256(_mm256_srli_epi16(g[i], 4), m4);
    }
    const int8_t* qb = xq.q.data() + b * kQBlock;
    const float* db = xq.d.data() + b * kMaxRows;
    for (int r = 0; r < MR; ++r) {
      const int8_t* qr = qb + r * k;
      const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast32(qr)),
                                          _mm256_maddubs_epi16(lo[1], bcast32(qr + 4)));
      const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[2], bcast32(qr + 8)),
                                          _mm256_maddubs_epi16(lo[3], bcast32(qr + 12)));
      const __m256i s2 = _mm256_add_epi16(_mm256_maddubs_epi16(hi[0], bcast32(qr + 16)),
                                          _mm256_maddubs_epi16(hi[1], bcast32(qr + 20)));
      const __m256i s3 = _mm256_add_epi16(_mm256_maddubs_epi16(hi[2], bcast32(qr + 24)),
                                          _mm256_maddubs_epi16(hi[3], bcast32(qr + 28)));
      __m256i p = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_add_epi16(s0, s1), _mm256_add_epi16(s2, s3)), ones);
      if constexpr (!F::kMin) {
        p = _mm256_sub_epi32(p, _mm256_set1_epi32(xq.sum8[b * kMaxRows + r]));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                               _mm256_mul_ps(dw, _mm256_broadcast_ss(db + r)), acc[r]);
      if constexpr (F::kMin) {
        macc[r] =
            _mm256_fmadd_ps(mw, _mm256_broadcast_ss(xq.s.data() + b * kMaxRows + r), macc[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    fold_store(y, ldy, r, xq.out_m, F::kMin ? _mm256_add_ps(acc[r], macc[r]) : acc[r]);
  }
}

// Q8_0's integer dots of 8 rows' block (codes at c, stride rb) with x row qr's block: lane j =
// row j's dot. Signed codes: maddubs with |c| and sign(q, c) (|pair| <= 2 * 128 * 127 < 2^15),
// widened to int32 per product (two would overflow int16).
template <bool kTransposed>
struct Q8Group;

// Few rows of x: each row's 8 int32 lanes, reduced across the 8 rows by a hadd tree.
template <>
struct Q8Group<false> {
  __m256i c[8], a[8];
  inline void load(const uint8_t* cs, int64_t rb) {
    for (int j = 0; j < 8; ++j) {
      c[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cs + j * rb));
      a[j] = _mm256_sign_epi8(c[j], c[j]);
    }
  }
  inline __m256i dot(const int8_t* qr, __m256i ones) const {
    const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr));
    __m256i v[8];
    for (int j = 0; j < 8; ++j) {
      v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(a[j], _mm256_sign_epi8(qx, c[j])), ones);
    }
    const __m256i h0 =
        _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i h1 =
        _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    // h0 = [rows 0-3 over codes 0-15 | rows 0-3 over codes 16-31], h1 the same for rows 4-7
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                            _mm256_permute2x128_si256(h0, h1, 0x31));
  }
};

// More rows of x: the 8 rows' codes transposed once per block (vector g: dword g of row j in
// lane j), so each row of x needs no horizontal sums.
template <>
struct Q8Group<true> {
  __m256i c[8], a[8];
  inline void load(const uint8_t* cs, int64_t rb) {
    __m256i u[8];
    for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h+3
      const uint8_t* c0 = cs + 4 * h * rb;
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0 + rb));
      const __m256i r2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0 + 2 * rb));
      const __m256i r3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0 + 3 * rb));
      const __m256i t0 = _mm256_unpacklo_epi32(r0, r1), t1 = _mm256_unpackhi_epi32(r0, r1);
      const __m256i t2 = _mm256_unpacklo_epi32(r2, r3), t3 = _mm256_unpackhi_epi32(r2, r3);
      // u[4h + g] = [rows 4h..4h+3, dword g | the same rows, dword g + 4]
      u[4 * h + 0] = _mm256_unpacklo_epi64(t0, t2);
      u[4 * h + 1] = _mm256_unpackhi_epi64(t0, t2);
      u[4 * h + 2] = _mm256_unpacklo_epi64(t1, t3);
      u[4 * h + 3] = _mm256_unpackhi_epi64(t1, t3);
    }
    for (int g = 0; g < 4; ++g) {
      c[g] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x20);
      c[g + 4] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x31);
    }
    for (int g = 0; g < 8; ++g) a[g] = _mm256_sign_epi8(c[g], c[g]);
  }
  inline __m256i dot(const int8_t* qr, __m256i ones) const {
    __m256i v[8];
    for (int g = 0; g < 8; ++g) {
      v[g] = _mm256_madd_epi16(
          _mm256_maddubs_epi16(a[g], _mm256_sign_epi8(bcast32(qr + 4 * g), c[g])), ones);
    }
    return _mm256_add_epi32(
        _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])),
        _mm256_add_epi32(_mm256_add_epi32(v[4], v[5]), _mm256_add_epi32(v[6], v[7])));
  }
};

// Q8_0 for 8 output rows, as dot_group_nib (one conversion and FMA per block and x row).
template <int MR>
inline void dot_group_q8(const uint8_t* w, int64_t rb, const QuantizedRows& xq, int64_t k,
                         float* y, int64_t ldy) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  Q8Group<(MR >= kQ8TransposeRows)> codes;
  for (int64_t b = 0; b < xq.nb; ++b) {
    const uint8_t* blk = w + b * FmtQ8_0::kBytes;
    prefetch_next_group<FmtQ8_0>(w, rb, b);
    __m256 dw, mw;
    group_scales<FmtQ8_0>(blk, rb, dw, mw);
    codes.load(blk + 2, rb);
    const int8_t* qb = xq.q.data() + b * kQBlock;
    const float* db = xq.d.data() + b * kMaxRows;
    for (int r = 0; r < MR; ++r) {
      const __m256i p = codes.dot(qb + r * k, ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                               _mm256_mul_ps(dw, _mm256_broadcast_ss(db + r)), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) fold_store(y, ldy, r, xq.out_m, acc[r]);
}

template <class F, int MR>
void dot_range_m(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, int64_t k, float* y,
                 int64_t ldy, int64_t n0, int64_t n1) {
  int64_t n = n0;
  // Q8_0 at one row of x is DRAM-bound (a GGUF's lm_head): one row at a time, a plain sequential
  // stream, read faster than the groups' 8 interleaved ones (12-15% at 30 MB on the Zen 3 host);
  // also for one row of x as two terms (MR = 2, out_m = 1: SmolLM2's head in 8 alternating
  // processes, median 2.19 vs 2.30 ms, 6 of 8 pairs faster; a noisy host, a small gain)
  const bool groups = !(std::is_same_v<F, FmtQ8_0> && (MR == 1 || xq.out_m == 1));
  for (; groups && n + kGroup <= n1; n += kGroup) {
    if constexpr (std::is_same_v<F, FmtQ8_0>) {
      dot_group_q8<MR>(w + n * row_bytes, row_bytes, xq, k, y + n, ldy);
    } else {
      dot_group_nib<F, MR>(w + n * row_bytes, row_bytes, xq, k, y + n, ldy);
    }
  }
  for (; n < n1; ++n) dot_rows<F, MR>(w + n * row_bytes, xq, k, y + n, ldy);
}

template <class F>
void dot_range(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, int64_t k, float* y,
               int64_t ldy, int64_t n0, int64_t n1) {
  switch (xq.m) {
    case 1: dot_range_m<F, 1>(w, row_bytes, xq, k, y, ldy, n0, n1); break;
    case 2: dot_range_m<F, 2>(w, row_bytes, xq, k, y, ldy, n0, n1); break;
    case 3: dot_range_m<F, 3>(w, row_bytes, xq, k, y, ldy, n0, n1); break;
    case 4: dot_range_m<F, 4>(w, row_bytes, xq, k, y, ldy, n0, n1); break;
    case 5: dot_range_m<F, 5>(w, row_bytes, xq, k, y, ldy, n0, n1); break;
    case 6: dot_range_m<F, 6>(w, row_bytes, xq, k, y, ldy, n0, n1); break;
    case 7: dot_range_m<F, 7>(w, row_bytes, xq, k, y, ldy, n0, n1); break;
    default: dot_range_m<F, 8>(w, row_bytes, xq, k, y, ldy, n0, n1); break;
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
    for (int64_t r = 0; r < xq.m; ++r) fold_store(y + n, ldy, r, xq.out_m, acc[r]);
  }
}
#endif

template <class F>
void gemm_q8(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
             float* y, int64_t ldy, int64_t terms) {
  QuantizedRows xq;
  radixkv_qdot::quantize_rows(x, m, k, xq, terms);
  // runs of output rows in multiples of 8: whole groups of 8 rows (so which rows are grouped, and
  // so every output's summation order, does not depend on the thread count)
  const int64_t workers =
      radixkv_work::unit_workers(n, radixkv_qdot::kGroupRows, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t wk = w0; wk < w1; ++wk) {
      const auto [n0, n1] = radixkv_work::unit_rows(n, radixkv_qdot::kGroupRows, wk, workers);
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

namespace radixkv_qdot {

namespace {

// Block b of row r of x into row r of out (codes, d, s, sum8).
void quantize_block(const float* xb, int64_t r, int64_t b, int64_t k, QuantizedRows& out) {
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
  out.sum8[b * kMaxRows + r] = 8 * sum;
}

}  // namespace

void quantize_rows(const float* x, int64_t m, int64_t k, QuantizedRows& out, int64_t terms) {
  TORCH_CHECK((terms == 1 || terms == 2) && m * terms <= kMaxRows,
              "quantize_rows: 1 or 2 terms of at most ", kMaxRows, " rows in all, got ", m,
              " rows of ", terms);
  out.m = m * terms;
  out.out_m = m;
  out.nb = k / kQBlock;
  out.q.assign(out.m * k, 0);
  out.d.assign(out.nb * kMaxRows, 0.f);
  out.s.assign(out.nb * kMaxRows, 0.f);
  out.sum8.assign(out.nb * kMaxRows, 0);
  float res[kQBlock];
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < out.nb; ++b) {
      const float* xb = x + r * k + b * kQBlock;
      quantize_block(xb, r, b, k, out);
      if (terms == 1) continue;
      // the second term: what the first left, x - d q (|.| <= d / 2), quantized the same way
      const int8_t* qb = out.q.data() + r * k + b * kQBlock;
      const float d = out.d[b * kMaxRows + r];
      for (int64_t i = 0; i < kQBlock; ++i) res[i] = xb[i] - d * static_cast<float>(qb[i]);
      quantize_block(res, m + r, b, k, out);
    }
  }
}

bool is_dot_type(int64_t ggml_type) {
  return ggml_type == kQ4_0 || ggml_type == kQ4_1 || ggml_type == kQ8_0;
}

bool serves_rows(int64_t ggml_type, int64_t int8_rows, int64_t m, int64_t terms) {
  return is_dot_type(ggml_type) && m >= 1 &&
         m <= std::min(int8_rows, kMaxRows / std::max<int64_t>(terms, 1));
}

int64_t block_bytes(int64_t ggml_type) {
  int64_t bytes = 0;
  with_dot_format(ggml_type, [&](auto f, const char*) { bytes = decltype(f)::kBytes; });
  return bytes;
}

void dot_rows_range(int64_t ggml_type, const uint8_t* w, int64_t row_bytes,
                    const QuantizedRows& xq, int64_t k, float* y, int64_t ldy, int64_t n0,
                    int64_t n1) {
  with_dot_format(ggml_type, [&](auto f, const char*) {
    dot_range<decltype(f)>(w, row_bytes, xq, k, y, ldy, n0, n1);
  });
}

}  // namespace radixkv_qdot

std::vector<int64_t> quant_dot_types() { return {kQ4_0, kQ4_1, kQ8_0}; }

int64_t quant_dot_max_rows() { return kMaxRows; }

void quant_gemm_q8_into(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type,
                        const at::Tensor& out, int64_t terms) {
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
    TORCH_CHECK(terms == 1 || terms == 2, fn, ": terms is 1 (int8 activations) or 2 (two int8 "
                "terms), got ", terms);
    TORCH_CHECK(x.size(0) * terms <= kMaxRows, fn, ": at most ", kMaxRows / terms,
                " rows of x at ", terms, " term(s), got ", x.size(0), " (use quant_gemm_into)");
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
               out.data_ptr<float>(), out.stride(0), terms);
  });
}

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t ggml_type,
                        int64_t int8_rows, int64_t terms) {
  TORCH_CHECK(x_in.dim() == 2, "quant_linear: x must be 2-D rows [M, K], got ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0);
  if (!(x.scalar_type() == at::kFloat &&
        radixkv_qdot::serves_rows(ggml_type, int8_rows, m, terms))) {
    return quant_gemm(x, w, ggml_type);
  }
  at::Tensor out = at::empty({m, w.size(0)}, x.options());
  quant_gemm_q8_into(x, w, ggml_type, out, terms);
  return out;
}
