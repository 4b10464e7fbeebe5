// The bf16 paged-attention kernel's parts that its two translation units share:
// cpu_attention.cpp (the entry point, the work split, the portable and AVX512-BF16 vector paths)
// and cpu_attention_amx.cpp (its AMX items, run_item_amx). See cpu_attention.cpp's file comment
// for the kernel; what it shares with the float32 kernel is in cpu_attention_common.h.
#pragma once

#include "cpu_amx.h"
#include "cpu_attention_common.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define RADIXKV_AVX512BF16 1
#else
#define RADIXKV_AVX512BF16 0
#endif

namespace radixkv_bf16 {

using bf16 = uint16_t;

constexpr int kKeyBlock = 64;  // keys per online-softmax step (the vector path's)
// A KV head with at least this many rows in an item runs in row tiles of 16 rows (rows along
// the vector lanes: no horizontal sums), else row by row.
constexpr int64_t kGemmRows = 16;

// How the pool stores K/V: bf16 rows, or quantized rows (D codes + a bf16 scale).
enum class Quant { None, I8, FP8 };

// The batch (cpu_attention_common.h) with this kernel's bf16 q and output and its switches.
struct Problem : radixkv_attn::PagedBatch {
  const bf16* q;
  int64_t q_stride;  // elements from one token's q row to the next (hq * d when contiguous)
  Quant quant;       // row_bytes: 2 D, or D + 2 when quantized
  bf16* out;
  float scale_log2;  // sm_scale * log2(e)
  // Rows (token * hq + head) after their group's shared part: running max, sum and output
  // (float32, output lanes in the P V loop's order). Written by phase A, read by phase B.
  float* gm;
  float* gl;
  float* go;
  bool amx;  // items with row tiles over bf16 pools run on AMX (run_item_amx)
};

// AMX items run by this process (amx_attention_items).
inline std::atomic<int64_t> g_amx_items{0};

// Query rows are listed as entries: a q token, the last key it sees (absolute position) and the
// first (its sliding window's start, else 0), each standing for the G query heads of every KV
// head of its item. An item's entries see nondecreasing limits.
struct Entries {
  std::vector<int64_t> tok;
  std::vector<int64_t> limit;
  std::vector<int64_t> lower;
};

// Every key of a shared part is visible to every row of it.
constexpr int64_t kSeesAll = INT64_MAX / 4;

struct Item {
  int32_t e0, ne;  // entries [e0, e0 + ne)
  int32_t h0, nh;  // KV heads [h0, h0 + nh)
  int32_t req;     // the request whose page table maps the keys
  bool shared;     // phase A: save the rows' state; else finish them into the output
  bool resume;     // start from the state phase A left (the request's own part of a group)
  int64_t k0, k1;  // keys [k0, k1)
  int64_t cost;
};

#if RADIXKV_AVX512BF16

// 2^x for x <= 0 (clamped at -127): x = n + f, f in [-0.5, 0.5], 2^f by a degree-4 polynomial
// (a relative error of 2.8e-6 at most: P is rounded to bf16, 2^-9, before it meets V, and l's
// error stays three orders below the output's bf16 rounding. Against float64 on a 17-request
// burst and 64 grouped decodes, vector path, Xeon model 207: the same max and mean errors as the
// degree-6 polynomial it replaced, to three digits, with two FMAs fewer per score).
// exp2_finite_ps skips the clamp: for finite x only (a very negative x still gives 0 through
// scalef; -inf would give NaN).
inline __m512 exp2_finite_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(9.582852944731712e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5906426161527634e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4024099111557007e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931241750717163e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

inline __m512 exp2_ps(__m512 x) { return exp2_finite_ps(_mm512_max_ps(x, _mm512_set1_ps(-127.f))); }

// Given 16 vectors, returns the vector of their horizontal sums (lane i = sum of v[i]).
inline __m512 reduce16(__m512* v) {
  __m512 t[8];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 u[4];
  for (int i = 0; i < 4; ++i) {
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// In place: v[c] lane r becomes the old v[r] lane c (a 16 x 16 transpose of float32).
inline void transpose16(__m512* v) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  // lane group L of v[4 i + k] = column 4 L + k of rows 4 i .. 4 i + 3
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    v[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    v[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    v[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    v[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-7, then 8-15
    for (int k = 0; k < 4; ++k) {
      t[8 * h + k] = _mm512_shuffle_f32x4(v[8 * h + k], v[8 * h + 4 + k], 0x88);
      t[8 * h + 4 + k] = _mm512_shuffle_f32x4(v[8 * h + k], v[8 * h + 4 + k], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    v[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    v[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
  }
}

// Calls f(address) for the start of every 64-byte cache line of bytes [lo, lo + n).
template <class F>
inline void for_each_line(const char* lo, int64_t n, F f) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(lo) + n;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(lo) & ~uintptr_t{63}; a < end; a += 64) f(a);
}

// Cache lines to prefetch, issued a few at a time between the kernel's inner steps (drip), so
// the loads overlap the compute. Issued in one burst, a block's hundreds of prefetches fill the
// core's miss buffers and its load queue, and the core waits for them as for loads.
struct LineQueue {
  std::vector<uintptr_t> lines;
  size_t pos = 0;
  bool empty() const { return pos >= lines.size(); }
  void clear() {
    lines.clear();
    pos = 0;
  }
  void add(const char* lo, int64_t n) {  // every line of bytes [lo, lo + n)
    for_each_line(lo, n, [&](uintptr_t a) { lines.push_back(a); });
  }
  // The next n lines (fewer if fewer are left) into L2 (T1). Measured on a Zen 4 host (two
  // builds alternating in one process, caches flushed before each call, the batch-64
  // shared-prefix decode of bench_kernels): T0 (into L1) took 0.95-0.98 ms, T1 0.87-0.90 ms.
  void issue(size_t n) {
    const size_t end = std::min(pos + n, lines.size());
    for (; pos < end; ++pos) _mm_prefetch(reinterpret_cast<const char*>(lines[pos]), _MM_HINT_T1);
  }
  void issue_all() { issue(lines.size()); }
};

// Per-thread scratch (grow-only).
struct Scratch {
  std::vector<bf16> qbuf;     // [rows][D]
  std::vector<float> s;       // [rows][kKeyBlock]
  std::vector<bf16> pbuf;     // [rows][kKeyBlock]
  std::vector<bf16> vpack;    // [kKeyBlock / 2][D][2], pairs of keys interleaved
  std::vector<float> o;       // [rows][D], lanes in vpack order
  std::vector<float> m, l;    // [rows]
  std::vector<int64_t> koff;   // [kKeyBlock] token row offsets (bytes) of this key block
  std::vector<int64_t> knext;  // [kKeyBlock] those of the next block
  // quantized pools: one head's K codes of the block as bf16 (exact), their byte offsets, and
  // the per-key factors of the scores (sm_scale log2 e times the K row's scale) and of P (the
  // V row's scale)
  std::vector<bf16> kq;       // [kKeyBlock][D]
  std::vector<int64_t> qoff;  // [kKeyBlock] bytes, padded keys repeating the last real one
  std::vector<float> ks, vs;  // [kKeyBlock]
  // row tiles (see tile_block): per tile of 16 rows, rows along the lanes
  std::vector<int32_t> qt;    // [tiles][D / 2][16]: the rows' q pairs
  std::vector<float> tm, tl;  // [tiles][16]: running max and sum
  std::vector<float> to;      // [tiles][D][16]: O by lane position (vpack order)
  std::vector<int64_t> tlim;  // [tiles][16]: each row's last visible key, -1 past the head's rows
  std::vector<int64_t> tlow;  // [tiles][16]: each row's first visible key (its sliding window's)
  std::vector<float> st;      // [kKeyBlock][16]: one tile's scores of the block
  std::vector<int32_t> pt;    // [kKeyBlock / 2][16]: its P, bf16 pairs of keys
  std::vector<int64_t> qr;    // [rows]: the q row of each scratch row
  // AMX items (run_item_amx): K^T and V of one head's key block in the VNNI pair layout
  std::vector<bf16> kt;       // [D / 2][kAmxKeyBlock][2]: K^T, dims paired
  std::vector<bf16> vv;       // [kAmxKeyBlock / 2][D][2]: V, keys paired
  // prefetches: the current item's next key block first, then the next item's first block
  LineQueue next_block, next_item;
  // this worker ran AMX items: its tile state is released at the end (through ATen, which also
  // forgets the tile configuration it believes loaded, so its own brgemm reconfigures)
  bool amx_used = false;
  Scratch() = default;
  Scratch(Scratch&&) = default;
  ~Scratch() {
    if (amx_used) at::native::cpublas::brgemm_release();
  }
};

// Byte offsets of the token rows kb .. kb + nk - 1 under the page-table row `row` (padded
// to nk16 by repeating the last), walking it without a division per key.
inline void fill_token_offsets(const Problem& p, const int32_t* row, int64_t kb, int nk, int nk16,
                               int64_t token_stride, int64_t* dst) {
  int64_t pi = kb / p.page_size, slot = kb % p.page_size;
  for (int j = 0; j < nk; ++j) {
    dst[j] = (row[pi] * p.page_size + slot) * token_stride;
    if (++slot == p.page_size) {
      slot = 0;
      ++pi;
    }
  }
  for (int j = nk; j < nk16; ++j) dst[j] = dst[nk - 1];
}

// Calls visit(address, bytes) for the K and V rows of `it`'s heads for the `nk` tokens at byte
// offsets `off`. The item's heads are `bytes` from byte `first` of a token row (a quantized row
// of D + 2 bytes starts off a cache line: prefetches count lines from the aligned-down start).
template <class Visit>
inline void item_rows(const Problem& p, const Item& it, const int64_t* off, int nk, Visit visit) {
  const int64_t first = it.h0 * p.row_bytes, bytes = it.nh * p.row_bytes;
  for (int j = 0; j < nk; ++j) {
    visit(p.k_cache + off[j] + first, bytes);
    visit(p.v_cache + off[j] + first, bytes);
  }
}

// Prefetches every cache line of bytes [lo, lo + n) into L2 (T1), now.
inline void prefetch_lines(const char* lo, int64_t n) {
  for_each_line(lo, n, [](uintptr_t a) {
    _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T1);
  });
}

// The item's query rows into sc.qbuf ([rows][D], KV head-major: row r = hh * head_rows + e * G
// + g) and each one's q row (tok[e] * hq + (h0 + hh) * G + g) into sc.qr.
template <int D>
inline void gather_rows(const Problem& p, const Item& it, const int64_t* tok, Scratch& sc) {
  const int64_t G = p.group, head_rows = it.ne * G, rows = it.nh * head_rows;
  sc.qbuf.resize(rows * D);
  sc.qr.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t hh = r / head_rows, e = (r % head_rows) / G, g = r % G;
    sc.qr[r] = tok[e] * p.hq + (it.h0 + hh) * G + g;
  }
  for (int64_t hh = 0; hh < it.nh; ++hh) {
    for (int64_t e = 0; e < it.ne; ++e) {
      const bf16* src = p.q + tok[e] * p.q_stride + (it.h0 + hh) * G * D;
      std::memcpy(&sc.qbuf[(hh * head_rows + e * G) * D], src, G * D * sizeof(bf16));
    }
  }
}

// orow[0 .. D) *= alpha (a row's O when its running max moved; nothing when it held: alpha 1).
template <int D>
inline void scale_row(float alpha, float* orow) {
  if (alpha == 1.f) return;
  const __m512 av = _mm512_set1_ps(alpha);
  for (int c = 0; c < D / 16; ++c) {
    _mm512_storeu_ps(orow + 16 * c, _mm512_mul_ps(av, _mm512_loadu_ps(orow + 16 * c)));
  }
}

// One item with row tiles over a bf16 pool on AMX tiles (cpu_attention_amx.cpp; D = 64 or 128).
template <int D>
RADIXKV_AMX_TARGET void run_item_amx(const Problem& p, const Item& it, const Entries& en,
                                     Scratch& sc);

#endif  // RADIXKV_AVX512BF16

}  // namespace radixkv_bf16
