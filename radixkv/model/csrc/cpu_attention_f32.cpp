// Paged attention with float32 math over float32, bfloat16 or float16 KV pools, or quantized ones
// (int8 / float8 e4m3 codes with a bfloat16 scale per row, cpu_kv_quant.h: rows of D + 2 bytes,
// dequantized exactly into the same float32 scratch), with shared-prefix (cascade) groups, for any
// x86 ISA level (built per level by native.py).
//
// Same contract as paged_attention (cpu_attention.cpp): query token t of request b (absolute
// position prefix_b + t) attends to keys 0 .. prefix_b + t of that request, read in place through
// page_table[b]; the new tokens' K/V are already stored. q is float32 and so is the output.
// With a sliding window W > 0 (transformers' sliding_window: kv > q - W), the token at position p
// sees keys p - W + 1 .. p only: each row carries its first visible key as well as its last, the
// rows' keys are masked on both sides, and a work item starts at the first key any of its rows
// sees, so a decode reads W keys (W / page_size pages and one more), whatever its context.
//
// Shared prefixes: a group is a list of requests whose page tables start with the same page ids
// over their first `shared` tokens (shared <= every member's prefix_len, so every new token of a
// member sees all of it and no mask is needed there). Phase A walks each group's shared keys ONCE
// per KV head for the query rows of all its members stacked (members x tokens x G query heads, in
// blocks of kRowBlock rows): every K/V block is loaded (and converted to float32) once and reused
// by all rows. Phase B continues each request's online softmax over its own keys (shared ..
// prefix + t, causal) and normalises. Continuing the running (max, sum, acc) of phase A is the
// log-sum-exp merge of the two parts. A request in no group has shared = 0.
//
// Within a work item, keys are visited in blocks of kKeyBlock, the next block's rows prefetched
// while one computes. Many rows (a group's stacked rows, a prefill chunk: attend_tiled) compute
// S^T with rows along the vector lanes; a few rows (a decode's G query heads: row_dot) take
// each score as a dot product with a K row, VW keys' lane sums at a time by a shuffle tree). The
// tiled path reads the block's K and V rows converted (or copied) to contiguous float32 scratch,
// which every row block of the item reuses; the few-rows path converts half-precision and
// quantized rows the same way but reads float32 rows in place, where a copy only added a store
// and a reload of each row, read by just G query rows (a W1-shape decode layer 0.90x, AVX2
// build). The generic head dim transposes K instead. Per row: S = sm_scale * q K^T, running max m,
// P = 2^((S - m) log2 e) (2^x by a minimax polynomial, ~2e-8 relative; log2 e is applied after
// subtracting the max, where the argument is small, so its rounding costs nothing for the keys
// that matter: folding it into q cost ~1e-6 of relative error that the real model amplified 10x
// past transformers in fp32 logits), l = l * e^(m_old - m) + sum P and
// O = O * e^(m_old - m) + P V, all float32. Vectors are GCC vector extensions of the build's
// width (16 floats with AVX-512, 8 otherwise), so one source serves every ISA level.

#include "cpu_attention.h"
#include "cpu_attention_common.h"
#include "cpu_kv_quant.h"
#include "cpu_vec.h"
#include "cpu_work.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__F16C__) || defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// native.py passes the level bare (-DRADIXKV_ISA_NAME=avx2): shell quoting of a string literal
// does not survive the build tool, so it is stringified here.
#ifndef RADIXKV_ISA_NAME
#define RADIXKV_ISA_NAME portable
#endif
#define RADIXKV_STR2(x) #x
#define RADIXKV_STR(x) RADIXKV_STR2(x)

namespace {

using namespace radixkv_vec;
using radixkv_attn::kLog2e;
constexpr int kKeyBlock = 64;   // keys per online-softmax step (a multiple of VW)
constexpr int kKV = kKeyBlock / VW;
constexpr int kRowBlock = 128;  // most query rows per shared-prefix work item
constexpr int kDChunk = 64;     // head-dim floats kept in registers by the P V loop
constexpr int kDV = kDChunk / VW;

// I8 / FP8: quantized rows (cpu_kv_quant.h), D codes and a bfloat16 scale, dequantized exactly
// into the float32 scratch as the half-precision pools are converted.
enum class KV { F32, BF16, F16, I8, FP8 };

// dst[0 .. n) = float32 of the row at src (n elements; a quantized row's scale follows them).
template <KV T>
inline void to_float(const void* src, float* dst, int n) {
  if constexpr (T == KV::I8 || T == KV::FP8) {
    radixkv_kvq::dequant_row<T == KV::FP8>(src, n, dst);
  } else if constexpr (T == KV::F32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (T == KV::BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int i = 0; i < n; ++i) dst[i] = radixkv_attn::bf16_to_float(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(s[i], c10::Half::from_bits()));
  }
}

// The batch (cpu_attention_common.h) with this kernel's float32 q, output and running state.
struct Problem : radixkv_attn::PagedBatch {
  const float* q;
  float* out;
  float* m;  // [T * hq] running max of the scaled scores
  float* l;  // [T * hq] running sum
  float scale;
};

// The first key a query at absolute position `pos` sees.
inline int64_t first_key(const Problem& p, int64_t pos) {
  return radixkv_attn::window_start(p.window, pos);
}

// Byte offsets in the pool of the rows of KV head h for keys [kb, kb + nk) of page table row
// `table` (a page's tokens are contiguous, pages are scattered over the pool).
inline void block_offsets(const Problem& p, const int32_t* table, int64_t h, int64_t kb, int nk,
                          int64_t* off) {
  const int64_t token_bytes = p.hkv * p.row_bytes;
  const int64_t head_bytes = h * p.row_bytes;
  int64_t pi = kb / p.page_size, slot = kb % p.page_size;
  for (int j = 0; j < nk; ++j) {
    off[j] = (static_cast<int64_t>(table[pi]) * p.page_size + slot) * token_bytes + head_bytes;
    if (++slot == p.page_size) {
      slot = 0;
      ++pi;
    }
  }
}

// Prefetches (into L2) the K and V rows of one head at byte offsets off[0 .. nk): a block's
// pages are scattered over the pool, so the hardware prefetchers do not run ahead of them, and
// after a step's linears they come from DRAM. Issued one block ahead of the block computed.
inline void prefetch_block(const Problem& p, const int64_t* off, int nk) {
  const int64_t bytes = p.row_bytes;
  for (int j = 0; j < nk; ++j) {
    const uintptr_t k = reinterpret_cast<uintptr_t>(p.k_cache + off[j]);
    const uintptr_t v = reinterpret_cast<uintptr_t>(p.v_cache + off[j]);
    for (uintptr_t a = k & ~uintptr_t{63}; a < k + bytes; a += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
    }
    for (uintptr_t a = v & ~uintptr_t{63}; a < v + bytes; a += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
    }
  }
}

// One work item: `rows` query rows of KV head h over keys [lo, hi) of the page table row `table`.
struct Item {
  int32_t kind;  // 0: shared part of a group, 1: own part of a request
  int32_t id;    // group or request
  int32_t r0, nr;  // shared: rows [r0, r0 + nr) of the group's stacked rows; own: token range
  int32_t h;
  int64_t lo;    // first key (own part: the request's shared length)
  int64_t cost;  // for ordering, longest first
};

struct Scratch {
  std::vector<float> kt;    // [D][kKeyBlock] K^T of the block
  std::vector<float> vb;    // [kKeyBlock][D]
  std::vector<float> qbuf;  // [rows][D] scaled queries
  std::vector<int64_t> row_index;  // [rows] token * hq + q head
  std::vector<int64_t> row_limit;  // [rows] last visible absolute key
  std::vector<int64_t> row_lower;  // [rows] first visible absolute key (the sliding window's)
  std::vector<int64_t> koff;       // [kKeyBlock] this block's row offsets
  std::vector<int64_t> knext;      // [kKeyBlock] the next block's (prefetched)
  // the tiled path (attend_tiled): queries transposed, scores with rows along the vector lanes
  std::vector<float> qt;     // [D][rows padded]
  std::vector<float> st;     // [kKeyBlock][rows padded]
  std::vector<float> mrow, lrow, arow;  // [rows padded] running max, sum, this block's rescale
};

// Offsets of the first key block [lo, lo + kKeyBlock) of keys [lo, hi), into sc.koff.
inline void first_block(const Problem& p, const int32_t* table, int64_t h, int64_t lo, int64_t hi,
                        Scratch& sc) {
  block_offsets(p, table, h, lo, static_cast<int>(std::min<int64_t>(kKeyBlock, hi - lo)),
                sc.koff.data());
}

// While block kb computes: the next block's offsets into sc.knext (it becomes sc.koff by a swap
// at the end of the block) and a prefetch of its rows, if it starts before `end`.
inline void next_block(const Problem& p, const int32_t* table, int64_t h, int64_t kb, int64_t hi,
                       int64_t end, Scratch& sc) {
  if (kb + kKeyBlock >= end) return;
  const int nk = static_cast<int>(std::min<int64_t>(kKeyBlock, hi - kb - kKeyBlock));
  block_offsets(p, table, h, kb + kKeyBlock, nk, sc.knext.data());
  prefetch_block(p, sc.knext.data(), nk);
}

// The block's nk K and V rows (at sc.koff) as float32 rows of D in sc.kt and sc.vb, converted
// or copied, and kp[j] / vp[j] pointing at them: for the tiled path's many rows, contiguous
// scratch reads faster than float32 rows in place, one head of a token row apart over scattered
// pages.
template <KV T>
inline void block_rows(const Problem& p, int nk, int D, Scratch& sc, const float** kp,
                       const float** vp) {
  for (int j = 0; j < nk; ++j) {
    to_float<T>(p.k_cache + sc.koff[j], &sc.kt[j * D], D);
    to_float<T>(p.v_cache + sc.koff[j], &sc.vb[j * D], D);
    kp[j] = &sc.kt[j * D];
    vp[j] = &sc.vb[j * D];
  }
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < VW; ++i) m = std::max(m, v[i]);
  return m;
}

constexpr int kTile = 4;  // vectors per register tile: NR rows x kTile vectors of accumulators
static_assert(kKV % kTile == 0, "a key block is a whole number of tiles");

// Lane sums of VW vectors, one per lane: out[c] = sum of v[c]'s lanes. A tree of VW - 1
// shuffle-and-add steps (level S adds lanes S apart of vector pairs, interleaving them in blocks
// of S), not VW horizontal sums. Clobbers v.
template <int S>
constexpr int fold_lane(int i) {
  return (i % (2 * S) < S) ? (i / (2 * S)) * 2 * S + i % (2 * S)
                           : VW + (i / (2 * S)) * 2 * S + i % (2 * S) - S;
}
template <int S, size_t... I>
inline vf fold(vf a, vf b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, fold_lane<S>(I)...) +
         __builtin_shufflevector(a, b, (fold_lane<S>(I) + S)...);
}
template <int S>
inline void fold_level(vf* v) {
  if constexpr (S < VW) {
    for (int c = 0; c < VW / (2 * S); ++c) {
      v[c] = fold<S>(v[2 * c], v[2 * c + 1], std::make_index_sequence<VW>{});
    }
    fold_level<2 * S>(v);
  }
}
inline vf lane_sums(vf* v) {
  fold_level<1>(v);
  return v[0];
}

// One query row of a few (a decode's query heads of one KV head) over one key block whose K and
// V rows are float32 rows of D at kp[j] and vp[j] (kp padded to a multiple of VW keys with
// readable rows): S = scale * q K^T as dot products, VW keys at a time (their lane sums by
// lane_sums: no transposed copy of K), the online-softmax update of the row's (m, l, out), and
// out += P V. Keys first .. valid - 1 are visible (first < valid: the row sees one at least; keys
// before `first` are outside its sliding window); D is a multiple of kTile * VW.
template <int D>
inline void row_dot(const Problem& p, const float* q, int64_t ri, int first, int valid,
                    const float* const* kp, const float* const* vp) {
  alignas(64) float s[kKeyBlock];
  const int nv = (valid + VW - 1) / VW * VW;
  for (int j0 = 0; j0 < nv; j0 += VW) {
    vf acc[VW];
    for (int c = 0; c < VW; ++c) acc[c] = vf{};
    for (int v = 0; v < D; v += VW) {
      const vf qv = loadv(q + v);
      for (int c = 0; c < VW; ++c) acc[c] += qv * loadv(kp[j0 + c] + v);
    }
    storev(s + j0, lane_sums(acc) * splat(p.scale));
  }
  for (int j = valid; j < nv; ++j) s[j] = -INFINITY;
  for (int j = 0; j < first; ++j) s[j] = -INFINITY;
  vf mx = loadv(s);
  for (int c = VW; c < nv; c += VW) {
    const vf x = loadv(s + c);
    mx = mx < x ? x : mx;
  }
  const float m_old = p.m[ri];
  const float m_new = std::max(m_old, hmax(mx));
  const vf mv = splat(m_new), l2e = splat(kLog2e);
  vf sum = vf{};
  for (int c = 0; c < nv; c += VW) {
    const vf e = exp2v((loadv(s + c) - mv) * l2e);
    storev(s + c, e);
    sum += e;
  }
  const float alpha = m_old == -INFINITY ? 0.f : std::exp2((m_old - m_new) * kLog2e);
  p.l[ri] = p.l[ri] * alpha + hsum(sum);
  p.m[ri] = m_new;
  const vf av = splat(alpha);
  float* o = p.out + ri * D;
  for (int d0 = 0; d0 < D; d0 += kTile * VW) {
    // P V of this block alone, then out = alpha out + P V: the serial sum over keys is one
    // block long (not the whole sequence), which keeps long contexts at float32 accuracy
    vf oa[kTile];
    for (int c = 0; c < kTile; ++c) oa[c] = vf{};
    for (int j = first; j < valid; ++j) {
      const vf pj = splat(s[j]);
      for (int c = 0; c < kTile; ++c) oa[c] += pj * loadv(vp[j] + d0 + c * VW);
    }
    for (int c = 0; c < kTile; ++c) storev(o + d0 + c * VW, av * loadv(o + d0 + c * VW) + oa[c]);
  }
}

// ---- the tiled path: many rows (a group's stacked rows, a prefill chunk) -----------------------
// Scores are computed transposed, S^T [keys][rows], rows along the vector lanes: Q^T is built once
// per work item, K is read in place (no per-block transpose), and the microkernel is the classic
// GEMM tile (kKeyTile keys broadcast x 2 vectors of rows: 12 accumulators on AVX2). The softmax
// (max, exp, sum, rescale) is then elementwise over rows. P V goes row by row as in rows_block.
constexpr int kKeyTile = 6;

template <int KT>
inline void st_tile(const float* qt, int64_t rp, int r0, const float* const* kp, float* st, int d,
                    float scale) {
  vf acc[KT][2];
  for (int k = 0; k < KT; ++k) acc[k][0] = acc[k][1] = vf{};
  for (int i = 0; i < d; ++i) {
    const vf q0 = loadv(qt + i * rp + r0), q1 = loadv(qt + i * rp + r0 + VW);
    for (int k = 0; k < KT; ++k) {
      const vf kv = splat(kp[k][i]);
      acc[k][0] += kv * q0;
      acc[k][1] += kv * q1;
    }
  }
  const vf sv = splat(scale);
  for (int k = 0; k < KT; ++k) {
    storev(st + k * rp + r0, acc[k][0] * sv);
    storev(st + k * rp + r0 + VW, acc[k][1] * sv);
  }
}

// out rows ri[0..NR) = alpha * out + P V over nk keys, P read from column c of S^T (stride rp).
template <int NR, int D>
inline void pv_rows(const Problem& p, const int64_t* ri, const float* alpha, const float* st,
                    int64_t rp, const int* col, const float* const* vp, int nk) {
  for (int d0 = 0; d0 < D; d0 += kTile * VW) {
    vf oa[NR][kTile];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < kTile; ++c) oa[r][c] = vf{};
    for (int j = 0; j < nk; ++j) {
      vf vv[kTile];
      for (int c = 0; c < kTile; ++c) vv[c] = loadv(vp[j] + d0 + c * VW);
      for (int r = 0; r < NR; ++r) {
        const vf pj = splat(st[j * rp + col[r]]);
        for (int c = 0; c < kTile; ++c) oa[r][c] += pj * vv[c];
      }
    }
    for (int r = 0; r < NR; ++r) {
      const vf av = splat(alpha[r]);
      float* o = p.out + ri[r] * D + d0;
      for (int c = 0; c < kTile; ++c) storev(o + c * VW, av * loadv(o + c * VW) + oa[r][c]);
    }
  }
}

template <int DT, KV T>
void attend_tiled(const Problem& p, const int32_t* table, int64_t h, int64_t lo, int64_t hi,
                  int nrows, Scratch& sc) {
  constexpr int D = DT;
  constexpr int RW = 2 * VW;
  const int64_t rp = (nrows + RW - 1) / RW * RW;
  float* qt = sc.qt.data();
  float* st = sc.st.data();
  float* mrow = sc.mrow.data();
  float* lrow = sc.lrow.data();
  float* arow = sc.arow.data();
  int64_t min_limit = std::numeric_limits<int64_t>::max(), max_limit = -1, max_lower = 0;
  for (int r = 0; r < rp; ++r) {
    if (r < nrows) {
      const float* q = &sc.qbuf[static_cast<int64_t>(r) * D];
      for (int i = 0; i < D; ++i) qt[i * rp + r] = q[i];
      mrow[r] = p.m[sc.row_index[r]];
      lrow[r] = p.l[sc.row_index[r]];
      min_limit = std::min(min_limit, sc.row_limit[r]);
      max_limit = std::max(max_limit, sc.row_limit[r]);
      max_lower = std::max(max_lower, sc.row_lower[r]);
    } else {
      for (int i = 0; i < D; ++i) qt[i * rp + r] = 0.f;
      mrow[r] = -INFINITY;
      lrow[r] = 0.f;
    }
  }
  const float* kp[kKeyBlock];
  const float* vp[kKeyBlock];
  const vf ninf = splat(-INFINITY), l2e = splat(kLog2e);
  const int64_t end = std::min(hi, max_limit + 1);
  if (lo < end) first_block(p, table, h, lo, hi, sc);
  for (int64_t kb = lo; kb < end; kb += kKeyBlock) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyBlock, hi - kb));
    next_block(p, table, h, kb, hi, end, sc);
    block_rows<T>(p, nk, D, sc, kp, vp);
    // S^T = scale * K Q^T
    for (int64_t r0 = 0; r0 < rp; r0 += RW) {
      int j0 = 0;
      for (; j0 + kKeyTile <= nk; j0 += kKeyTile) {
        st_tile<kKeyTile>(qt, rp, r0, kp + j0, st + j0 * rp, D, p.scale);
      }
      switch (nk - j0) {
        case 5: st_tile<5>(qt, rp, r0, kp + j0, st + j0 * rp, D, p.scale); break;
        case 4: st_tile<4>(qt, rp, r0, kp + j0, st + j0 * rp, D, p.scale); break;
        case 3: st_tile<3>(qt, rp, r0, kp + j0, st + j0 * rp, D, p.scale); break;
        case 2: st_tile<2>(qt, rp, r0, kp + j0, st + j0 * rp, D, p.scale); break;
        case 1: st_tile<1>(qt, rp, r0, kp + j0, st + j0 * rp, D, p.scale); break;
        default: break;
      }
    }
    // causal mask: keys past a row's limit
    if (kb + nk - 1 > min_limit) {
      for (int r = 0; r < nrows; ++r) {
        for (int64_t j = std::max<int64_t>(0, sc.row_limit[r] - kb + 1); j < nk; ++j) {
          st[j * rp + r] = -INFINITY;
        }
      }
    }
    // sliding window: keys before a row's first visible one
    if (kb < max_lower) {
      for (int r = 0; r < nrows; ++r) {
        const int64_t below = std::min<int64_t>(nk, sc.row_lower[r] - kb);
        for (int64_t j = 0; j < below; ++j) st[j * rp + r] = -INFINITY;
      }
    }
    // online softmax, elementwise over rows
    for (int64_t r0 = 0; r0 < rp; r0 += VW) {
      vf mx = ninf;
      for (int j = 0; j < nk; ++j) {
        const vf x = loadv(st + j * rp + r0);
        mx = mx < x ? x : mx;
      }
      const vf mo = loadv(mrow + r0);
      const vf mn = mo < mx ? mx : mo;
      const vf base = mn == ninf ? vf{} : mn;  // a row that has seen no key yet keeps P = 0
      vf sum = vf{};
      for (int j = 0; j < nk; ++j) {
        const vf e = exp2v((loadv(st + j * rp + r0) - base) * l2e);
        storev(st + j * rp + r0, e);
        sum += e;
      }
      const vf alpha = mo == ninf ? vf{} : exp2v((mo - base) * l2e);
      storev(lrow + r0, loadv(lrow + r0) * alpha + sum);
      storev(mrow + r0, mn);
      storev(arow + r0, alpha);
    }
    // out = alpha out + P V, rows in pairs
    int col[2];
    int64_t ri[2];
    float al[2];
    int n = 0;
    for (int r = 0; r < nrows; ++r) {
      // sees nothing of this block: P = 0, and alpha = 1 (or O = 0 while it has seen nothing)
      if (sc.row_limit[r] < kb || sc.row_lower[r] >= kb + nk) continue;
      col[n] = r;
      ri[n] = sc.row_index[r];
      al[n] = arow[r];
      if (++n == 2) {
        pv_rows<2, D>(p, ri, al, st, rp, col, vp, nk);
        n = 0;
      }
    }
    if (n == 1) pv_rows<1, D>(p, ri, al, st, rp, col, vp, nk);
    std::swap(sc.koff, sc.knext);
  }
  for (int r = 0; r < nrows; ++r) {
    p.m[sc.row_index[r]] = mrow[r];
    p.l[sc.row_index[r]] = lrow[r];
  }
}

// Attend rows (qbuf, row_index, row_limit, row_lower in sc) of KV head h to keys [lo, hi) of
// `table`, continuing each row's running (m, l, out) state. Keys before every row's sliding window
// are not read: the walk starts at the rows' first visible key.
template <int DT, KV T>
void attend(const Problem& p, const int32_t* table, int64_t h, int64_t lo, int64_t hi, int nrows,
            Scratch& sc) {
  if (p.window > 0 && nrows > 0) {
    int64_t min_lower = sc.row_lower[0];
    for (int r = 1; r < nrows; ++r) min_lower = std::min(min_lower, sc.row_lower[r]);
    lo = std::max(lo, min_lower);
  }
  if constexpr (DT != 0 && DT % (kTile * VW) == 0) {
    if (nrows >= 2 * VW) {
      attend_tiled<DT, T>(p, table, h, lo, hi, nrows, sc);
      return;
    }
  }
  const int D = DT ? DT : static_cast<int>(p.d);
  alignas(64) float s[kKeyBlock];
  int64_t max_limit = -1;
  for (int r = 0; r < nrows; ++r) max_limit = std::max(max_limit, sc.row_limit[r]);
  // rows that see nothing of a block are skipped (limit < kb); blocks no row sees are not read
  const int64_t end = std::min(hi, max_limit + 1);
  if (lo < end) first_block(p, table, h, lo, hi, sc);
  for (int64_t kb = lo; kb < end; kb += kKeyBlock, std::swap(sc.koff, sc.knext)) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyBlock, hi - kb));
    next_block(p, table, h, kb, hi, end, sc);
    if constexpr (DT != 0 && DT % (kTile * VW) == 0) {
      // each row by dot products with the block's rows (row_dot): float32 rows in place, others
      // converted into scratch; a row that sees nothing of this block is skipped
      const float* kp[kKeyBlock];
      const float* vp[kKeyBlock];
      if constexpr (T == KV::F32) {
        for (int j = 0; j < nk; ++j) {
          kp[j] = reinterpret_cast<const float*>(p.k_cache + sc.koff[j]);
          vp[j] = reinterpret_cast<const float*>(p.v_cache + sc.koff[j]);
        }
      } else {
        block_rows<T>(p, nk, DT, sc, kp, vp);
      }
      for (int j = nk; j < (nk + VW - 1) / VW * VW; ++j) kp[j] = kp[0];
      for (int r = 0; r < nrows; ++r) {
        const int valid = static_cast<int>(std::clamp<int64_t>(sc.row_limit[r] - kb + 1, 0, nk));
        const int first = static_cast<int>(std::clamp<int64_t>(sc.row_lower[r] - kb, 0, nk));
        if (first >= valid) continue;
        row_dot<DT>(p, &sc.qbuf[static_cast<int64_t>(r) * DT], sc.row_index[r], first, valid, kp,
                    vp);
      }
      continue;
    }
    // K^T (zero-padded to kKeyBlock keys) and V rows, as float32
    alignas(64) float krow[512];
    float* kt = sc.kt.data();
    for (int j = 0; j < nk; ++j) {
      const float* src;
      if constexpr (T == KV::F32) {
        src = reinterpret_cast<const float*>(p.k_cache + sc.koff[j]);
      } else {
        to_float<T>(p.k_cache + sc.koff[j], krow, D);
        src = krow;
      }
      for (int i = 0; i < D; ++i) kt[i * kKeyBlock + j] = src[i];
      to_float<T>(p.v_cache + sc.koff[j], &sc.vb[j * D], D);
    }
    if (nk < kKeyBlock) {
      for (int i = 0; i < D; ++i) {
        std::fill(kt + i * kKeyBlock + nk, kt + (i + 1) * kKeyBlock, 0.f);
      }
    }
    for (int r = 0; r < nrows; ++r) {
      const int valid = static_cast<int>(std::clamp<int64_t>(sc.row_limit[r] - kb + 1, 0, nk));
      const int first = static_cast<int>(std::clamp<int64_t>(sc.row_lower[r] - kb, 0, nk));
      if (first >= valid) continue;
      const float* qr = &sc.qbuf[static_cast<int64_t>(r) * D];
      // S = q K^T over the block (vectorised over keys)
      vf acc[kKV];
      for (int c = 0; c < kKV; ++c) acc[c] = vf{};
      for (int i = 0; i < D; ++i) {
        const vf qi = splat(qr[i]);
        const float* kti = kt + i * kKeyBlock;
        for (int c = 0; c < kKV; ++c) acc[c] += qi * loadv(kti + c * VW);
      }
      const vf sv = splat(p.scale);
      for (int c = 0; c < kKV; ++c) storev(s + c * VW, acc[c] * sv);
      float bmax = -INFINITY;
      for (int j = first; j < valid; ++j) bmax = std::max(bmax, s[j]);
      const int64_t ri = sc.row_index[r];
      const float m_old = p.m[ri];
      const float m_new = std::max(m_old, bmax);
      const vf mv = splat(m_new), l2e = splat(kLog2e);
      for (int c = 0; c < kKV; ++c) storev(s + c * VW, exp2v((loadv(s + c * VW) - mv) * l2e));
      float lsum = 0.f;
      for (int j = first; j < valid; ++j) lsum += s[j];
      const float alpha = m_old == -INFINITY ? 0.f : std::exp2((m_old - m_new) * kLog2e);
      p.l[ri] = p.l[ri] * alpha + lsum;
      p.m[ri] = m_new;
      float* o = p.out + ri * D;
      const float* vb = sc.vb.data();
      if (DT && D % kDChunk == 0) {
        const vf av = splat(alpha);
        for (int c0 = 0; c0 < D; c0 += kDChunk) {
          vf oa[kDV];
          for (int c = 0; c < kDV; ++c) oa[c] = av * loadv(o + c0 + c * VW);
          for (int j = first; j < valid; ++j) {
            const vf pj = splat(s[j]);
            const float* vr = vb + j * D + c0;
            for (int c = 0; c < kDV; ++c) oa[c] += pj * loadv(vr + c * VW);
          }
          for (int c = 0; c < kDV; ++c) storev(o + c0 + c * VW, oa[c]);
        }
      } else {
        for (int i = 0; i < D; ++i) o[i] *= alpha;
        for (int j = first; j < valid; ++j) {
          const float pj = s[j];
          const float* vr = vb + j * D;
          for (int i = 0; i < D; ++i) o[i] += pj * vr[i];
        }
      }
    }
  }
}

struct Groups {
  const std::vector<int64_t>* members;
  const std::vector<int64_t>* offsets;
  const std::vector<int64_t>* shared;
};

// Rows of a request's tokens [t0, t0 + nt) for KV head h, into sc; returns the row count. With
// `init` (the first part to touch these rows) their running state starts empty: the output and
// (m, l) are allocated uninitialised, so each row is written by the one thread that owns it.
int fill_rows(const Problem& p, int64_t b, int64_t t0, int64_t nt, int64_t h, int64_t limit_cap,
              Scratch& sc, int offset, bool init) {
  const int64_t G = p.group, D = p.d;
  const int64_t prefix = (*p.prefix)[b], start = (*p.start)[b];
  int n = offset;
  for (int64_t t = t0; t < t0 + nt; ++t) {
    for (int64_t g = 0; g < G; ++g, ++n) {
      const int64_t ri = (start + t) * p.hq + h * G + g;
      sc.row_index[n] = ri;
      sc.row_limit[n] = std::min(prefix + t, limit_cap);
      sc.row_lower[n] = first_key(p, prefix + t);
      const float* src = p.q + ri * D;
      float* dst = &sc.qbuf[static_cast<int64_t>(n) * D];
      std::memcpy(dst, src, D * sizeof(float));
      if (init) {
        p.m[ri] = -INFINITY;
        p.l[ri] = 0.f;
        std::memset(p.out + ri * D, 0, D * sizeof(float));
      }
    }
  }
  return n;
}

template <int DT, KV T>
void run_item(const Problem& p, const Groups& gr, const Item& it, Scratch& sc) {
  const int64_t G = p.group;
  if (it.kind == 0) {
    // shared part: stacked rows (member, token, g) r0 .. r0 + nr of group it.id
    const int64_t g0 = (*gr.offsets)[it.id], g1 = (*gr.offsets)[it.id + 1];
    const int64_t S = (*gr.shared)[it.id];
    int n = 0;
    int64_t row = 0;
    for (int64_t mi = g0; mi < g1 && row < it.r0 + it.nr; ++mi) {
      const int64_t b = (*gr.members)[mi];
      const int64_t rows_b = (*p.ext)[b] * G;
      if (row + rows_b > it.r0) {
        const int64_t t_first = std::max<int64_t>(0, (it.r0 - row) / G);
        const int64_t t_last = std::min<int64_t>((*p.ext)[b], (it.r0 + it.nr - row + G - 1) / G);
        n = fill_rows(p, b, t_first, t_last - t_first, it.h, S - 1, sc, n, true);
      }
      row += rows_b;
    }
    const int32_t* table = p.page_table + (*gr.members)[g0] * p.table_stride;
    attend<DT, T>(p, table, it.h, 0, S, n, sc);
    return;
  }
  const int64_t b = it.id;
  const int n = fill_rows(p, b, it.r0, it.nr, it.h, std::numeric_limits<int64_t>::max(), sc, 0,
                          it.lo == 0);
  const int32_t* table = p.page_table + b * p.table_stride;
  const int64_t hi = (*p.prefix)[b] + it.r0 + it.nr;
  attend<DT, T>(p, table, it.h, it.lo, hi, n, sc);
  const int D = DT ? DT : static_cast<int>(p.d);
  for (int r = 0; r < n; ++r) {
    const int64_t ri = sc.row_index[r];
    const float inv = 1.f / p.l[ri];
    float* o = p.out + ri * D;
    for (int i = 0; i < D; ++i) o[i] *= inv;
  }
}

// The head dims of common models get code for their size (96: Phi-3-mini; 256: Gemma 3): the
// tiled and dot-product paths where the dim is a multiple of kTile * VW; others (80: Phi-2,
// StableLM) take the generic path, which reads K transposed.
template <KV T>
void run_any(const Problem& p, const Groups& gr, const Item& it, Scratch& sc) {
  if (p.d == 64) {
    run_item<64, T>(p, gr, it, sc);
  } else if (p.d == 128) {
    run_item<128, T>(p, gr, it, sc);
  } else if (p.d == 96) {
    run_item<96, T>(p, gr, it, sc);
  } else if (p.d == 256) {
    run_item<256, T>(p, gr, it, sc);
  } else {
    run_item<0, T>(p, gr, it, sc);
  }
}

// Each thread's scratch lives as long as the thread (torch's intra-op pool), grown to the
// largest call's sizes and never shrunk: a decode's call would otherwise allocate and zero
// ~330 KB a worker (fresh mmap'd pages: ~70 us of a 1-token layer's attention on the Zen 3
// host). Every buffer is written before it is read (attend_tiled pads its rows explicitly).
Scratch& thread_scratch(const Problem& p) {
  thread_local Scratch sc;
  const int64_t max_rows = std::max<int64_t>(kRowBlock + p.group, 128 * p.group);
  const int64_t padded = (max_rows + 2 * VW - 1) / (2 * VW) * (2 * VW);
  auto grow = [](auto& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  };
  grow(sc.kt, p.d * kKeyBlock);
  grow(sc.vb, p.d * kKeyBlock);
  grow(sc.koff, kKeyBlock);
  grow(sc.knext, kKeyBlock);
  grow(sc.qbuf, max_rows * p.d);
  grow(sc.row_index, max_rows);
  grow(sc.row_limit, max_rows);
  grow(sc.row_lower, max_rows);
  grow(sc.qt, padded * p.d);
  grow(sc.st, padded * kKeyBlock);
  grow(sc.mrow, padded);
  grow(sc.lrow, padded);
  grow(sc.arow, padded);
  return sc;
}

// One item on the pool's element type.
void run_kv(const Problem& p, const Groups& gr, const Item& it, Scratch& sc, KV kv) {
  switch (kv) {
    case KV::F32:
      run_any<KV::F32>(p, gr, it, sc);
      break;
    case KV::BF16:
      run_any<KV::BF16>(p, gr, it, sc);
      break;
    case KV::F16:
      run_any<KV::F16>(p, gr, it, sc);
      break;
    case KV::I8:
      run_any<KV::I8>(p, gr, it, sc);
      break;
    case KV::FP8:
      run_any<KV::FP8>(p, gr, it, sc);
      break;
  }
}

void run_items(const Problem& p, const Groups& gr, std::vector<Item>& items, KV kv) {
  auto make_scratch = [&p]() -> Scratch& { return thread_scratch(p); };
  // a worker's next item: its first key block is prefetched before the current item runs
  auto prefetch_first = [&](const Item& it, Scratch&) {
    const int32_t* table;
    int64_t lo, hi;
    if (it.kind == 0) {
      table = p.page_table + (*gr.members)[(*gr.offsets)[it.id]] * p.table_stride;
      lo = 0;
      hi = (*gr.shared)[it.id];
    } else {
      table = p.page_table + it.id * p.table_stride;
      lo = std::max(it.lo, first_key(p, (*p.prefix)[it.id] + it.r0));  // the window's start
      hi = (*p.prefix)[it.id] + it.r0 + it.nr;
    }
    const int nk = static_cast<int>(std::min<int64_t>(kKeyBlock, hi - lo));
    if (nk <= 0) return;
    int64_t off[kKeyBlock];
    block_offsets(p, table, it.h, lo, nk, off);
    prefetch_block(p, off, nk);
  };
  radixkv_work::run_longest_first(
      items, make_scratch, [&](const Item& it, Scratch& sc) { run_kv(p, gr, it, sc, kv); },
      prefetch_first);
}

}  // namespace

namespace {

// The pools' element type (both the same), or a clear error.
KV pool_kind(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  KV kv;
  if (k_cache.scalar_type() == at::kFloat) {
    kv = KV::F32;
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    kv = KV::BF16;
  } else if (k_cache.scalar_type() == at::kHalf) {
    kv = KV::F16;
  } else if (k_cache.scalar_type() == at::kChar) {
    kv = KV::I8;
  } else if (k_cache.scalar_type() == at::kByte) {
    kv = KV::FP8;
  } else {
    TORCH_CHECK(false,
                "paged_attention_f32: the caches must be float32, bfloat16 or float16, or "
                "quantized (int8, or uint8 holding float8_e4m3fn bits)");
  }
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention_f32: k_cache and v_cache dtypes differ");
  return kv;
}

radixkv_attn::PagedBatch check_batch(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& page_table,
                                     const std::vector<int64_t>& prefix_lens,
                                     const std::vector<int64_t>& extend_lens,
                                     const std::vector<int64_t>& extend_starts, int64_t window,
                                     KV kv) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention_f32: q must be float32");
  const bool quantized = kv == KV::I8 || kv == KV::FP8;
  const radixkv_attn::BatchRules rules{quantized ? radixkv_kvq::kScaleBytes : 0, false, 512};
  return radixkv_attn::check_paged_batch("paged_attention_f32", q, k_cache, v_cache, page_table,
                                         prefix_lens, extend_lens, extend_starts, window, rules);
}

// The two phases' items, each longest first (as run_longest_first orders them): A, the shared
// parts of the prefix groups; B, each request's own part.
void build_items(const Problem& p, const std::vector<int64_t>& group_members,
                 const std::vector<int64_t>& group_offsets,
                 const std::vector<int64_t>& group_shared, const std::vector<int64_t>& shared_of,
                 std::vector<Item>& phase_a, std::vector<Item>& phase_b) {
  const std::vector<int64_t>& prefix_lens = *p.prefix;
  const std::vector<int64_t>& extend_lens = *p.ext;
  const int64_t B = static_cast<int64_t>(extend_lens.size());
  const int64_t hkv = p.hkv, window = p.window;
  const int64_t n_groups = static_cast<int64_t>(group_shared.size());
  auto i32 = [](int64_t x) { return static_cast<int32_t>(x); };
  // Phase A: shared parts, kRowBlock stacked rows per item and KV head.
  for (int64_t g = 0; g < n_groups; ++g) {
    if (group_shared[g] == 0) continue;
    int64_t rows = 0;
    for (int64_t mi = group_offsets[g]; mi < group_offsets[g + 1]; ++mi) {
      rows += extend_lens[group_members[mi]] * p.group;
    }
    // Row blocks start on token boundaries (multiples of G rows) and split the rows evenly
    // into the fewest blocks of at most kRowBlock rows: each item copies the whole shared
    // prefix's K/V blocks into scratch, so fewer, larger items copy less (W1's prefill chunk,
    // 3,072 rows a KV head: 0.94x the kernel's time at 128 rows against 64, no gain past 128;
    // a batch-64 decode's 192 rows: two items of 96 a head, 0.91x, where 63-row blocks left a
    // 3-row item that read the whole prefix again; AVX2 build, caches flushed).
    const int64_t max_block = std::max<int64_t>(p.group, kRowBlock / p.group * p.group);
    const int64_t n_blocks = (rows + max_block - 1) / max_block;
    const int64_t block = (rows / p.group + n_blocks - 1) / n_blocks * p.group;
    // (a window caps the keys a row sees, and so the keys an item reads, at about W)
    const int64_t keys = window > 0 ? std::min(group_shared[g], window) : group_shared[g];
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
      const int64_t nr = std::min(block, rows - r0);
      for (int64_t h = 0; h < hkv; ++h) {
        phase_a.push_back(Item{0, i32(g), i32(r0), i32(nr), i32(h), 0, keys * (nr + 8)});
      }
    }
  }
  // Phase B: own parts (keys shared .. prefix + t, causal; from the first token's window start
  // with a window), blocks of query tokens per KV head.
  const int64_t tok_per_item = 128;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = extend_lens[b];
    for (int64_t t0 = 0; t0 < n; t0 += tok_per_item) {
      const int64_t nt = std::min(tok_per_item, n - t0);
      const int64_t lo = std::max(shared_of[b], first_key(p, prefix_lens[b] + t0));
      for (int64_t h = 0; h < hkv; ++h) {
        const int64_t keys = prefix_lens[b] + t0 + nt - lo;
        phase_b.push_back(Item{1, i32(b), i32(t0), i32(nt), i32(h), shared_of[b], keys * (nt + 8)});
      }
    }
  }
  for (std::vector<Item>* items : {&phase_a, &phase_b}) {
    std::stable_sort(items->begin(), items->end(),
                     [](const Item& a, const Item& b) { return a.cost > b.cost; });
  }
}

}  // namespace

at::Tensor paged_attention_f32(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor page_table, std::vector<int64_t> prefix_lens,
                               std::vector<int64_t> extend_lens,
                               std::vector<int64_t> extend_starts, double sm_scale,
                               std::vector<int64_t> group_members,
                               std::vector<int64_t> group_offsets,
                               std::vector<int64_t> group_shared, int64_t window) {
  const KV kv = pool_kind(k_cache, v_cache);
  const radixkv_attn::PagedBatch batch = check_batch(
      q, k_cache, v_cache, page_table, prefix_lens, extend_lens, extend_starts, window, kv);
  const std::vector<int64_t> shared_of = radixkv_attn::check_prefix_groups(
      "paged_attention_f32", batch, group_members, group_offsets, group_shared);
  const int64_t hq = batch.hq;
  // Every row of a request is initialised by the first part that touches it (fill_rows); rows
  // of q that belong to no request (none in the engine's batches) are zero.
  int64_t covered = 0;
  for (const int64_t n : extend_lens) covered += n;
  auto out = covered == q.size(0) ? at::empty_like(q) : at::zeros_like(q);
  auto m = at::empty({q.size(0), hq}, q.options());
  auto l = at::empty({q.size(0), hq}, q.options());
  Problem p{batch};
  p.q = q.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.m = m.data_ptr<float>();
  p.l = l.data_ptr<float>();
  p.scale = static_cast<float>(sm_scale);
  Groups gr{&group_members, &group_offsets, &group_shared};
  std::vector<Item> phase_a, phase_b;
  build_items(p, group_members, group_offsets, group_shared, shared_of, phase_a, phase_b);
  run_items(p, gr, phase_a, kv);
  run_items(p, gr, phase_b, kv);
  return out;
}

struct PagedAttentionF32Plan::Impl {
  // the call's vectors, owned here (the Problem and Groups point at them)
  std::vector<int64_t> prefix, ext, start, members, offsets, shared;
  Problem base{};
  Groups groups{};
  KV kv = KV::F32;
  std::vector<Item> phase_a, phase_b;
  std::vector<float> m, l;
  std::vector<int64_t> pool_sizes;
  at::ScalarType pool_dtype = at::kFloat;
};

PagedAttentionF32Plan::PagedAttentionF32Plan(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& page_table, const std::vector<int64_t>& prefix_lens,
    const std::vector<int64_t>& extend_lens, const std::vector<int64_t>& extend_starts,
    double sm_scale, const std::vector<int64_t>& group_members,
    const std::vector<int64_t>& group_offsets, const std::vector<int64_t>& group_shared)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  im.prefix = prefix_lens;
  im.ext = extend_lens;
  im.start = extend_starts;
  im.members = group_members;
  im.offsets = group_offsets;
  im.shared = group_shared;
  im.kv = pool_kind(k_cache, v_cache);
  const radixkv_attn::PagedBatch batch =
      check_batch(q, k_cache, v_cache, page_table, im.prefix, im.ext, im.start, 0, im.kv);
  const std::vector<int64_t> shared_of = radixkv_attn::check_prefix_groups(
      "paged_attention_f32", batch, im.members, im.offsets, im.shared);
  int64_t covered = 0;
  for (const int64_t n : im.ext) covered += n;
  TORCH_CHECK(covered == q.size(0), "PagedAttentionF32Plan: every row of q must belong to a "
              "request (", covered, " of ", q.size(0), " do)");
  im.base = Problem{batch};
  im.base.q = nullptr;
  im.base.out = nullptr;
  im.m.resize(q.size(0) * batch.hq);
  im.l.resize(q.size(0) * batch.hq);
  im.base.m = im.m.data();
  im.base.l = im.l.data();
  im.base.scale = static_cast<float>(sm_scale);
  im.groups = Groups{&im.members, &im.offsets, &im.shared};
  build_items(im.base, im.members, im.offsets, im.shared, shared_of, im.phase_a, im.phase_b);
  im.pool_sizes = k_cache.sizes().vec();
  im.pool_dtype = k_cache.scalar_type();
}

PagedAttentionF32Plan::~PagedAttentionF32Plan() = default;

bool PagedAttentionF32Plan::fits(const at::Tensor& k_cache, const at::Tensor& v_cache) const {
  const Impl& im = *impl_;
  return k_cache.sizes() == im.pool_sizes && v_cache.sizes() == im.pool_sizes &&
         k_cache.scalar_type() == im.pool_dtype && v_cache.scalar_type() == im.pool_dtype &&
         k_cache.is_contiguous() && v_cache.is_contiguous();
}

void PagedAttentionF32Plan::run_team(const float* q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, float* out, int tid,
                                     int threads) const {
  const Impl& im = *impl_;
  Problem p = im.base;
  p.k_cache = static_cast<const char*>(k_cache.data_ptr());
  p.v_cache = static_cast<const char*>(v_cache.data_ptr());
  p.q = q;
  p.out = out;
  Scratch& sc = thread_scratch(p);
  // items dealt round robin in longest-first order; each item owns its rows, so which thread
  // runs it does not change a result
  for (size_t i = tid; i < im.phase_a.size(); i += threads) {
    run_kv(p, im.groups, im.phase_a[i], sc, im.kv);
  }
  if (!im.phase_a.empty()) {
#pragma omp barrier
  }
  for (size_t i = tid; i < im.phase_b.size(); i += threads) {
    run_kv(p, im.groups, im.phase_b[i], sc, im.kv);
  }
}

const char* f32_kernel_isa() { return RADIXKV_STR(RADIXKV_ISA_NAME); }
