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
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
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

#if RADIXKV_BF16_GEMM
// The AMX form of the bf16 GEMM, over the same packed weight: a block's 16 k-steps (32 inputs)
// by its 16 columns are 16 consecutive 64-byte lines, which is AMX-BF16's B operand layout
// (rows = input pairs, 16 columns a row), so tiles load the packed weight as it is; x's rows are
// the A operand in place (16 rows by 32 inputs, row stride K). A worker owns pairs of column
// blocks; per cache block of kAmxRows rows of x, per pair, per two row tiles: four float32
// accumulator tiles (2 row tiles x 2 column blocks) over all k, then rounded once to bf16. The
// row-tile pairs of a column pair prefetch the worker's next pair of weights into L2, each a
// share (a decode step streams every weight once, cold; with the prefetch the model's linears at
// 64 rows ran in 0.83-0.84x the time without it), and reuse their own pair from L1/L2. For
// 33-64 rows (a batch-64 decode) one column block at a time runs through all the row tiles
// instead, so each weight tile is loaded once (0.89-0.95x the pair form's time there; software
// prefetches of the next step's tiles into L1 made it slower).
constexpr int64_t kAmxRows = 256;

// Step kt's share (pf_step bytes) of the pf_bytes at pf, into L2.
inline void amx_prefetch_share(const char* pf, int64_t pf_bytes, int64_t pf_step, int64_t kt) {
  for (int64_t off = kt * pf_step; off < std::min(pf_bytes, (kt + 1) * pf_step); off += 64) {
    _mm_prefetch(pf + off, _MM_HINT_T1);
  }
}

// Tiles: C 0-3 (row tile r, column block c: 2 r + c), A 4-5 (row tiles), B 6-7 (blocks).
// RT row tiles (1, 2) by CB column blocks (1, 2); c gets the float32 results [32][32].
template <int RT, int CB>
RADIXKV_AMX_TARGET inline void amx_gemm_tile(const uint16_t* a0, const uint16_t* a1, int64_t lda,
                                             const int32_t* b0, const int32_t* b1, int64_t kt_n,
                                             float* c, const char* pf, int64_t pf_bytes) {
  _tile_zero(0);
  if constexpr (CB == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && CB == 2) _tile_zero(3);
  const int64_t a_stride = lda * 2, pf_step = pf_bytes / kt_n + 64;
  for (int64_t kt = 0; kt < kt_n; ++kt) {
    amx_prefetch_share(pf, pf_bytes, pf_step, kt);
    _tile_loadd(4, a0 + kt * 32, a_stride);
    _tile_loadd(6, b0 + kt * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CB == 2) {
      _tile_loadd(7, b1 + kt * 256, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, a1 + kt * 32, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  if constexpr (CB == 2) _tile_stored(1, c + 16, 128);
  if constexpr (RT == 2) _tile_stored(2, c + 16 * 32, 128);
  if constexpr (RT == 2 && CB == 2) _tile_stored(3, c + 16 * 32 + 16, 128);
}

// RT (3, 4) row tiles by one column block, for 33-64 rows: C 0-3, A 4 and 5 in turn, B 6, so
// each weight tile is loaded once (by the pair form, once per row-tile pair); c gets [64][16].
template <int RT>
RADIXKV_AMX_TARGET inline void amx_gemm_column(const uint16_t* const* a, int64_t lda,
                                               const int32_t* b, int64_t kt_n, float* c,
                                               const char* pf, int64_t pf_bytes) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  if constexpr (RT == 4) _tile_zero(3);
  const int64_t a_stride = lda * 2, pf_step = pf_bytes / kt_n + 64;
  for (int64_t kt = 0; kt < kt_n; ++kt) {
    amx_prefetch_share(pf, pf_bytes, pf_step, kt);
    _tile_loadd(6, b + kt * 256, 64);
    _tile_loadd(4, a[0] + kt * 32, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a[1] + kt * 32, a_stride);
    _tile_dpbf16ps(1, 5, 6);
    _tile_loadd(4, a[2] + kt * 32, a_stride);
    _tile_dpbf16ps(2, 4, 6);
    if constexpr (RT == 4) {
      _tile_loadd(5, a[3] + kt * 32, a_stride);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 16 * 16, 64);
  _tile_stored(2, c + 32 * 16, 64);
  if constexpr (RT == 4) _tile_stored(3, c + 48 * 16, 64);
}

// Rows [0, rows) x columns [0, 16 cb) of c (float32, row stride ldc) rounded into y (row stride
// n).
inline void amx_store_rows(const float* c, int64_t ldc, int64_t rows, int cb, uint16_t* y,
                           int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int q = 0; q < cb; ++q) {
      Bf16Gemm::store(y + r * n + q * 16, _mm512_loadu_ps(c + r * ldc + q * 16));
    }
  }
}

// The pair form over row blocks of kAmxRows (amx_gemm_pairs' rows beyond the column form).
template <class TileRows>
RADIXKV_AMX_TARGET void amx_gemm_row_blocks(const TileRows& tile_rows, int64_t m, int64_t ks,
                                            const int32_t* w, int64_t nblocks, uint16_t* y,
                                            int64_t p0, int64_t p1, float* c) {
  const int64_t n = nblocks * 16, k = 2 * ks, kt_n = ks / 16, bs = ks * 16;
  for (int64_t r0 = 0; r0 < m; r0 += kAmxRows) {
    const int64_t r1 = std::min(m, r0 + kAmxRows);
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t nb = 2 * pr;
      const int cb = nb + 1 < nblocks ? 2 : 1;
      const int32_t* b0 = w + nb * bs;
      const int32_t* b1 = b0 + bs;
      // the next pair's weights, while this pair's row tiles compute
      const int64_t next_blocks = pr + 1 < p1 ? std::min<int64_t>(2, nblocks - nb - 2) : 0;
      const char* pf = reinterpret_cast<const char*>(w + (nb + 2) * bs);
      const int64_t pf_bytes = r0 == 0 ? next_blocks * bs * 4 : 0;
      const int64_t pf_slice = (pf_bytes / ((r1 - r0 + 31) / 32) + 63) & ~int64_t{63};
      for (int64_t t0 = r0; t0 < r1; t0 += 32) {
        const int64_t rows = std::min<int64_t>(32, r1 - t0);
        const uint16_t* a0 = tile_rows(t0 / 16);
        const uint16_t* a1 = rows > 16 ? tile_rows(t0 / 16 + 1) : a0;
        // this row-tile pair's share of the next pair's prefetch
        const int64_t lo = std::min(pf_bytes, (t0 - r0) / 32 * pf_slice);
        const int64_t len = std::min(pf_bytes - lo, pf_slice);
        const char* pfs = pf + lo;
        if (rows > 16 && cb == 2) amx_gemm_tile<2, 2>(a0, a1, k, b0, b1, kt_n, c, pfs, len);
        else if (rows > 16) amx_gemm_tile<2, 1>(a0, a1, k, b0, b1, kt_n, c, pfs, len);
        else if (cb == 2) amx_gemm_tile<1, 2>(a0, a1, k, b0, b1, kt_n, c, pfs, len);
        else amx_gemm_tile<1, 1>(a0, a1, k, b0, b1, kt_n, c, pfs, len);
        amx_store_rows(c, 32, rows, cb, y + t0 * n + nb * 16, n);
      }
    }
  }
}

// Column pairs [p0, p1) of y [m, 16 nblocks] = x [m, 2 ks] times the packed weight (ks % 16 ==
// 0) on this thread. xtail: the last m % 16 rows of x copied into 16 rows (a row tile's load
// reads 16 rows), or null.
RADIXKV_AMX_TARGET void amx_gemm_pairs(const uint16_t* x, int64_t m, int64_t ks, const int32_t* w,
                                       int64_t nblocks, uint16_t* y, const uint16_t* xtail,
                                       int64_t p0, int64_t p1) {
  const int64_t n = nblocks * 16, k = 2 * ks, kt_n = ks / 16, bs = ks * 16;
  const int64_t full_tiles = m / 16;
  auto tile_rows = [&](int64_t t) { return t < full_tiles ? x + t * 16 * k : xtail; };
  alignas(64) float c[64 * 16];
  _tile_loadconfig(&radixkv_amx::kTileConfig);
  if (m > 32 && m <= 64) {  // one column block at a time, every row tile
    const uint16_t* a[4] = {tile_rows(0), tile_rows(1), tile_rows(2), tile_rows(3)};
    for (int64_t nb = 2 * p0; nb < std::min(nblocks, 2 * p1); ++nb) {
      const int64_t pf_bytes = nb + 1 < std::min(nblocks, 2 * p1) ? bs * 4 : 0;
      const char* pf = reinterpret_cast<const char*>(w + (nb + 1) * bs);
      if (m > 48) amx_gemm_column<4>(a, k, w + nb * bs, kt_n, c, pf, pf_bytes);
      else amx_gemm_column<3>(a, k, w + nb * bs, kt_n, c, pf, pf_bytes);
      amx_store_rows(c, 16, m, 1, y + nb * 16, n);
    }
  } else {
    amx_gemm_row_blocks(tile_rows, m, ks, w, nblocks, y, p0, p1, c);
  }
  // ATen forgets the tile configuration it believes loaded, so its own brgemm reconfigures
  at::native::cpublas::brgemm_release();
}

// y [m, 16 nblocks] = x [m, 2 ks] times the packed weight, column pairs split over threads.
void amx_gemm(const uint16_t* x, int64_t m, int64_t ks, const int32_t* w, int64_t nblocks,
              uint16_t* y, const uint16_t* xtail) {
  const int64_t pairs = (nblocks + 1) / 2;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pairs));
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t wk = w0; wk < w1; ++wk) {
      amx_gemm_pairs(x, m, ks, w, nblocks, y, xtail, pairs * wk / workers,
                     pairs * (wk + 1) / workers);
    }
  });
}
#endif

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

bool bf16_gemm_amx_available() {
#if RADIXKV_BF16_GEMM
  return amx_available();
#else
  return false;
#endif
}

at::Tensor bf16_gemm_amx(const at::Tensor& x_in, const at::Tensor& packed) {
#if RADIXKV_BF16_GEMM
  TORCH_CHECK(amx_available(), "bf16_gemm_amx: this host or build has no AMX-BF16 tile code");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = check_and_alloc(x, packed, at::kBFloat16, kBf16Cols, kBf16Step, "bf16_gemm_amx");
  const int64_t m = x.size(0), ks = packed.size(1);
  TORCH_CHECK(ks % 16 == 0, "bf16_gemm_amx: in_features must be a multiple of 32, got ", 2 * ks);
  if (m > 0) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    std::vector<uint16_t> tail;
    if (m % 16 != 0) {  // a row tile loads 16 rows: the last rows padded to 16
      tail.assign(16 * 2 * ks, 0);
      std::memcpy(tail.data(), xp + (m / 16) * 16 * 2 * ks, (m % 16) * 2 * ks * sizeof(uint16_t));
    }
    amx_gemm(xp, m, ks, reinterpret_cast<const int32_t*>(packed.data_ptr()), packed.size(0),
             reinterpret_cast<uint16_t*>(y.data_ptr()), tail.empty() ? nullptr : tail.data());
  }
  return y;
#else
  (void)x_in;
  (void)packed;
  TORCH_CHECK(false, "bf16_gemm_amx needs the avx512_bf16 build of radixkv's native kernels");
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
