// y = x W^T with W in GGML's block-quantized formats (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), kept as the
// GGUF file's raw rows: weight-only quantization, float activations.
//
// Each block of a row is decoded to float32 weights in registers and multiplied with x in float32
// (no activation quantization). Every decoded weight equals GGML's dequantized value exactly: the
// products and sums that make one (fp16 scale x small integer, a 6-bit sub-scale times that, a
// minimum added) are exact in float32 before their one rounding, so an FMA-fused decode rounds to
// the same float32 as gguf-py's / ggml's two-step one. The only error beyond the weight format is
// therefore the float32 summation of the K products.
//
// Two paths:
// - up to kDecodeRows rows of x (a decode step): each weight row is read once, its blocks decoded
//   in registers (AVX2) and multiplied against all those rows of x, several float32
//   accumulators per row so the FMA chains overlap. Nibbles become floats without an
//   int-to-float conversion (a small integer's float32 is its bf16 bits shifted up 16: two byte
//   lookups and unpacks), which leaves a group's weights in a fixed permutation (nibble_order):
//   x's groups are permuted to match once per call. Workers own contiguous runs of output rows,
//   so each streams one contiguous stretch of the weight from DRAM.
// - more rows (a prefill chunk): a panel of 16 weight rows is decoded and packed k-major into a
//   float32 scratch (L1/L2-resident) and every row of x runs through it with a 6 x 16 register
//   tile of FMAs, as radixkv's float32 GEMM runs over its packed weight (AVX2 builds); the
//   portable build decodes kPanel rows into a row-major scratch and tiles dot products over it.
//
// Bytes of a block, per 32 weights: Q4_0 18, Q4_1 20, Q8_0 34, Q4_K 18, Q6_K 26.25.
//
// Measured (bench/bench_quant_gemm.py, AMD EPYC Zen 3, AVX2, 2 threads, SmolLM2-135M's linears,
// weights streamed from DRAM, medians; 2026-12-07): a forward's linears (30 layers + lm_head)
// take, Q4_1 layers with the Q8_0 head of SmolLM2's Q4_1 file vs radixkv's float32 GEMM vs
// F.linear: 1 row 7.4 / 18.7 / 33.8 ms, 4 rows 12.5 / 17.2 / 70.4 (with the fp16 table); before
// it, 8 rows 24.1 / 23.3 / 67.8, 64 rows 110 / 102 / 182. At 1 row the decode runs at 12 GB/s of
// Q4_1 (19 G weights/s) and 21 GB/s of Q8_0, below the host's streaming rate (f32_gemm reads
// 26-32 GB/s): the decode's instructions, not DRAM, bound it.

#include "cpu_quant_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "cpu_vec.h"
#include "cpu_work.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXKV_QUANT_AVX2 1
#else
#define RADIXKV_QUANT_AVX2 0
#endif

namespace {

enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

// Rows of x up to which the register-decode path runs (AVX2 builds); the panel path above.
constexpr int64_t kDecodeRows = 8;  // 5-8 rows: two decodes a block, 0.7-0.8x the panel's time
// Weight rows decoded into the scratch per panel (a multiple of the panel tile's kNr).
constexpr int64_t kPanel = 12;

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline float fp16(const uint8_t* p) {
#if RADIXKV_QUANT_AVX2
  return _cvtsh_ss(load_u16(p));
#else
  return c10::detail::fp16_ieee_to_fp32_value(load_u16(p));
#endif
}

#if RADIXKV_QUANT_AVX2
// Every fp16's float32 (256 KB, filled once by init_half_table before the first kernel runs):
// the 32-blocks' decode turns its scales into vectors with a table load and a broadcast load,
// which leaves the vector pipes to the shuffles and FMAs (M=1 on Q4_1: 9.0 -> 8.0 cycles a
// block, Zen 3); a matrix's scales touch few of the table's lines.
float g_half[65536];
void init_half_table() {
  static const bool done = [] {
    for (uint32_t h = 0; h < 65536; ++h) g_half[h] = fp16(reinterpret_cast<const uint8_t*>(&h));
    return true;
  }();
  (void)done;
}
inline __m256 fp16_splat(const uint8_t* p) { return _mm256_broadcast_ss(g_half + load_u16(p)); }
#endif

// Q4_K's 8 six-bit sub-block scales and minimums from its 12 packed bytes (ggml's
// get_scale_min_k4).
inline void k4_scale_min(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// 32 decoded weights of a group: four 8-float vectors on AVX2, an array otherwise. The nibble
// formats' AVX2 decode yields them in kNibbleOrder (below), the others in order.
#if RADIXKV_QUANT_AVX2
struct Group {
  __m256 v[4];
};
// Lane p of the nibble decode's vectors (v[p / 8][p % 8]) holds weight kNibbleOrder[p] of the
// group: each 128-bit half of v[j] holds 4 consecutive weights, 4 j (low half) and 16 + 4 j
// (high half), the order in-lane unpacks leave them in.
inline int64_t nibble_order(int64_t p) { return 4 * (p / 8) + p % 4 + 16 * (p % 8 / 4); }
template <bool Nibbles>
inline void store_group(float* dst, const Group& g) {
  for (int j = 0; j < 4; ++j) {
    if (Nibbles) {
      _mm_storeu_ps(dst + 4 * j, _mm256_castps256_ps128(g.v[j]));
      _mm_storeu_ps(dst + 16 + 4 * j, _mm256_extractf128_ps(g.v[j], 1));
    } else {
      _mm256_storeu_ps(dst + 8 * j, g.v[j]);
    }
  }
}
// 8 bytes (the low half of v) widened to floats.
inline __m256 cvt_i8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
// 16 signed bytes -> two vectors of a group, scaled (d q exact, one rounding).
inline void widen16(__m128i b, __m256 d, __m256* v) {
  v[0] = _mm256_mul_ps(cvt_i8(b), d);
  v[1] = _mm256_mul_ps(cvt_i8(_mm_unpackhi_epi64(b, b)), d);
}
// 32 nibbles q (one a byte; lane 0 weights 0-15, lane 1 weights 16-31) -> d q + m in kNibbleOrder.
// A small integer's float32 has its low 16 bits zero, so float(q) is its bf16 bits (two byte
// lookups) shifted up 16: four shuffles and an unpack per 8 weights, no int-to-float conversion.
inline void nibbles_fma(__m256i q, __m256 d, __m256 m, __m256* v) {
  // bf16 bits of 0.0, 1.0, ..., 15.0: low bytes, high bytes (each 128-bit lane looks up its own)
  const __m256i lut_lo = _mm256_setr_epi8(0, -128, 0, 64, -128, -96, -64, -32, 0, 16, 32, 48, 64,
                                          80, 96, 112, 0, -128, 0, 64, -128, -96, -64, -32, 0, 16,
                                          32, 48, 64, 80, 96, 112);
  const __m256i lut_hi = _mm256_setr_epi8(0, 63, 64, 64, 64, 64, 64, 64, 65, 65, 65, 65, 65, 65,
                                          65, 65, 0, 63, 64, 64, 64, 64, 64, 64, 65, 65, 65, 65,
                                          65, 65, 65, 65);
  const __m256i lo = _mm256_shuffle_epi8(lut_lo, q), hi = _mm256_shuffle_epi8(lut_hi, q);
  const __m256i p0 = _mm256_unpacklo_epi8(lo, hi), p1 = _mm256_unpackhi_epi8(lo, hi);
  const __m256i z = _mm256_setzero_si256();
  v[0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, p0)), d, m);
  v[1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, p0)), d, m);
  v[2] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, p1)), d, m);
  v[3] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, p1)), d, m);
}
#else
struct Group {
  float v[32];
};
inline int64_t nibble_order(int64_t p) { return p; }
template <bool Nibbles>
inline void store_group(float* dst, const Group& g) {
  std::memcpy(dst, g.v, sizeof(g.v));
}
#endif

// Each format: kBlock weights in kBytes bytes; groups(block, f) calls f(g, group) for its
// kBlock / 32 groups of 32 weights in order.
// Q4_0 (fp16 d, 16 bytes of nibbles; w = d (q - 8)) and Q4_1 (fp16 d, fp16 m, 16 bytes of
// nibbles; w = d q + m): weight i < 16 is byte i's low nibble, weight 16 + i its high one. Both
// decode as d q + m, with m = -8 d for Q4_0 (d q - 8 d is d (q - 8) exactly), one rounding of an
// exact value, as GGML's (d q is exact).
template <bool HasMin>
struct Nibbles32 {
  static constexpr int64_t kBlock = 32, kBytes = HasMin ? 20 : 18;
  static constexpr const char* kName = HasMin ? "Q4_1" : "Q4_0";
  static constexpr bool kNibbles = true;
  template <class F>
  static void groups(const uint8_t* b, F&& f) {
    const uint8_t* qs = b + (HasMin ? 4 : 2);
    Group g;
#if RADIXKV_QUANT_AVX2
    const __m256 d = fp16_splat(b);
    const __m256 m = HasMin ? fp16_splat(b + 2) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4),
                                         _mm_and_si128(q, m4));
    nibbles_fma(nib, d, m, g.v);
#else
    const float d = fp16(b), m = HasMin ? fp16(b + 2) : -8.f * d;
    for (int i = 0; i < 16; ++i) {
      g.v[i] = d * static_cast<float>(qs[i] & 0xF) + m;
      g.v[i + 16] = d * static_cast<float>(qs[i] >> 4) + m;
    }
#endif
    f(0, g);
  }
};
using Q4_0 = Nibbles32<false>;
using Q4_1 = Nibbles32<true>;

struct Q8_0 {
  static constexpr int64_t kBlock = 32, kBytes = 34;
  static constexpr const char* kName = "Q8_0";
  static constexpr bool kNibbles = false;
  template <class F>
  static void groups(const uint8_t* b, F&& f) {
    Group g;
#if RADIXKV_QUANT_AVX2
    const __m256 d = fp16_splat(b);
    widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), d, g.v);
    widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)), d, g.v + 2);
#else
    const float d = fp16(b);
    for (int i = 0; i < 32; ++i) g.v[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
#endif
    f(0, g);
  }
};

// 256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/minimums, 128 bytes of nibbles; group
// g (sub-block) is w = d sc[g] q - dmin mn[g], its nibbles the low (g even) or high (g odd) halves
// of bytes [32 (g / 2), 32 (g / 2) + 32).
struct Q4_K {
  static constexpr int64_t kBlock = 256, kBytes = 144;
  static constexpr const char* kName = "Q4_K";
  static constexpr bool kNibbles = true;
  template <class F>
  static void groups(const uint8_t* b, F&& f) {
    const float d = fp16(b), dmin = fp16(b + 2);
    uint8_t sc[8], mn[8];
    k4_scale_min(b + 4, sc, mn);
    const uint8_t* qs = b + 16;
    Group g;
    for (int j = 0; j < 4; ++j) {
#if RADIXKV_QUANT_AVX2
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      const __m256i m4 = _mm256_set1_epi8(0x0F);
      const __m256i nib[2] = {_mm256_and_si256(q, m4),
                              _mm256_and_si256(_mm256_srli_epi16(q, 4), m4)};
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * j + h;
        const __m256 ds = _mm256_set1_ps(d * static_cast<float>(sc[s]));
        const __m256 ms = _mm256_set1_ps(-(dmin * static_cast<float>(mn[s])));
        nibbles_fma(nib[h], ds, ms, g.v);
        f(s, g);
      }
#else
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * j + h;
        const float ds = d * static_cast<float>(sc[s]), ms = dmin * static_cast<float>(mn[s]);
        for (int i = 0; i < 32; ++i) {
          g.v[i] = ds * static_cast<float>((qs[32 * j + i] >> (4 * h)) & 0xF) - ms;
        }
        f(s, g);
      }
#endif
    }
  }
};

// 256 weights: 128 bytes of low nibbles ql, 64 bytes of 2-bit highs qh, 16 int8 scales, fp16 d.
// Half h (128 weights) reads ql[64 h, +64), qh[32 h, +32); its band i (32 weights, group 4 h + i)
// is q = (low nibble (i < 2) or high nibble (i >= 2) of ql[64 h + 32 (i % 2) + l]) | (bits
// 2i, 2i + 1 of qh[32 h + l]) << 4, minus 32, l in [0, 32), scaled by d sc[8 h + 2 i + l / 16].
struct Q6_K {
  static constexpr int64_t kBlock = 256, kBytes = 210;
  static constexpr const char* kName = "Q6_K";
  static constexpr bool kNibbles = false;
  template <class F>
  static void groups(const uint8_t* b, F&& f) {
    const float d = fp16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    Group g;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
#if RADIXKV_QUANT_AVX2
      const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
      for (int i = 0; i < 4; ++i) {
        const __m256i src = (i & 1) ? l1 : l0;
        const __m256i lo = _mm256_and_si256(i < 2 ? src : _mm256_srli_epi16(src, 4), m4);
        const __m256i hi =
            _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * i)), m3);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)),
                                          _mm256_set1_epi8(32));
        const __m256 da = _mm256_set1_ps(d * static_cast<float>(sc[8 * h + 2 * i]));
        const __m256 db = _mm256_set1_ps(d * static_cast<float>(sc[8 * h + 2 * i + 1]));
        widen16(_mm256_castsi256_si128(q), da, g.v);
        widen16(_mm256_extracti128_si256(q, 1), db, g.v + 2);
        f(4 * h + i, g);
      }
#else
      for (int i = 0; i < 4; ++i) {
        for (int l = 0; l < 32; ++l) {
          const int lo = (ql[32 * (i & 1) + l] >> (i < 2 ? 0 : 4)) & 0xF;
          const int hi = (qh[l] >> (2 * i)) & 3;
          const float ds = d * static_cast<float>(sc[8 * h + 2 * i + l / 16]);
          g.v[l] = ds * static_cast<float>((lo | (hi << 4)) - 32);
        }
        f(4 * h + i, g);
      }
#endif
    }
  }
};

// Row w (nb blocks of Q) decoded into dst [nb * Q::kBlock] float32.
template <class Q>
inline void decode_row(const uint8_t* w, int64_t nb, float* dst) {
  for (int64_t b = 0; b < nb; ++b) {
    Q::groups(w + b * Q::kBytes,
              [&](int g, const Group& grp) { store_group<Q::kNibbles>(dst + b * Q::kBlock + 32 * g, grp); });
  }
}

// Where results go: y[r * ldy + n] (float32 or bf16, rounded once from the float32 sum).
template <class Out>
inline void put(Out* y, float v) {
  *y = static_cast<Out>(v);
}

#if RADIXKV_QUANT_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [0, MR) of x (row stride ldx) times weight row w (nb blocks), decoded in registers once;
// y[r * ldy] gets row r's sum. NA accumulators per row (4 for one or two rows, so the FMA chains
// of a decode overlap; 2 with more rows, within the 16 registers).
template <class Q, int MR, class Out>
inline void decode_dot(const uint8_t* w, int64_t nb, const float* x, int64_t ldx, Out* y,
                       int64_t ldy) {
  constexpr int NA = MR <= 2 ? 4 : 2;
  __m256 acc[MR][NA];
  for (int r = 0; r < MR; ++r)
    for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // the row's blocks a few lines ahead (hardware prefetch follows too, but starts late on
    // each worker's fresh stretch)
    _mm_prefetch(reinterpret_cast<const char*>(w + b * Q::kBytes) + 512, _MM_HINT_T0);
    Q::groups(w + b * Q::kBytes, [&](int g, const Group& grp) {
      const float* xb = x + b * Q::kBlock + 32 * g;
      for (int r = 0; r < MR; ++r) {
        for (int j = 0; j < 4; ++j) {
          acc[r][j % NA] =
              _mm256_fmadd_ps(_mm256_loadu_ps(xb + r * ldx + 8 * j), grp.v[j], acc[r][j % NA]);
        }
      }
    });
  }
  for (int r = 0; r < MR; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[r][a]);
    put(y + r * ldy, hsum(s));
  }
}

// Output rows [n0, n1) for all m (<= kDecodeRows) rows of x, four rows of x per decode.
template <class Q, class Out>
void decode_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x, int64_t m,
                 int64_t k, Out* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
      const float* xr = x + r0 * k;
      Out* yr = y + r0 * ldy + n;
      switch (std::min<int64_t>(4, m - r0)) {
        case 1: decode_dot<Q, 1>(wr, nb, xr, k, yr, ldy); break;
        case 2: decode_dot<Q, 2>(wr, nb, xr, k, yr, ldy); break;
        case 3: decode_dot<Q, 3>(wr, nb, xr, k, yr, ldy); break;
        default: decode_dot<Q, 4>(wr, nb, xr, k, yr, ldy); break;
      }
    }
  }
}
#endif

#if !RADIXKV_QUANT_AVX2
// The panel path's register tile: MR rows of x by NR decoded weight rows (wf, row stride k),
// dot products over k (a multiple of 32) in vectors of the build's width.
constexpr int kMr = 4, kNr = 3;
template <int MR, int NR, class Out>
inline void panel_tile(const float* x, int64_t k, const float* wf, Out* y, int64_t ldy) {
  using radixkv_vec::vf;
  vf acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NR; ++q) acc[r][q] = vf{};
  for (int64_t kk = 0; kk < k; kk += radixkv_vec::VW) {
    vf wv[NR];
    for (int q = 0; q < NR; ++q) wv[q] = radixkv_vec::loadv(wf + q * k + kk);
    for (int r = 0; r < MR; ++r) {
      const vf xv = radixkv_vec::loadv(x + r * k + kk);
      for (int q = 0; q < NR; ++q) acc[r][q] += xv * wv[q];
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int q = 0; q < NR; ++q) {
      float s = 0.f;
      for (int i = 0; i < radixkv_vec::VW; ++i) s += acc[r][q][i];
      put(y + r * ldy + q, s);
    }
  }
}

template <int NR, class Out, int MR = kMr>
inline void panel_rows(int64_t rows, const float* x, int64_t k, const float* wf, Out* y,
                       int64_t ldy) {
  if constexpr (MR > 0) {
    if (rows == MR) return panel_tile<MR, NR>(x, k, wf, y, ldy);
    panel_rows<NR, Out, MR - 1>(rows, x, k, wf, y, ldy);
  }
}

// Output rows [n0, n1) for all m rows of x: kPanel weight rows at a time decoded into scratch
// [kPanel, k], then each tile of kMr rows of x against the panel's rows, kNr at a time.
template <class Q, class Out>
void panel_rows_range(const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x, int64_t m,
                      int64_t k, Out* y, int64_t ldy, int64_t n0, int64_t n1, float* scratch) {
  for (int64_t p0 = n0; p0 < n1; p0 += kPanel) {
    const int64_t p = std::min(kPanel, n1 - p0);
    for (int64_t i = 0; i < p; ++i) decode_row<Q>(w + (p0 + i) * row_bytes, nb, scratch + i * k);
    for (int64_t r0 = 0; r0 < m; r0 += kMr) {
      const int64_t rows = std::min<int64_t>(kMr, m - r0);
      for (int64_t q0 = 0; q0 < p; q0 += kNr) {
        const float* wf = scratch + q0 * k;
        Out* yt = y + r0 * ldy + p0 + q0;
        const float* xt = x + r0 * k;
        switch (std::min<int64_t>(kNr, p - q0)) {
          case 1: panel_rows<1>(rows, xt, k, wf, yt, ldy); break;
          case 2: panel_rows<2>(rows, xt, k, wf, yt, ldy); break;
          default: panel_rows<3>(rows, xt, k, wf, yt, ldy); break;
        }
      }
    }
  }
}

#endif

#if RADIXKV_QUANT_AVX2
// The AVX2 builds' panel: kPackCols weight rows decoded, then packed k-major (packed[kk * 16 +
// i] = Wdeq[row i, kk]) so a kPackMr x 2 register tile of FMAs runs over it as radixkv's float32
// GEMM does over its packed weight: per k, two weight vectors, one broadcast of x per row.
constexpr int64_t kPackCols = 16;
constexpr int kPackMr = 6;

// The 8 x 8 floats r[0..7] (rows) transposed in place (r[j] becomes column j).
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Weight rows [p0, p0 + p) (p <= kPackCols) decoded into rows [kPackCols, k] (rows past p
// zero), then packed into packed [k, kPackCols].
template <class Q>
void pack_panel(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t p0, int64_t p,
                float* rows, float* packed) {
  for (int64_t i = 0; i < kPackCols; ++i) {
    if (i < p) decode_row<Q>(w + (p0 + i) * row_bytes, k / Q::kBlock, rows + i * k);
    else std::memset(rows + i * k, 0, k * sizeof(float));
  }
  for (int64_t h = 0; h < kPackCols / 8; ++h) {
    for (int64_t kk = 0; kk < k; kk += 8) {
      __m256 t[8];
      for (int c = 0; c < 8; ++c) t[c] = _mm256_loadu_ps(rows + (8 * h + c) * k + kk);
      transpose8(t);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(packed + (kk + j) * kPackCols + 8 * h, t[j]);
    }
  }
}

// MR rows of x times the packed panel into c [MR, kPackCols].
template <int MR>
inline void packed_tile(const float* x, int64_t k, const float* packed, float* c) {
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < 2; ++q) acc[r][q] = _mm256_setzero_ps();
  // k >= 32: a do-while (with a loop that may run zero times GCC kept the accumulators in
  // memory as well, a store after every FMA)
  int64_t kk = 0;
  do {
    const __m256 b0 = _mm256_loadu_ps(packed + kk * kPackCols);
    const __m256 b1 = _mm256_loadu_ps(packed + kk * kPackCols + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * k + kk);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  } while (++kk < k);
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < 2; ++q) _mm256_storeu_ps(c + r * kPackCols + 8 * q, acc[r][q]);
}

template <int MR = kPackMr>
inline void packed_rows(int64_t rows, const float* x, int64_t k, const float* packed, float* c) {
  if constexpr (MR > 0) {
    if (rows == MR) return packed_tile<MR>(x, k, packed, c);
    packed_rows<MR - 1>(rows, x, k, packed, c);
  }
}

// Output rows [n0, n1) for all m rows of x, kPackCols weight rows per packed panel; scratch
// holds 2 kPackCols k floats.
template <class Q, class Out>
void packed_rows_range(const uint8_t* w, int64_t row_bytes, const float* x, int64_t m, int64_t k,
                       Out* y, int64_t ldy, int64_t n0, int64_t n1, float* scratch) {
  float* packed = scratch + kPackCols * k;
  for (int64_t p0 = n0; p0 < n1; p0 += kPackCols) {
    const int64_t p = std::min(kPackCols, n1 - p0);
    pack_panel<Q>(w, row_bytes, k, p0, p, scratch, packed);
    for (int64_t r0 = 0; r0 < m; r0 += kPackMr) {
      const int64_t rows = std::min<int64_t>(kPackMr, m - r0);
      alignas(32) float c[kPackMr * kPackCols];
      packed_rows(rows, x + r0 * k, k, packed, c);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < p; ++i) put(y + (r0 + r) * ldy + p0 + i, c[r * kPackCols + i]);
      }
    }
  }
}
#endif

// A worker's panel scratch, in floats per input.
#if RADIXKV_QUANT_AVX2
constexpr int64_t kPanelScratch = 2 * kPackCols;
#else
constexpr int64_t kPanelScratch = kPanel;
#endif

// x as the decode path reads it: a nibble format's groups in kNibbleOrder (into `reordered`),
// else x itself.
template <class Q>
const float* decode_input(const float* x, int64_t m, int64_t k, std::vector<float>& reordered) {
  if constexpr (Q::kNibbles && RADIXKV_QUANT_AVX2) {
    reordered.resize(m * k);
    for (int64_t i = 0; i < m * k; i += 32) {
      for (int64_t p = 0; p < 32; ++p) reordered[i + p] = x[i + nibble_order(p)];
    }
    return reordered.data();
  }
  return x;
}

// y [m, >= n] (row stride ldy) = x [m, k] float32 times the n rows of w, workers over contiguous
// runs of output rows.
template <class Q, class Out>
void gemm(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
          Out* y, int64_t ldy) {
  const int64_t nb = k / Q::kBlock;
  const bool decode = RADIXKV_QUANT_AVX2 && m <= kDecodeRows;
  const int64_t workers = radixkv_work::unit_workers(n, radixkv_qlin::kRowUnit,
                                                     at::get_num_threads());
  // the decode path multiplies a nibble format's groups in kNibbleOrder: x's groups reordered
  // to match, once per call
  std::vector<float> reordered;
  const float* xd = decode ? decode_input<Q>(x, m, k, reordered) : x;
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scratch(decode ? 0 : kPanelScratch * k);
    for (int64_t wk = w0; wk < w1; ++wk) {
      const auto [n0, n1] = radixkv_work::unit_rows(n, radixkv_qlin::kRowUnit, wk, workers);
#if RADIXKV_QUANT_AVX2
      if (decode) {
        decode_rows<Q>(w, row_bytes, nb, xd, m, k, y, ldy, n0, n1);
      } else {
        packed_rows_range<Q>(w, row_bytes, x, m, k, y, ldy, n0, n1, scratch.data());
      }
#else
      (void)xd;  // the portable build has no decode path
      panel_rows_range<Q>(w, row_bytes, nb, x, m, k, y, ldy, n0, n1, scratch.data());
#endif
    }
  });
}

// f(Q{}) for the format of a GGML type id; raises on others.
template <class F>
auto with_format(int64_t ggml_type, const char* fn, F&& f) {
  switch (ggml_type) {
    case kQ4_0: return f(Q4_0{});
    case kQ4_1: return f(Q4_1{});
    case kQ8_0: return f(Q8_0{});
    case kQ4_K: return f(Q4_K{});
    case kQ6_K: return f(Q6_K{});
    default:
      TORCH_CHECK(false, fn, ": GGML type ", ggml_type,
                  " is not supported (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 are)");
      __builtin_unreachable();
  }
}

// The number of inputs K of w's rows in format Q, after checking w's shape and dtype.
template <class Q>
int64_t check_weight(const at::Tensor& w, const char* fn) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte, fn,
              ": w must be a 2-D uint8 tensor of raw GGML rows [N, row_bytes], got ",
              w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(w.is_contiguous(), fn, ": w must be contiguous");
  TORCH_CHECK(w.size(1) % Q::kBytes == 0, fn, ": a ", Q::kName, " row is whole blocks of ",
              Q::kBytes, " bytes, but w's rows have ", w.size(1), " bytes");
  return w.size(1) / Q::kBytes * Q::kBlock;
}

}  // namespace

namespace radixkv_qlin {

int64_t decode_rows_max() { return RADIXKV_QUANT_AVX2 ? kDecodeRows : 0; }

const float* decode_input(int64_t ggml_type, const float* x, int64_t m, int64_t k,
                          std::vector<float>& scratch) {
#if RADIXKV_QUANT_AVX2
  init_half_table();
  return with_format(ggml_type, "quant decode_input",
                     [&](auto q) { return ::decode_input<decltype(q)>(x, m, k, scratch); });
#else
  (void)ggml_type, (void)m, (void)k, (void)scratch;
  return x;
#endif
}

void decode_rows_range(int64_t ggml_type, const uint8_t* w, int64_t row_bytes, const float* xd,
                       int64_t m, int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1) {
#if RADIXKV_QUANT_AVX2
  with_format(ggml_type, "quant decode_rows_range", [&](auto q) {
    using Q = decltype(q);
    decode_rows<Q>(w, row_bytes, k / Q::kBlock, xd, m, k, y, ldy, n0, n1);
  });
#else
  (void)ggml_type, (void)w, (void)row_bytes, (void)xd, (void)m, (void)k, (void)y, (void)ldy;
  (void)n0, (void)n1;
  TORCH_CHECK(false, "quant decode_rows_range: this build has no decode path");
#endif
}

int64_t row_bytes_of(int64_t ggml_type, int64_t k) {
  return with_format(ggml_type, "quant row_bytes_of",
                     [&](auto q) { return k / decltype(q)::kBlock * decltype(q)::kBytes; });
}

}  // namespace radixkv_qlin

std::vector<int64_t> quant_gemm_types() { return {kQ4_0, kQ4_1, kQ8_0, kQ4_K, kQ6_K}; }

void quant_gemm_into(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type,
                     const at::Tensor& out) {
  static constexpr const char* fn = "quant_gemm_into";
  with_format(ggml_type, fn, [&](auto q) {
    using Q = decltype(q);
    const int64_t k = check_weight<Q>(w, fn);
    TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                fn, ": x must be 2-D float32 or bfloat16 rows [M, K], got ", x.scalar_type(), " ",
                x.sizes());
    TORCH_CHECK(x.size(1) % Q::kBlock == 0, fn, ": K = ", x.size(1),
                " is not a multiple of ", Q::kName, "'s block size ", Q::kBlock);
    TORCH_CHECK(x.size(1) == k, fn, ": x has K = ", x.size(1), " inputs, but w's rows of ",
                w.size(1), " bytes hold ", k, " ", Q::kName, " weights (row_bytes must be K / ",
                Q::kBlock, " * ", Q::kBytes, " = ", x.size(1) / Q::kBlock * Q::kBytes, ")");
    const int64_t m = x.size(0), n = w.size(0);
    TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) >= n, fn,
                ": out must be [M, >= N] = [", m, ", >= ", n, "], got ", out.sizes());
    TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == x.scalar_type(), fn,
                ": out must be float32 or x's dtype (", x.scalar_type(), "), got ",
                out.scalar_type());
    TORCH_CHECK(out.stride(1) == 1 || out.size(1) <= 1, fn,
                ": out's last stride must be 1, got ", out.strides());
    if (m == 0 || n == 0) return;
#if RADIXKV_QUANT_AVX2
    init_half_table();
#endif
    const at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat);
    const float* xp = xf.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const int64_t ldy = out.stride(0);
    if (out.scalar_type() == at::kFloat) {
      gemm<Q>(xp, m, k, wp, n, w.size(1), out.data_ptr<float>(), ldy);
    } else {
      gemm<Q>(xp, m, k, wp, n, w.size(1), out.data_ptr<c10::BFloat16>(), ldy);
    }
  });
}

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "quant_gemm: x and w must be 2-D, got ", x.sizes(),
              " and ", w.sizes());
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  quant_gemm_into(x, w, ggml_type, out);
  return out;
}

at::Tensor quant_dequantize_rows(const at::Tensor& w, int64_t ggml_type, const at::Tensor& ids_in,
                                 at::ScalarType dtype) {
  static constexpr const char* fn = "quant_dequantize_rows";
  return with_format(ggml_type, fn, [&](auto q) {
    using Q = decltype(q);
    const int64_t k = check_weight<Q>(w, fn);
    TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, fn,
                ": ids must be a 1-D int64 tensor, got ", ids_in.scalar_type(), " ",
                ids_in.sizes());
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, fn,
                ": dtype must be float32, bfloat16 or float16, got ", dtype);
    const at::Tensor ids = ids_in.contiguous();
    const int64_t t = ids.size(0), n = w.size(0);
    const int64_t* idp = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i) {
      TORCH_CHECK(idp[i] >= 0 && idp[i] < n, fn, ": ids[", i, "] = ", idp[i],
                  " is out of range for ", n, " rows");
    }
#if RADIXKV_QUANT_AVX2
    init_half_table();
#endif
    at::Tensor out = at::empty({t, k}, w.options().dtype(at::kFloat));
    float* op = out.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    at::parallel_for(0, t, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        decode_row<Q>(wp + idp[i] * w.size(1), k / Q::kBlock, op + i * k);
      }
    });
    return dtype == at::kFloat ? out : out.to(dtype);
  });
}
