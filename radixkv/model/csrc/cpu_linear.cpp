// y = x W^T on the CPU with W packed once at load: bf16 on AVX512-BF16 builds, float32 on AVX2
// and AVX-512 builds.
//
// The packed weight holds kCols output columns by every k-step of the inputs per block: one
// k-step is a pair of bf16 inputs (the operand of `vdpbf16ps`) or one float32 input, and a
// block's k-step is one vector load of kCols columns ([n / kCols][k-step][n % kCols]). A worker
// owns chunks of kNr column blocks; for each chunk it runs every row of x through a kMr x kNr
// register tile of float32 accumulators, one broadcast of x per row and k-step, so each weight
// line is read from DRAM once a call and from L2 for the chunk's other row tiles, and it
// prefetches the next chunk's weights into L2 while it computes (a decode step streams every
// weight once, cold). bf16 results are rounded once, at the end. Each output's sum runs over k in
// order, so results do not depend on the thread count.
//
// Against oneDNN's prepacked GEMM (torch.ops.mkldnn._linear_pointwise) on SmolLM2-135M's
// linears, weights streamed, Zen 4 (docs/performance.md): bf16 406 vs 341 GFLOP/s at 64 rows,
// level at 1,024-2,048; float32 with both held to AVX2, 208 vs 163 at 64 rows.

#include "cpu_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define RADIXKV_BF16_GEMM 1
#else
#define RADIXKV_BF16_GEMM 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define RADIXKV_F32_GEMM 1
#else
#define RADIXKV_F32_GEMM 0
#endif

namespace {

// bf16 blocks: 16 output columns by one pair of inputs (a k-step) per 64-byte line.
constexpr int kBf16Cols = 16, kBf16Step = 2;

#if RADIXKV_BF16_GEMM
// bf16 rows, bf16 weights: a k-step is a pair of inputs, packed as one int32.
struct Bf16Gemm {
  using Elem = int32_t;
  using Out = uint16_t;
  using Acc = __m512;
  using B = __m512i;
  static constexpr int kCols = kBf16Cols, kMr = 8, kNr = 3;
  static Acc zero() { return _mm512_setzero_ps(); }
  static B load(const Elem* p) { return _mm512_loadu_si512(p); }
  static Acc fma(Acc acc, Elem a, B b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(a), (__m512bh)b);
  }
  static void store(Out* c, Acc acc) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), (__m256i)_mm512_cvtneps_pbh(acc));
  }
};
#endif

#if RADIXKV_F32_GEMM
// float32 rows and weights, in vectors of the build's width (16 on AVX-512, 8 on AVX2, whose
// 16 registers take a 6 x 2 tile).
struct F32Gemm {
  using Elem = float;
  using Out = float;
  using Acc = radixkv_vec::vf;
  using B = radixkv_vec::vf;
  static constexpr int kCols = radixkv_vec::VW;
  static constexpr int kMr = kCols == 16 ? 8 : 6, kNr = kCols == 16 ? 3 : 2;
  static Acc zero() { return Acc{}; }
  static B load(const Elem* p) { return radixkv_vec::loadv(p); }
  static Acc fma(Acc acc, Elem a, B b) { return acc + radixkv_vec::splat(a) * b; }
  static void store(Out* c, Acc acc) { std::memcpy(c, &acc, sizeof(acc)); }
};
#endif

// One register tile: rows [0, MR) of a (row stride lda k-steps) times NR packed blocks of b
// (block stride bs elements) over ks k-steps; c gets the results (row stride ldc). Prefetches
// `per_step` lines of pf[0, pf_lines) into L2 per k-step.
template <class G, int MR, int NR>
inline void tile(const typename G::Elem* a, int64_t lda, const typename G::Elem* b, int64_t bs,
                 int64_t ks, typename G::Out* c, int64_t ldc, const char* pf, int64_t pf_lines,
                 int64_t per_step) {
  typename G::Acc acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NR; ++q) acc[r][q] = G::zero();
  for (int64_t k = 0; k < ks; ++k) {
    for (int64_t l = k * per_step; l < std::min(pf_lines, (k + 1) * per_step); ++l) {
      __builtin_prefetch(pf + l * 64, 0, 2);  // into L2 (prefetcht1)
    }
    typename G::B bv[NR];
    for (int q = 0; q < NR; ++q) bv[q] = G::load(b + q * bs + k * G::kCols);
    for (int r = 0; r < MR; ++r) {
      const typename G::Elem av = a[r * lda + k];
      for (int q = 0; q < NR; ++q) acc[r][q] = G::fma(acc[r][q], av, bv[q]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NR; ++q) G::store(c + r * ldc + q * G::kCols, acc[r][q]);
}

// `rows` (1 .. MR) rows through the tile of that height.
template <class G, int NR, int MR = G::kMr>
inline void tile_rows(int64_t rows, const typename G::Elem* a, int64_t lda,
                      const typename G::Elem* b, int64_t bs, int64_t ks, typename G::Out* c,
                      int64_t ldc, const char* pf, int64_t pf_lines, int64_t per_step) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<G, MR, NR>(a, lda, b, bs, ks, c, ldc, pf, pf_lines, per_step);
    tile_rows<G, NR, MR - 1>(rows, a, lda, b, bs, ks, c, ldc, pf, pf_lines, per_step);
  }
}

// Every row of x [m, ks] through column blocks [nb0, nb0 + NR) of w into y [m, n], prefetching
// pf_lines lines from `next` (the worker's next chunk) spread over the row tiles.
template <class G, int NR>
void chunk(const typename G::Elem* x, int64_t m, int64_t ks, const typename G::Elem* w,
           int64_t nb0, typename G::Out* y, int64_t n, const char* next, int64_t pf_lines) {
  const int64_t bs = ks * G::kCols;
  const int64_t steps = (m + G::kMr - 1) / G::kMr * ks;
  const int64_t per_step = (pf_lines + steps - 1) / std::max<int64_t>(1, steps);
  for (int64_t r0 = 0, done = 0; r0 < m; r0 += G::kMr, done += ks * per_step) {
    tile_rows<G, NR>(std::min<int64_t>(G::kMr, m - r0), x + r0 * ks, ks, w + nb0 * bs, bs, ks,
                     y + r0 * n + nb0 * G::kCols, n, next + done * 64,
                     std::max<int64_t>(0, pf_lines - done), per_step);
  }
}

template <class G>
void gemm(const typename G::Elem* x, int64_t m, int64_t ks, const typename G::Elem* w,
          int64_t nblocks, typename G::Out* y) {
  const int64_t n = nblocks * G::kCols, bs = ks * G::kCols;
  const int64_t chunks = (nblocks + G::kNr - 1) / G::kNr;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks));
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t wk = w0; wk < w1; ++wk) {
      const int64_t c0 = chunks * wk / workers, c1 = chunks * (wk + 1) / workers;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t nb0 = c * G::kNr, nr = std::min<int64_t>(G::kNr, nblocks - nb0);
        const int64_t next_nr = c + 1 < c1 ? std::min<int64_t>(G::kNr, nblocks - nb0 - G::kNr) : 0;
        const char* next = reinterpret_cast<const char*>(w + (nb0 + G::kNr) * bs);
        const int64_t pf_lines = next_nr * bs * static_cast<int64_t>(sizeof(typename G::Elem)) / 64;
        if (nr == 3) chunk<G, 3>(x, m, ks, w, nb0, y, n, next, pf_lines);
        else if (nr == 2) chunk<G, 2>(x, m, ks, w, nb0, y, n, next, pf_lines);
        else chunk<G, 1>(x, m, ks, w, nb0, y, n, next, pf_lines);
      }
    }
  });
}

// W [N, K] -> [N / cols][K / step][cols] of `Elem` (a k-step's inputs as one element).
template <class Elem>
at::Tensor pack(const at::Tensor& w_in, int cols, int step) {
  const at::Tensor w = w_in.contiguous();
  const int64_t n = w.size(0), ks = w.size(1) / step;
  at::Tensor out = at::empty({n / cols, ks, cols * step}, w.options());
  const auto* src = reinterpret_cast<const Elem*>(w.data_ptr());
  auto* dst = reinterpret_cast<Elem*>(out.data_ptr());
  at::parallel_for(0, n / cols, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t k = 0; k < ks; ++k)
        for (int i = 0; i < cols; ++i) dst[(nb * ks + k) * cols + i] = src[(nb * cols + i) * ks + k];
  });
  return out;
}

void check_weight(const at::Tensor& w, at::ScalarType dtype, int cols, int step) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype, "pack: expected a 2-D ", dtype,
              " weight, got ", w.sizes(), " ", w.scalar_type());
  TORCH_CHECK(w.size(0) % cols == 0 && w.size(1) % step == 0, "pack: needs out_features % ",
              cols, " == 0", step > 1 ? " and in_features even" : "", ", got ", w.sizes());
}

// The output of x [m, ks * step] times a packed weight [nblocks, ks, cols * step].
at::Tensor check_and_alloc(const at::Tensor& x, const at::Tensor& packed, at::ScalarType dtype,
                           int cols, int step, const char* name) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == cols * step &&
                  packed.scalar_type() == dtype && packed.is_contiguous(),
              name, ": the weight must come from its pack function for this build");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, name, ": expected 2-D ", dtype,
              " rows, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) == packed.size(1) * step, name, ": rows have ", x.size(1),
              " features, the weight expects ", packed.size(1) * step);
  return at::empty({x.size(0), packed.size(0) * cols}, x.options());
}

}  // namespace

bool has_bf16_gemm() { return RADIXKV_BF16_GEMM; }
bool has_f32_gemm() { return RADIXKV_F32_GEMM; }
int64_t f32_gemm_cols() { return radixkv_vec::VW; }
std::tuple<int64_t, int64_t> bf16_gemm_block() { return {kBf16Cols, kBf16Step}; }

at::Tensor pack_bf16_weight(const at::Tensor& w) {
  check_weight(w, at::kBFloat16, kBf16Cols, kBf16Step);
  return pack<int32_t>(w, kBf16Cols, kBf16Step);
}

at::Tensor bf16_gemm(const at::Tensor& x_in, const at::Tensor& packed) {
#if RADIXKV_BF16_GEMM
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = check_and_alloc(x, packed, at::kBFloat16, kBf16Cols, kBf16Step, "bf16_gemm");
  if (x.size(0) > 0) {
    gemm<Bf16Gemm>(reinterpret_cast<const int32_t*>(x.data_ptr()), x.size(0), packed.size(1),
                   reinterpret_cast<const int32_t*>(packed.data_ptr()), packed.size(0),
                   reinterpret_cast<uint16_t*>(y.data_ptr()));
  }
  return y;
#else
  (void)x_in;
  (void)packed;
  TORCH_CHECK(false, "bf16_gemm needs the avx512_bf16 build of radixkv's native kernels");
#endif
}

at::Tensor pack_f32_weight(const at::Tensor& w) {
  check_weight(w, at::kFloat, radixkv_vec::VW, 1);
  return pack<float>(w, radixkv_vec::VW, 1);
}

at::Tensor f32_gemm(const at::Tensor& x_in, const at::Tensor& packed) {
#if RADIXKV_F32_GEMM
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = check_and_alloc(x, packed, at::kFloat, F32Gemm::kCols, 1, "f32_gemm");
  if (x.size(0) > 0) {
    gemm<F32Gemm>(x.data_ptr<float>(), x.size(0), packed.size(1), packed.data_ptr<float>(),
                  packed.size(0), y.data_ptr<float>());
  }
  return y;
#else
  (void)x_in;
  (void)packed;
  TORCH_CHECK(false, "f32_gemm needs an avx2 or avx512 build of radixkv's native kernels");
#endif
}
