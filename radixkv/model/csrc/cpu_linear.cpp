// y = x W^T for bf16 rows on AVX512-BF16, with W packed once at load.
//
// The packed weight holds 16 output columns by K / 2 pairs of inputs per block: element (n, k)
// sits at [n / 16][k / 2][n % 16][k % 2], so one 64-byte load is the pair (k, k + 1) of 16
// columns, the operand layout of `vdpbf16ps`. A worker owns chunks of kNr column blocks (48
// columns); for each chunk it runs every row of x through a kMr x kNr register tile (24 float32
// accumulators, one broadcast pair of x per row and k-pair), so each weight line is read from
// DRAM once a call and from L2 for the chunk's other row tiles, and it prefetches the next
// chunk's weights into L2 while it computes (a decode step streams every weight once, cold).
// Rounded to bf16 once, at the end; the sum order is fixed by K (no dependence on threads).
//
// Against oneDNN's prepacked GEMM (torch.ops.mkldnn._linear_pointwise) on SmolLM2-135M's
// linears, weights streamed (Zen 4, 2 cores): 406 vs 341 GFLOP/s at 64 rows, 375 vs 275 at 32,
// 433 vs 391 at 128, level at 1,024-2,048 (docs/performance.md).

#include "cpu_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define RADIXKV_BF16_GEMM 1
#else
#define RADIXKV_BF16_GEMM 0
#endif

namespace {

constexpr int kCols = 16;  // output columns per packed block (one zmm of float32)
constexpr int kNr = 3;     // column blocks per register tile
constexpr int kMr = 8;     // rows per register tile

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "pack_bf16_weight: expected a 2-D bfloat16 weight, got ", w.sizes(), " ",
              w.scalar_type());
  TORCH_CHECK(w.size(0) % kCols == 0 && w.size(1) % 2 == 0,
              "pack_bf16_weight: needs out_features % 16 == 0 and in_features even, got ",
              w.sizes());
}

#if RADIXKV_BF16_GEMM

// One register tile: rows [0, MR) of a (row stride lda pairs) times NR packed blocks of b
// (block stride bs int32s), over kp pairs; c gets bf16 results (row stride ldc). Prefetches
// `per_iter` lines of pf[0, pf_lines) into L2 per k-pair.
template <int MR, int NR>
inline void tile(const int32_t* a, int64_t lda, const int32_t* b, int64_t bs, int64_t kp_n,
                 uint16_t* c, int64_t ldc, const char* pf, int64_t pf_lines, int64_t per_iter) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NR; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_n; ++kp) {
    for (int64_t l = kp * per_iter; l < std::min(pf_lines, (kp + 1) * per_iter); ++l) {
      _mm_prefetch(pf + l * 64, _MM_HINT_T1);
    }
    __m512i bv[NR];
    for (int q = 0; q < NR; ++q) bv[q] = _mm512_loadu_si512(b + q * bs + kp * kCols);
    for (int r = 0; r < MR; ++r) {
      const __m512i av = _mm512_set1_epi32(a[r * lda + kp]);
      for (int q = 0; q < NR; ++q) {
        acc[r][q] = _mm512_dpbf16_ps(acc[r][q], (__m512bh)av, (__m512bh)bv[q]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int q = 0; q < NR; ++q) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + q * kCols),
                          (__m256i)_mm512_cvtneps_pbh(acc[r][q]));
    }
  }
}

template <int NR, int MR = kMr>
inline void tile_rows(int64_t rows, const int32_t* a, int64_t lda, const int32_t* b, int64_t bs,
                      int64_t kp_n, uint16_t* c, int64_t ldc, const char* pf, int64_t pf_lines,
                      int64_t per_iter) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR, NR>(a, lda, b, bs, kp_n, c, ldc, pf, pf_lines, per_iter);
    tile_rows<NR, MR - 1>(rows, a, lda, b, bs, kp_n, c, ldc, pf, pf_lines, per_iter);
  }
}

// Every row of x through column blocks [nb0, nb0 + NR), prefetching `next` (pf_lines lines).
template <int NR>
void chunk(const int32_t* x, int64_t m, int64_t kp_n, const int32_t* w, int64_t nb0, uint16_t* y,
           int64_t n, const char* next, int64_t pf_lines) {
  const int64_t bs = kp_n * kCols;
  const int64_t tiles = (m + kMr - 1) / kMr;
  const int64_t per_iter = (pf_lines + tiles * kp_n - 1) / std::max<int64_t>(1, tiles * kp_n);
  for (int64_t t = 0, r0 = 0; r0 < m; ++t, r0 += kMr) {
    const int64_t done = t * kp_n * per_iter;
    tile_rows<NR>(std::min<int64_t>(kMr, m - r0), x + r0 * kp_n, kp_n, w + nb0 * bs, bs, kp_n,
                  y + r0 * n + nb0 * kCols, n, next + done * 64,
                  std::max<int64_t>(0, pf_lines - done), per_iter);
  }
}

#endif  // RADIXKV_BF16_GEMM

}  // namespace

bool has_bf16_gemm() { return RADIXKV_BF16_GEMM; }

at::Tensor pack_bf16_weight(const at::Tensor& w_in) {
  check_weight(w_in);
  const at::Tensor w = w_in.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor out = at::empty({n / kCols, k / 2, kCols, 2}, w.options());
  const auto* src = reinterpret_cast<const int32_t*>(w.data_ptr());  // pairs of row n
  auto* dst = reinterpret_cast<int32_t*>(out.data_ptr());
  at::parallel_for(0, n / kCols, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kp = 0; kp < k / 2; ++kp)
        for (int i = 0; i < kCols; ++i)
          dst[(nb * (k / 2) + kp) * kCols + i] = src[(nb * kCols + i) * (k / 2) + kp];
  });
  return out;
}

at::Tensor bf16_gemm(const at::Tensor& x_in, const at::Tensor& packed) {
#if RADIXKV_BF16_GEMM
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "bf16_gemm: the weight must come from pack_bf16_weight");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16,
              "bf16_gemm: expected 2-D bfloat16 rows, got ", x_in.sizes(), " ",
              x_in.scalar_type());
  const int64_t m = x_in.size(0), kp_n = packed.size(1), nblocks = packed.size(0);
  const int64_t n = nblocks * kCols;
  TORCH_CHECK(x_in.size(1) == 2 * kp_n, "bf16_gemm: rows have ", x_in.size(1),
              " features, the weight expects ", 2 * kp_n);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const auto* xp = reinterpret_cast<const int32_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const int32_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t chunks = (nblocks + kNr - 1) / kNr;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks));
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t wk = w0; wk < w1; ++wk) {
      const int64_t c0 = chunks * wk / workers, c1 = chunks * (wk + 1) / workers;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t nb0 = c * kNr, nr = std::min<int64_t>(kNr, nblocks - nb0);
        const int64_t next_nr = c + 1 < c1 ? std::min<int64_t>(kNr, nblocks - nb0 - kNr) : 0;
        const char* next = reinterpret_cast<const char*>(wp + (nb0 + kNr) * kp_n * kCols);
        const int64_t pf_lines = next_nr * kp_n;  // a block's k-pair is one 64-byte line
        if (nr == 3) chunk<3>(xp, m, kp_n, wp, nb0, yp, n, next, pf_lines);
        else if (nr == 2) chunk<2>(xp, m, kp_n, wp, nb0, yp, n, next, pf_lines);
        else chunk<1>(xp, m, kp_n, wp, nb0, yp, n, next, pf_lines);
      }
    }
  });
  return y;
#else
  (void)x_in;
  (void)packed;
  TORCH_CHECK(false, "bf16_gemm needs the avx512_bf16 build of radixkv's native kernels");
#endif
}
