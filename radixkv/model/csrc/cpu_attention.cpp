// Paged attention for the CPU, reading K/V in place from the paged pool.
//
// One call per layer serves every request of a step: decodes (one new token after a cached
// prefix), extends (new tokens after a cached prefix) and fresh prefills (nothing cached). Query
// token t of request b (absolute position prefix_b + t) attends to keys 0 .. prefix_b + t of that
// request, which live in the pages page_table[b][pos / page_size] at slot pos % page_size. The new
// tokens' K/V must already be stored in the pool. With a sliding window W > 0 (transformers'
// sliding_window mask, kv > q - W) it sees keys prefix_b + t - W + 1 .. prefix_b + t only: every
// query row carries its first visible key beside its last, every path masks both ends (the row
// path's key masks, the row tiles' lane compares, the AMX rows' scores), and each item starts at
// the first key one of its rows sees, so a decode reads W keys whatever its context.
//
// Work is split into items (request, block of query tokens, KV head); the G query heads of a KV
// head are folded into the item's rows, so every key is loaded once for all of them. Within an
// item keys are visited in blocks with an online softmax (running max m, running sum l):
//   S = Q K^T  (bf16 dot products, float32 accumulation; AVX512-BF16 vdpbf16ps)
//   P = exp2((S * scale * log2 e) - m)          (float32, then bf16 for the P V product)
//   O = O * exp2(m_old - m_new) + P V           (float32 accumulators)
// and the output is O / l in bf16. A KV head with few rows in its item (decodes: G rows) is
// computed row by row: each score a dot product summed across the lanes. One with kGemmRows or
// more (a shared prefix's stacked members, prefill and extend blocks) runs in row tiles: 16 rows
// along the vector lanes, so the softmax's max, sum and rescaling are lane-wise, with no
// horizontal sums and no transposed copy of K (see tile_block). The two differ only in float32
// summation orders (of each score and of each row's softmax sum). Items run on torch's intra-op threads,
// longest first, taken from a shared counter so causal prefills (whose later blocks cost more)
// balance.
//
// Shared prefixes (the AVX512-BF16 path): a group is a list of requests whose page tables start
// with the same page ids over their first `shared` tokens (shared <= every member's prefix, so
// every new token of a member sees all of it, unmasked; see check_prefix_groups). Phase A walks
// each group's shared keys once per KV head for the stacked query rows of all its members, so a
// burst of requests on one system prompt reads and packs the prompt's K/V once per step instead
// of once per request, and leaves each row's running (m, l, O) in a float32 buffer. Phase B
// continues every request over its own keys (shared .. prefix + t, causal) from that state: the
// exact log-sum-exp merge of the two parts. The portable path ignores the groups (it reads every
// request's whole prefix), which computes the same attention.
//
// Quantized pools (int8 or float8 e4m3 codes with a bfloat16 scale per row, cpu_kv_quant.h, rows
// of D + 2 bytes: about half of bf16's bytes read): the AVX512-BF16 path converts, per key block
// and KV head, the block's K codes into a small bf16 scratch (a code is exact in bf16) and runs
// the same dot products over it, multiplying each key's score by its row's scale; V's codes are
// packed straight into the P V pair layout, and each key's P is multiplied by its V row's scale
// before P is rounded to bf16. So the only roundings are bf16 pages' own (P, and the output): no
// K/V value is rounded. The portable path dequantizes each row to float32 (exact).
//
// AMX (hosts with AMX-BF16, bf16 pools): items with kGemmRows or more rows per KV head run both
// products on AMX tiles instead of vdpbf16ps (run_item_amx, cpu_attention_amx.cpp: hand-written
// tile code, 256-key blocks, 32- or 16-row chunks), with the same softmax arithmetic
// (amx_softmax_tile); set_amx_attention switches it. The parts both files use (Problem, Item,
// Entries, Scratch, the AVX-512 helpers) are in cpu_attention_bf16.h.
//
// A portable scalar path (any CPU, any head dim) computes the same thing; the AVX512 path takes
// head dims 64, 96, 128 and 256 (a multiple of 32, at most 256), its AMX items 64 and 128 (the
// others run their row tiles on the vector path).

#include "cpu_attention.h"
#include "cpu_attention_bf16.h"
#include "cpu_kv_quant.h"
#include "cpu_work.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace radixkv_bf16;
using radixkv_attn::bf16_to_float;
using radixkv_attn::float_to_bf16;
using radixkv_attn::kLog2e;
constexpr int kRowsPerItem = 96;  // query rows (tokens x G heads) per work item
// Where AMX items run: twice as many, so each key block's K^T / V packing serves more rows
// (2,048-token causal prefill and a 16-request burst, one layer, Xeon model 207, alternated:
// 5-7% faster than 96 with oneDNN's brgemm; 384 and 768 no better than 192, and 384 within the
// noise of 192 with the tile code).
constexpr int kAmxRowsPerItem = 192;

// -1: not yet asked; else whether AMX items are on (amx_attention_available() by default).
int g_amx_attention = -1;

// Offset (in bytes) of key `pos` of request `b`, KV head `h`, in the cache.
inline int64_t key_offset(const Problem& p, int64_t b, int64_t pos, int64_t h) {
  const int64_t page = p.page_table[b * p.table_stride + pos / p.page_size];
  return ((page * p.page_size + pos % p.page_size) * p.hkv + h) * p.row_bytes;
}

// ------------------------------------------------------------------------------------------
// Portable path
// ------------------------------------------------------------------------------------------

// dst[0 .. d) = float32 values of the K or V row at `row`.
inline void row_to_float(const Problem& p, const char* row, float* dst) {
  switch (p.quant) {
    case Quant::None: {
      const bf16* src = reinterpret_cast<const bf16*>(row);
      for (int64_t i = 0; i < p.d; ++i) dst[i] = bf16_to_float(src[i]);
      break;
    }
    case Quant::I8:
      radixkv_kvq::dequant_row<false>(row, p.d, dst);
      break;
    case Quant::FP8:
      radixkv_kvq::dequant_row<true>(row, p.d, dst);
      break;
  }
}

// One own-part item (no groups) over every key of each entry (its window's).
void run_item_scalar(const Problem& p, const Item& it, const Entries& en) {
  const int64_t d = p.d, G = p.group;
  std::vector<float> qrow(d), acc(d), kv(d), scores;
  for (int64_t e = it.e0; e < it.e0 + it.ne; ++e) {
    const int64_t tok = en.tok[e];
    const int64_t first = en.lower[e];
    const int64_t nkeys = en.limit[e] + 1;
    scores.resize(nkeys);
    for (int64_t g = 0; g < it.nh * G; ++g) {
      const int64_t kvh = it.h0 + g / G;
      const int64_t qh = it.h0 * G + g;
      const bf16* qp = p.q + tok * p.q_stride + qh * d;
      for (int64_t i = 0; i < d; ++i) qrow[i] = bf16_to_float(qp[i]);
      float mx = -INFINITY;
      for (int64_t j = first; j < nkeys; ++j) {
        row_to_float(p, p.k_cache + key_offset(p, it.req, j, kvh), kv.data());
        float s = 0.f;
        for (int64_t i = 0; i < d; ++i) s += qrow[i] * kv[i];
        scores[j] = s * p.scale_log2;
        mx = std::max(mx, scores[j]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float l = 0.f;
      for (int64_t j = first; j < nkeys; ++j) {
        const float w = std::exp2(scores[j] - mx);
        l += w;
        row_to_float(p, p.v_cache + key_offset(p, it.req, j, kvh), kv.data());
        for (int64_t i = 0; i < d; ++i) acc[i] += w * kv[i];
      }
      bf16* op = p.out + (tok * p.hq + qh) * d;
      for (int64_t i = 0; i < d; ++i) op[i] = float_to_bf16(acc[i] / l);
    }
  }
}

// ------------------------------------------------------------------------------------------
// AVX512-BF16 path
// ------------------------------------------------------------------------------------------

#if RADIXKV_AVX512BF16

// Issues up to n queued prefetches, the current item's next block first.
inline void drip(Scratch& sc, size_t n) {
  if (!sc.next_block.empty()) {
    sc.next_block.issue(n);
  } else if (!sc.next_item.empty()) {
    sc.next_item.issue(n);
  }
}

// 16 codes of a quantized row as float32 values (exact, without the row's scale).
template <bool FP8>
inline __m512 codes16(const char* p) {
  if constexpr (FP8) {
    return radixkv_kvq::codes16_fp8(p);
  } else {
    return radixkv_kvq::codes16_i8(p);
  }
}

// K of one head (at byte `head_off` of each token row) for the nk keys at byte offsets `off` of
// a quantized pool: the codes into dst [nk][D] as bf16 (exact: at most 8 significant bits) and
// ks[j] = `mul` * the row's scale (ks past nk repeat the last).
template <int D, bool FP8>
inline void k_codes_bf16(const char* base, const int64_t* off, int nk, int nk16, int64_t head_off,
                         float mul, bf16* dst, float* ks) {
  for (int j = 0; j < nk; ++j) {
    const char* row = base + off[j] + head_off;
    ks[j] = mul * radixkv_kvq::row_scale(row, D);
    for (int c = 0; c < D / 32; ++c) {
      const __m512 lo = codes16<FP8>(row + 32 * c), hi = codes16<FP8>(row + 32 * c + 16);
      _mm512_storeu_si512(dst + j * D + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
  for (int j = nk; j < nk16; ++j) ks[j] = ks[nk - 1];
}

// V of one head for the nk keys at byte offsets `off` (padded keys repeat a real one), in pairs
// of keys: vpack[jp][16 c + i] = the bf16 pair (key 2 jp, key 2 jp + 1) of dim 16 c + i (lanes
// in head-dim order; the bf16 path's unpack order differs), and vs[j] = the row's scale (0 past
// nk, where P is 0). The codes are exact in bf16, so a float32's top half is its bf16.
template <int D, bool FP8>
inline void v_codes_pack(const char* base, const int64_t* off, int nk, int nk16, int64_t head_off,
                         bf16* vpack, float* vs) {
  for (int jp = 0; jp < nk16 / 2; ++jp) {
    const char* va = base + off[2 * jp] + head_off;
    const char* vb = base + off[2 * jp + 1] + head_off;
    const bool second_valid = 2 * jp + 1 < nk;
    vs[2 * jp] = 2 * jp < nk ? radixkv_kvq::row_scale(va, D) : 0.f;
    vs[2 * jp + 1] = second_valid ? radixkv_kvq::row_scale(vb, D) : 0.f;
    bf16* dst = vpack + jp * 2 * D;
    for (int c = 0; c < D / 16; ++c) {
      const __m512i a = _mm512_castps_si512(codes16<FP8>(va + 16 * c));
      const __m512i b =
          second_valid ? _mm512_castps_si512(codes16<FP8>(vb + 16 * c)) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 32 * c, _mm512_or_si512(b, _mm512_srli_epi32(a, 16)));
    }
  }
}

// O += P V for the NR rows rt .. rt + NR - 1 (NR a compile-time count, so the tile's
// accumulators stay in registers; a runtime count spilled them to the stack around every
// dot-product instruction).
template <int D, int NR>
inline void pv_tile(Scratch& sc, int64_t rt, int npairs) {
  constexpr int OV = D / 16;
  __m512 acc[NR][OV];
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < OV; ++c) acc[i][c] = _mm512_loadu_ps(&sc.o[(rt + i) * D + 16 * c]);
  }
  for (int jp = 0; jp < npairs; ++jp) {
    __m512i vv[OV];
    for (int c = 0; c < OV; ++c) vv[c] = _mm512_loadu_si512(&sc.vpack[jp * 2 * D + 32 * c]);
    for (int i = 0; i < NR; ++i) {
      int32_t pair;
      std::memcpy(&pair, &sc.pbuf[(rt + i) * kKeyBlock + 2 * jp], sizeof(pair));
      const __m512i pb = _mm512_set1_epi32(pair);
      for (int c = 0; c < OV; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], as_bh(pb), as_bh(vv[c]));
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < OV; ++c) _mm512_storeu_ps(&sc.o[(rt + i) * D + 16 * c], acc[i][c]);
  }
}

// Rows per P V register tile: NR x D / 16 accumulators and D / 16 V vectors in 32 registers (6
// rows for D = 64, 4 for 96, 3 for 128, 1 for 256).
template <int D>
constexpr int kPvRows = 24 / (D / 16);

template <int D>
inline void pv_rows(Scratch& sc, int64_t rt, int nr, int npairs) {
  switch (nr) {  // nr <= kPvRows<D>
    case 1: return pv_tile<D, 1>(sc, rt, npairs);
    case 2: if constexpr (kPvRows<D> >= 2) return pv_tile<D, 2>(sc, rt, npairs); break;
    case 3: if constexpr (kPvRows<D> >= 3) return pv_tile<D, 3>(sc, rt, npairs); break;
    case 4: if constexpr (kPvRows<D> >= 4) return pv_tile<D, 4>(sc, rt, npairs); break;
    case 5: if constexpr (kPvRows<D> >= 5) return pv_tile<D, 5>(sc, rt, npairs); break;
    case 6: if constexpr (kPvRows<D> >= 6) return pv_tile<D, 6>(sc, rt, npairs); break;
  }
  TORCH_CHECK(false, "paged_attention: a P V tile of ", nr, " rows for head dim ", D);
}

// ---- Row tiles: a KV head with kGemmRows or more query rows ---------------------------------
// 16 query rows of one KV head lie along the vector lanes (lanes past the head's rows hold zero
// queries and are never written out), so every per-row quantity is a vector: a key's scores, the
// running max and sum, O's value at a lane position. The block max and sum are lane-wise (no
// horizontal sums), masking compares a vector of row limits, and both products are vdpbf16ps
// with one operand broadcast from memory:
//   S^T[key] += Q^T[pair dp] * (K[key] dims 2 dp, 2 dp + 1)     (K rows contiguous in kblk)
//   O^T[pos] += P^T[key pair jp] * vpack[jp][pos]               (pos: a lane position of O)
// Each score sums its dimension pairs in order, as the former GEMM-form tile did; the row-by-row
// path sums them across the lanes instead (float32 rounding differs, nothing else).
constexpr int kTile = 16;

inline int64_t tiles_per_head(int64_t head_rows) { return (head_rows + kTile - 1) / kTile; }

// Word indices for _mm512_permutexvar_epi16 over cvtne2ps_pbh(b, a) (words a[0..15], b[0..15]).
struct WordOrders {
  alignas(64) uint16_t pairs[32];   // dword L = (a[L], b[L]): two keys' P as one bf16 pair
  alignas(64) uint16_t dims[32];    // a = O's even vector, b = its odd one of a 32-dim chunk (bf16
                                    // pools' vpack order), to head-dim order
  WordOrders() {
    for (int L = 0; L < 16; ++L) {
      pairs[2 * L] = static_cast<uint16_t>(L);
      pairs[2 * L + 1] = static_cast<uint16_t>(16 + L);
    }
    for (int dim = 0; dim < 32; ++dim) {
      const int g = dim / 8, k = dim % 8;
      dims[dim] = static_cast<uint16_t>(k < 4 ? 4 * g + k : 16 + 4 * g + k - 4);
    }
  }
};
const WordOrders kWordOrders;

// Fills the item's tiles: q pairs transposed, running state empty or where phase A left it.
template <int D>
void tiles_begin(const Problem& p, const Item& it, Scratch& sc, int64_t head_rows,
                 const int64_t* lim, const int64_t* low) {
  const int64_t tph = tiles_per_head(head_rows), nt = it.nh * tph;
  sc.qt.resize(nt * (D / 2) * kTile);
  sc.tm.resize(nt * kTile);
  sc.tl.resize(nt * kTile);
  sc.to.resize(nt * D * kTile);
  sc.tlim.resize(nt * kTile);
  sc.tlow.resize(nt * kTile);
  sc.st.resize(kKeyBlock * kTile);
  sc.pt.resize(kKeyBlock / 2 * kTile);
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t hr0 = (t % tph) * kTile, r0 = (t / tph) * head_rows + hr0;
    const int64_t n = std::min<int64_t>(kTile, head_rows - hr0);
    for (int64_t L = 0; L < kTile; ++L) {
      sc.tlim[t * kTile + L] = L < n ? lim[(hr0 + L) / p.group] : -1;
      sc.tlow[t * kTile + L] = L < n ? low[(hr0 + L) / p.group] : 0;
    }
    __m512 v[16];
    for (int d0 = 0; d0 < D / 2; d0 += 16) {  // dword d0 + c of row r0 + L -> qt[t][d0 + c][L]
      for (int L = 0; L < 16; ++L) {
        v[L] = L < n ? _mm512_loadu_ps(reinterpret_cast<const float*>(&sc.qbuf[(r0 + L) * D]) + d0)
                     : _mm512_setzero_ps();
      }
      transpose16(v);
      for (int c = 0; c < 16; ++c) {
        _mm512_storeu_ps(reinterpret_cast<float*>(&sc.qt[(t * (D / 2) + d0 + c) * kTile]), v[c]);
      }
    }
    float* o = &sc.to[t * D * kTile];
    if (!it.resume) {
      for (int L = 0; L < kTile; ++L) {
        sc.tm[t * kTile + L] = -INFINITY;
        sc.tl[t * kTile + L] = 0.f;
      }
      std::memset(o, 0, D * kTile * sizeof(float));
      continue;
    }
    for (int L = 0; L < kTile; ++L) {  // padding lanes: m 0, l 0, O 0
      sc.tm[t * kTile + L] = L < n ? p.gm[sc.qr[r0 + L]] : 0.f;
      sc.tl[t * kTile + L] = L < n ? p.gl[sc.qr[r0 + L]] : 0.f;
    }
    for (int c = 0; c < D / 16; ++c) {
      for (int L = 0; L < 16; ++L) {
        v[L] = L < n ? _mm512_loadu_ps(p.go + sc.qr[r0 + L] * D + 16 * c) : _mm512_setzero_ps();
      }
      transpose16(v);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(o + (16 * c + i) * kTile, v[i]);
    }
  }
}

// One tile over one key block of its head: kblk holds the block's K rows ([key][D] bf16,
// padded keys past nk masked), sc.vpack its V pairs, sc.ks the scores' factor per key and,
// for quantized pools, sc.vs P's factor per key.
template <int D>
void tile_block(Scratch& sc, int64_t t, int64_t kb, int nk, const bf16* kblk, bool quant) {
  const int64_t* lim = &sc.tlim[t * kTile];
  const int64_t* low = &sc.tlow[t * kTile];
  // over the tile's real rows: the least and most last keys, the least and most first keys
  int64_t lo = INT64_MAX, hi = -1, low_min = INT64_MAX, low_max = 0;
  for (int L = 0; L < kTile; ++L) {
    if (lim[L] < 0) continue;
    lo = std::min(lo, lim[L]);
    hi = std::max(hi, lim[L]);
    low_min = std::min(low_min, low[L]);
    low_max = std::max(low_max, low[L]);
  }
  // no row sees a key of the block (all past it, or windows starting after it): every state
  // stays as it is
  if (hi < kb || low_min >= kb + nk) return;
  const int nk16 = (nk + 15) & ~15, npairs = nk16 / 2;
  const bool mask = nk < nk16 || lo < kb + nk - 1 || low_max > kb;
  alignas(64) int32_t rel[16];  // each row's last visible key of the block, -1 for none
  alignas(64) int32_t rlo[16];  // and its first (0: from the block's start)
  for (int L = 0; L < kTile; ++L) {
    rel[L] = static_cast<int32_t>(std::clamp<int64_t>(lim[L] - kb, -1, kKeyBlock));
    rlo[L] = static_cast<int32_t>(std::clamp<int64_t>(low[L] - kb, 0, kKeyBlock));
  }
  const __m512i relv = _mm512_load_si512(rel);
  const __m512i rlov = _mm512_load_si512(rlo);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const int32_t* qt = &sc.qt[t * (D / 2) * kTile];
  const int32_t* kp = reinterpret_cast<const int32_t*>(kblk);  // key j, pair dp: kp[j D / 2 + dp]
  float* st = sc.st.data();
  __m512 bmax = neg_inf;
  for (int j0 = 0; j0 < nk16; j0 += 16) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int dp = 0; dp < D / 2; ++dp) {
      const __m512bh qv = as_bh(_mm512_loadu_si512(qt + dp * kTile));
      for (int j = 0; j < 16; ++j) {
        const __m512i kv = _mm512_set1_epi32(kp[(j0 + j) * (D / 2) + dp]);
        acc[j] = _mm512_dpbf16_ps(acc[j], qv, as_bh(kv));
      }
    }
    for (int j = 0; j < 16; ++j) {
      __m512 s = _mm512_mul_ps(acc[j], _mm512_set1_ps(sc.ks[j0 + j]));
      if (mask) {  // keys rlo .. rel of each row
        const __m512i key = _mm512_set1_epi32(j0 + j);
        const __mmask16 keep = j0 + j < nk ? _mm512_cmpge_epi32_mask(relv, key) &
                                                 _mm512_cmple_epi32_mask(rlov, key)
                                           : __mmask16(0);
        s = _mm512_mask_mov_ps(neg_inf, keep, s);
      }
      bmax = _mm512_max_ps(bmax, s);
      _mm512_storeu_ps(st + (j0 + j) * kTile, s);
    }
  }
  // online softmax: m_new = max(m, block max); rows that have seen nothing keep m = -inf
  float* tm = &sc.tm[t * kTile];
  float* tl = &sc.tl[t * kTile];
  const __m512 m_old = _mm512_loadu_ps(tm);
  const __m512 m_new = _mm512_max_ps(m_old, bmax);
  const __m512 m_use = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ),
                                          _mm512_setzero_ps());
  const __m512 alpha = exp2_ps(_mm512_sub_ps(m_old, m_use));  // m_old = -inf: ~0 times l = 0
  const __m512i pair_idx = _mm512_load_si512(kWordOrders.pairs);
  __m512 lsum = _mm512_setzero_ps();
  for (int jp = 0; jp < npairs; ++jp) {
    const __m512 s0 = _mm512_loadu_ps(st + 2 * jp * kTile);
    const __m512 s1 = _mm512_loadu_ps(st + (2 * jp + 1) * kTile);
    __m512 p0 = exp2_ps(_mm512_sub_ps(s0, m_use));
    __m512 p1 = exp2_ps(_mm512_sub_ps(s1, m_use));
    if (mask) {  // masked keys give exactly 0
      p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, neg_inf, _CMP_NEQ_OQ), p0);
      p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, neg_inf, _CMP_NEQ_OQ), p1);
    }
    lsum = _mm512_add_ps(_mm512_add_ps(lsum, p0), p1);
    if (quant) {  // P V = (P times the V row's scale) times its codes
      p0 = _mm512_mul_ps(p0, _mm512_set1_ps(sc.vs[2 * jp]));
      p1 = _mm512_mul_ps(p1, _mm512_set1_ps(sc.vs[2 * jp + 1]));
    }
    const __m512i pair = _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    _mm512_storeu_si512(&sc.pt[jp * kTile], pair);
  }
  _mm512_storeu_ps(tl, _mm512_fmadd_ps(_mm512_loadu_ps(tl), alpha, lsum));
  _mm512_storeu_ps(tm, m_new);
  // O = O alpha + P V, 16 lane positions at a time
  const int32_t* vp = reinterpret_cast<const int32_t*>(sc.vpack.data());  // pair jp, pos: vp[jp D + pos]
  float* o = &sc.to[t * D * kTile];
  for (int c = 0; c < D / 16; ++c) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_mul_ps(alpha, _mm512_loadu_ps(o + (16 * c + i) * kTile));
    for (int jp = 0; jp < npairs; ++jp) {
      const __m512bh pv = as_bh(_mm512_loadu_si512(&sc.pt[jp * kTile]));
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_dpbf16_ps(acc[i], pv, as_bh(_mm512_set1_epi32(vp[jp * D + 16 * c + i])));
      }
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(o + (16 * c + i) * kTile, acc[i]);
  }
}

// dst[0 .. 32) = bf16 of O's vectors c (ev) and c + 1 (od), c even, in head-dim order. In vpack
// lane order vector c covers the 32-dim chunk c / 2, its lane L holding dim 8 (L / 4) + L % 4,
// plus 4 for the odd (unpackhi) vector; quantized pools pack V in head-dim order (dim 16 c + L).
inline void store_dims32(bf16* dst, __m512 ev, __m512 od, bool quant) {
  __m512i w = (__m512i)_mm512_cvtne2ps_pbh(od, ev);
  if (!quant) w = _mm512_permutexvar_epi16(_mm512_load_si512(kWordOrders.dims), w);
  _mm512_storeu_si512(dst, w);
}

// dst = bf16(o * inv) in head-dim order, for one row's O in vpack lane order.
template <int D>
inline void store_out_row(bf16* dst, const float* o, float inv, bool quant) {
  const __m512 iv = _mm512_set1_ps(inv);
  for (int c = 0; c < D / 16; c += 2) {
    store_dims32(dst + 16 * c, _mm512_mul_ps(iv, _mm512_loadu_ps(o + 16 * c)),
                 _mm512_mul_ps(iv, _mm512_loadu_ps(o + 16 * c + 16)), quant);
  }
}

// The item's tiles done: hand their state to the rows' own parts (phase A), or write O / l in
// bf16, head-dim order.
template <int D>
void tiles_end(const Problem& p, const Item& it, Scratch& sc, int64_t head_rows) {
  const int64_t tph = tiles_per_head(head_rows), nt = it.nh * tph;
  const bool quant = p.quant != Quant::None;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t hr0 = (t % tph) * kTile, r0 = (t / tph) * head_rows + hr0;
    const int64_t n = std::min<int64_t>(kTile, head_rows - hr0);
    const float* o = &sc.to[t * D * kTile];
    __m512 ev[16], od[16];
    if (it.shared) {
      for (int64_t L = 0; L < n; ++L) {
        p.gm[sc.qr[r0 + L]] = sc.tm[t * kTile + L];
        p.gl[sc.qr[r0 + L]] = sc.tl[t * kTile + L];
      }
      for (int c = 0; c < D / 16; ++c) {
        for (int i = 0; i < 16; ++i) ev[i] = _mm512_loadu_ps(o + (16 * c + i) * kTile);
        transpose16(ev);
        for (int64_t L = 0; L < n; ++L) _mm512_storeu_ps(p.go + sc.qr[r0 + L] * D + 16 * c, ev[L]);
      }
      continue;
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(&sc.tl[t * kTile]));
    for (int c = 0; c < D / 16; c += 2) {  // the 32 dims of O's vectors c and c + 1
      for (int i = 0; i < 16; ++i) {
        ev[i] = _mm512_mul_ps(inv, _mm512_loadu_ps(o + (16 * c + i) * kTile));
        od[i] = _mm512_mul_ps(inv, _mm512_loadu_ps(o + (16 * c + 16 + i) * kTile));
      }
      transpose16(ev);
      transpose16(od);
      for (int64_t L = 0; L < n; ++L) {
        store_dims32(p.out + sc.qr[r0 + L] * D + 16 * c, ev[L], od[L], quant);
      }
    }
  }
}

// Queues the K/V rows of the first key block of `it` (the heads it reads): the worker's next
// item, dripped while the current one computes.
inline void prefetch_first_block(const Problem& p, const Item& it, Scratch& sc) {
  sc.next_item.clear();  // empty: every item issues what is left of it when it ends
  const int nk = static_cast<int>(std::min<int64_t>(kKeyBlock, it.k1 - it.k0));
  if (nk <= 0) return;
  sc.knext.resize(kKeyBlock);
  fill_token_offsets(p, p.page_table + it.req * p.table_stride, it.k0, nk, nk,
                     p.hkv * p.row_bytes, sc.knext.data());
  item_rows(p, it, sc.knext.data(), nk, [&](const char* a, int64_t n) { sc.next_item.add(a, n); });
}

// V of one head for the keys at byte offsets `off` of a bf16 pool, in pairs of keys interleaved:
// vpack[jp] = keys 2 jp, 2 jp + 1 for the 16 lanes of each vector (see the output's lane order).
// Padded keys (past nk) repeat a real key with P = 0 exactly; a missing second key of a pair is
// zero.
template <int D>
inline void v_pack_bf16(const char* vbase, const int64_t* off, int nk, int npairs, bf16* vpack) {
  constexpr int QV = D / 32;
  for (int jp = 0; jp < npairs; ++jp) {
    const bool second_valid = 2 * jp + 1 < nk;
    const bf16* va = reinterpret_cast<const bf16*>(vbase + off[2 * jp]);
    const bf16* vb = reinterpret_cast<const bf16*>(vbase + off[2 * jp + 1]);
    bf16* dst = vpack + jp * 2 * D;
    for (int c = 0; c < QV; ++c) {
      const __m512i a = _mm512_loadu_si512(va + 32 * c);
      const __m512i b = second_valid ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 64 * c, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(dst + 64 * c + 32, _mm512_unpackhi_epi16(a, b));
    }
  }
}

// The end of a row's online-softmax step: the running max moves m_old -> m_new, so l and the
// row's O (D floats) scale by exp2(m_old - m_new) (0 while nothing was seen) and l gains the
// block's sum of P, `block_sum`.
template <int D>
inline void rescale_row(float m_old, float m_new, float block_sum, float* m, float* l,
                        float* orow) {
  // exp2_ps, not a libm call per row and block (the polynomial's 2.8e-6 relative error scales
  // O and l alike; 2^0 is exactly 1)
  const float alpha =
      m_old == -INFINITY ? 0.f : _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(m_old - m_new)));
  *l = *l * alpha + block_sum;
  *m = m_new;
  scale_row<D>(alpha, orow);
}

// One row's online-softmax step over a block of scores (srow: nk16 of them, scaled, masked keys
// -inf; bmax their max): m and l updated, the row's O (D floats) rescaled by exp2(m_old - m_new),
// and P = exp2(s - m_new) written to prow in bf16, times vs[j] where vs is given (quantized V's
// row scales); l sums the float32 P before that factor. A row that has seen no key yet gets P = 0.
template <int D>
inline void softmax_step(const float* srow, int nk16, __m512 bmax, const float* vs, float* m,
                         float* l, float* orow, bf16* prow) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const float m_old = *m;
  const float m_new = std::max(m_old, _mm512_reduce_max_ps(bmax));
  if (m_new == -INFINITY) {  // nothing visible yet (cannot happen for block 0)
    std::memset(prow, 0, nk16 * sizeof(bf16));
    return;
  }
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 lsum = _mm512_setzero_ps();
  for (int j0 = 0; j0 < nk16; j0 += 16) {
    const __m512 sv = _mm512_loadu_ps(srow + j0);
    const __mmask16 live = _mm512_cmp_ps_mask(sv, neg_inf, _CMP_NEQ_OQ);
    const __m512 pv = _mm512_maskz_mov_ps(live, exp2_ps(_mm512_sub_ps(sv, mv)));
    lsum = _mm512_add_ps(lsum, pv);
    const __m512 pw = vs != nullptr ? _mm512_mul_ps(pv, _mm512_loadu_ps(vs + j0)) : pv;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j0), (__m256i)_mm512_cvtneps_pbh(pw));
  }
  rescale_row<D>(m_old, m_new, _mm512_reduce_add_ps(lsum), m, l, orow);
}

template <int D>
void run_item_avx512(const Problem& p, const Item& it, const Entries& en, Scratch& sc) {
  constexpr int QV = D / 32;        // bf16 vectors per row
  constexpr int PV_ROWS = kPvRows<D>;  // rows per P.V register tile
  const int64_t G = p.group;
  const int64_t head_rows = it.ne * G;  // rows of one KV head: (entry, g), entry-major
  const int64_t rows = it.nh * head_rows;
  const bool tiles = head_rows >= kGemmRows;  // row tiles, else row by row
  const int64_t tph = tiles_per_head(head_rows);
  const int64_t* tok = en.tok.data() + it.e0;
  const int64_t* lim = en.limit.data() + it.e0;
  const int64_t* low = en.lower.data() + it.e0;
  const int32_t* table = p.page_table + it.req * p.table_stride;
  sc.vpack.resize(kKeyBlock * D);
  sc.koff.resize(kKeyBlock);
  sc.knext.resize(kKeyBlock);
  sc.kq.resize(kKeyBlock * D);
  const bool quant = p.quant != Quant::None;
  if (quant) {
    sc.qoff.resize(kKeyBlock);
    sc.vs.resize(kKeyBlock);
  }
  sc.ks.assign(kKeyBlock, p.scale_log2);
  // Row r of the scratch is q row (tok[e] * hq + (h0 + hh) * G + g) for r = hh * head_rows +
  // e * G + g; its running state starts empty or where the group's shared part left it.
  gather_rows<D>(p, it, tok, sc);
  if (tiles) {
    tiles_begin<D>(p, it, sc, head_rows, lim, low);
  } else {
    sc.s.resize(rows * kKeyBlock);
    sc.pbuf.resize(rows * kKeyBlock);
    sc.o.resize(rows * D);
    sc.m.resize(rows);
    sc.l.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      if (it.resume) {
        const int64_t qr = sc.qr[r];
        sc.m[r] = p.gm[qr];
        sc.l[r] = p.gl[qr];
        std::memcpy(&sc.o[r * D], p.go + qr * D, D * sizeof(float));
      } else {
        sc.m[r] = -INFINITY;
        sc.l[r] = 0.f;
        std::memset(&sc.o[r * D], 0, D * sizeof(float));
      }
    }
  }
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const int64_t token_stride = p.hkv * p.row_bytes;  // bytes
  const int64_t kv_end = it.k1;
  int64_t first_entry = 0;
  for (int64_t kb = it.k0; kb < kv_end; kb += kKeyBlock) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyBlock, kv_end - kb));
    const int nk16 = (nk + 15) & ~15;
    const int npairs = nk16 / 2;
    if (kb == it.k0) fill_token_offsets(p, table, kb, nk, nk16, token_stride, sc.koff.data());
    if (kb + kKeyBlock < kv_end) {
      // Offsets of the next block, and a software prefetch of its K/V rows (the heads of this
      // item), whose pages are scattered over the pool.
      const int nk_next = static_cast<int>(std::min<int64_t>(kKeyBlock, kv_end - kb - kKeyBlock));
      const int nk16_next = (nk_next + 15) & ~15;
      fill_token_offsets(p, table, kb + kKeyBlock, nk_next, nk16_next, token_stride,
                         sc.knext.data());
      // Row tiles compute long enough per block (and a prefill's K/V is mostly cached) for a
      // burst of prefetches now; a few rows (decodes) drip them. (A/B on Zen 4, two builds in
      // one process: dripped, 64 decodes over 96 own tokens with caches flushed took 0.251 ->
      // 0.196 ms, but prefills ran 2-5% slower.)
      if (tiles) {
        item_rows(p, it, sc.knext.data(), nk_next, prefetch_lines);
      } else {
        sc.next_block.issue_all();  // what is left of this block's queue is needed now
        sc.next_block.clear();
        item_rows(p, it, sc.knext.data(), nk_next,
                  [&](const char* a, int64_t n) { sc.next_block.add(a, n); });
      }
    }
    if (quant) {  // offsets into the K code scratch
      for (int j = 0; j < nk16; ++j) sc.qoff[j] = std::min(j, nk - 1) * D * 2;
    }
    // Entries whose last visible key precedes this block see none of it.
    while (first_entry < it.ne && lim[first_entry] < kb) ++first_entry;
    for (int64_t hh = 0; hh < it.nh; ++hh) {
      const int64_t head_off = (it.h0 + hh) * p.row_bytes;
      const char* kbase = p.k_cache + head_off;
      const char* vbase = p.v_cache + head_off;
      const int64_t* koff = sc.koff.data();
      if (quant) {  // K codes into the scratch, V codes straight into vpack, scales aside
        // (ks: sm_scale log2 e times K's scale per key; vs: V's scale per key)
        float* ks = sc.ks.data();
        float* vs = sc.vs.data();
        if (p.quant == Quant::FP8) {
          k_codes_bf16<D, true>(p.k_cache, koff, nk, nk16, head_off, p.scale_log2, sc.kq.data(),
                                ks);
          v_codes_pack<D, true>(p.v_cache, koff, nk, nk16, head_off, sc.vpack.data(), vs);
        } else {
          k_codes_bf16<D, false>(p.k_cache, koff, nk, nk16, head_off, p.scale_log2, sc.kq.data(),
                                 ks);
          v_codes_pack<D, false>(p.v_cache, koff, nk, nk16, head_off, sc.vpack.data(), vs);
        }
        kbase = reinterpret_cast<const char*>(sc.kq.data());
        koff = sc.qoff.data();
      }
      if (tiles) {
        if (!quant) {  // the block's K rows contiguous, V in pairs
          for (int j = 0; j < nk16; ++j) {
            std::memcpy(&sc.kq[j * D], kbase + koff[j], D * sizeof(bf16));
          }
          v_pack_bf16<D>(vbase, koff, nk, npairs, sc.vpack.data());
        }
        for (int64_t t = hh * tph; t < (hh + 1) * tph; ++t) {
          tile_block<D>(sc, t, kb, nk, sc.kq.data(), quant);
        }
        continue;
      }
      const int64_t r_begin = hh * head_rows + first_entry * G;
      const int64_t r_end = (hh + 1) * head_rows;
      // ---- S = Q K^T, scaled, masked; online softmax; P in bf16 -------------------------
      for (int64_t r = r_begin; r < r_end; ++r) {
        float* srow = &sc.s[r * kKeyBlock];
        const int64_t limit = lim[(r - hh * head_rows) / G] - kb;  // last visible key here
        const int64_t first = low[(r - hh * head_rows) / G] - kb;  // first (the window's)
        __m512 bmax = neg_inf;
        __m512i qv[QV];
        for (int c = 0; c < QV; ++c) qv[c] = _mm512_loadu_si512(&sc.qbuf[r * D + 32 * c]);
        for (int j0 = 0; j0 < nk16; j0 += 16) {
          __m512 acc[16];
          for (int j = 0; j < 16; ++j) {
            const bf16* kp = reinterpret_cast<const bf16*>(kbase + koff[j0 + j]);
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < QV; ++c) {
              a = _mm512_dpbf16_ps(a, as_bh(qv[c]), as_bh(_mm512_loadu_si512(kp + 32 * c)));
            }
            acc[j] = a;
          }
          // scaled; the keys past the row's last visible key, and before its first, -inf
          const int64_t valid = std::min<int64_t>({16, nk - j0, limit - j0 + 1});
          const int64_t below = std::clamp<int64_t>(first - j0, 0, 16);
          const __mmask16 keep = (valid >= 16 ? __mmask16(0xffff)
                                              : (valid <= 0 ? __mmask16(0)
                                                            : __mmask16((1u << valid) - 1))) &
                                 static_cast<__mmask16>(~((1u << below) - 1));
          const __m512 sv = _mm512_mask_mov_ps(
              neg_inf, keep, _mm512_mul_ps(reduce16(acc), _mm512_loadu_ps(&sc.ks[j0])));
          _mm512_storeu_ps(srow + j0, sv);
          bmax = _mm512_max_ps(bmax, sv);
          drip(sc, 24);
        }
        // quantized V: P V = (P times the V row's scale) times its codes
        softmax_step<D>(srow, nk16, bmax, quant ? sc.vs.data() : nullptr, &sc.m[r], &sc.l[r],
                        &sc.o[r * D], &sc.pbuf[r * kKeyBlock]);
      }
      if (!quant) v_pack_bf16<D>(vbase, koff, nk, npairs, sc.vpack.data());
      // ---- O += P V -------------------------------------------------------------------------
      for (int64_t rt = r_begin; rt < r_end; rt += PV_ROWS) {
        const int nr = static_cast<int>(std::min<int64_t>(PV_ROWS, r_end - rt));
        pv_rows<D>(sc, rt, nr, npairs);
        drip(sc, 32);
      }
    }
    std::swap(sc.koff, sc.knext);
  }
  sc.next_item.issue_all();  // the worker's next item starts now
  if (tiles) {
    tiles_end<D>(p, it, sc, head_rows);
    return;
  }
  if (it.shared) {  // phase A: hand the rows' state to their own parts
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qr = sc.qr[r];
      p.gm[qr] = sc.m[r];
      p.gl[qr] = sc.l[r];
      std::memcpy(p.go + qr * D, &sc.o[r * D], D * sizeof(float));
    }
    return;
  }
  // ---- out = O / l in bf16, head-dim order (store_out_row) ---------------------------------
  for (int64_t r = 0; r < rows; ++r) {
    store_out_row<D>(p.out + sc.qr[r] * D, &sc.o[r * D], 1.f / sc.l[r], quant);
  }
}

#endif  // RADIXKV_AVX512BF16

// Tokens (or a group's entries) of the next item when `left` remain, `per_item` a block: a last
// block under half of `per_item` joins the one before it (items of up to 1.5 per_item). Cut
// 64 + 9, a 73-token extend over 832 keys repacked every key block's K^T and V for the 9-token
// item's 27 rows (such items ran at about half the 64-token ones' GFLOP/s): one item of 73 took
// 0.90-0.93x the time, a cold multi-turn burst's layer 0.93-0.95x (Xeon model 207, AMX, two
// builds alternated in one process). Splitting evenly (37 + 36) was 1.05x slower than one item.
inline int64_t item_tokens(int64_t left, int64_t per_item) {
  return left < per_item + per_item / 2 ? left : per_item;
}

bool amx_on() {
  if (g_amx_attention < 0) g_amx_attention = amx_available() ? 1 : 0;
  return g_amx_attention == 1;
}

bool fast_path_for(int64_t d) {
#if RADIXKV_AVX512BF16
  return d == 64 || d == 96 || d == 128 || d == 256;
#else
  (void)d;
  return false;
#endif
}

// Runs `items` (see cpu_work.h): the AVX512-BF16 path where the build and head dim have it.
void run_items(const Problem& p, const Entries& en, std::vector<Item>& items, bool fast) {
#if RADIXKV_AVX512BF16
  auto make_scratch = [] { return Scratch{}; };
#else
  auto make_scratch = [] { return 0; };
#endif
  auto run = [&](const Item& it, auto& sc) {
#if RADIXKV_AVX512BF16
    if (fast) {
      if (p.amx && p.quant == Quant::None && it.ne * p.group >= kGemmRows &&
          (p.d == 64 || p.d == 128)) {
        if (p.d == 64) {
          run_item_amx<64>(p, it, en, sc);
        } else {
          run_item_amx<128>(p, it, en, sc);
        }
        return;
      }
      switch (p.d) {
        case 64: run_item_avx512<64>(p, it, en, sc); break;
        case 96: run_item_avx512<96>(p, it, en, sc); break;
        case 128: run_item_avx512<128>(p, it, en, sc); break;
        default: run_item_avx512<256>(p, it, en, sc); break;
      }
      return;
    }
#endif
    (void)fast;
    (void)sc;
    run_item_scalar(p, it, en);
  };
  // a worker's next item: its first key block is prefetched before the current item runs
  auto prefetch = [&](const Item& it, auto& sc) {
#if RADIXKV_AVX512BF16
    if (fast) prefetch_first_block(p, it, sc);
#endif
    (void)it;
    (void)sc;
  };
  radixkv_work::run_longest_first(items, make_scratch, run, prefetch);
}

}  // namespace

// Attention of every new token of a step over the paged KV pool (see the file comment).
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor page_table, std::vector<int64_t> prefix_lens,
                           std::vector<int64_t> extend_lens, std::vector<int64_t> extend_starts,
                           double sm_scale, std::vector<int64_t> group_members,
                           std::vector<int64_t> group_offsets, std::vector<int64_t> group_shared,
                           int64_t window) {
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 &&
                  (kv_type == at::kBFloat16 || kv_type == at::kChar || kv_type == at::kByte) &&
                  v_cache.scalar_type() == kv_type,
              "paged_attention: q must be bfloat16, the caches bfloat16 or quantized (int8, or "
              "uint8 holding float8_e4m3fn bits), both of one dtype");
  const Quant quant =
      kv_type == at::kChar ? Quant::I8 : (kv_type == at::kByte ? Quant::FP8 : Quant::None);
  // q may be a view of the fused QKV rows (each token's [Hq, D] row contiguous, rows strided)
  const radixkv_attn::BatchRules rules{quant == Quant::None ? 0 : radixkv_kvq::kScaleBytes, true,
                                       0};
  const radixkv_attn::PagedBatch batch =
      radixkv_attn::check_paged_batch("paged_attention", q, k_cache, v_cache, page_table,
                                      prefix_lens, extend_lens, extend_starts, window, rules);
  const int64_t B = static_cast<int64_t>(extend_lens.size());
  const int64_t hq = batch.hq, d = batch.d, hkv = batch.hkv;
  const bool fast = fast_path_for(d);
  std::vector<int64_t> shared_of = radixkv_attn::check_prefix_groups(
      "paged_attention", batch, group_members, group_offsets, group_shared);
  if (!fast) std::fill(shared_of.begin(), shared_of.end(), 0);  // the portable path: no groups
  auto out = at::empty(q.sizes(), q.options());  // contiguous, whatever q's row stride
  Problem p{batch};
  p.q = reinterpret_cast<const bf16*>(q.data_ptr<at::BFloat16>());
  p.q_stride = q.is_contiguous() ? q.size(1) * q.size(2) : q.stride(0);
  p.quant = quant;
  p.out = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  p.scale_log2 = static_cast<float>(sm_scale) * kLog2e;
  p.amx = fast && amx_on() && (d == 64 || d == 128);  // AMX items: those head dims
  auto i32 = [](int64_t x) { return static_cast<int32_t>(x); };
  const int64_t rows_per_item = p.amx ? kAmxRowsPerItem : kRowsPerItem;
  const int64_t tok_per_item = std::max<int64_t>(1, rows_per_item / p.group);
  Entries en;
  std::vector<Item> items;
  auto add_entries = [&](int64_t b, int64_t t0, int64_t nt, bool sees_all) {
    const int64_t e0 = static_cast<int64_t>(en.tok.size());
    for (int64_t t = t0; t < t0 + nt; ++t) {
      const int64_t pos = prefix_lens[b] + t;
      en.tok.push_back(extend_starts[b] + t);
      en.limit.push_back(sees_all ? kSeesAll : pos);
      en.lower.push_back(radixkv_attn::window_start(window, pos));
    }
    return e0;
  };
  // The first key any entry of [e0, e0 + ne) sees, from k0 on (at most k1: an item none of
  // whose rows sees its keys still runs, to hand over or finish its rows' state).
  auto first_key = [&](int64_t e0, int64_t ne, int64_t k0, int64_t k1) {
    int64_t lo = k1;
    for (int64_t e = e0; e < e0 + ne; ++e) lo = std::min(lo, en.lower[e]);
    return std::clamp(lo, k0, k1);
  };
  // Phase A: each group's shared keys, once per KV head for blocks of its members' stacked rows.
  std::vector<float> gm, gl, go;
  const bool any_group = std::any_of(shared_of.begin(), shared_of.end(),
                                     [](int64_t s) { return s > 0; });
  if (any_group) {
    gm.resize(q.size(0) * hq);
    gl.resize(q.size(0) * hq);
    go.resize(q.size(0) * hq * d);
    p.gm = gm.data();
    p.gl = gl.data();
    p.go = go.data();
    for (size_t g = 0; g < group_shared.size(); ++g) {
      const int64_t S = group_shared[g];
      if (S == 0) continue;
      const int64_t first = static_cast<int64_t>(en.tok.size());
      for (int64_t mi = group_offsets[g]; mi < group_offsets[g + 1]; ++mi) {
        const int64_t b = group_members[mi];
        add_entries(b, 0, extend_lens[b], true);
      }
      const int64_t last = static_cast<int64_t>(en.tok.size());
      const int64_t ref = group_members[group_offsets[g]];
      for (int64_t e0 = first, ne = 0; e0 < last; e0 += ne) {
        ne = item_tokens(last - e0, tok_per_item);
        const int64_t k0 = first_key(e0, ne, 0, S);
        for (int64_t h = 0; h < hkv; ++h) {
          items.push_back(Item{i32(e0), i32(ne), i32(h), 1, i32(ref), true, false, k0, S,
                               (S - k0) * (ne * p.group + 8)});
        }
      }
    }
    run_items(p, en, items, fast);
    items.clear();
  }
  // Phase B: every request's own keys (shared .. prefix + t, causal). Short extends and decodes:
  // one item covers every KV head of the request, so each token's K/V row (all heads,
  // contiguous) is read once, in order. Longer ones: one item per KV head and block of tokens.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = extend_lens[b], k0 = shared_of[b];
    const bool resume = k0 > 0;
    if (n > 0 && n * hq <= kRowsPerItem) {
      const int64_t e0 = add_entries(b, 0, n, false);
      const int64_t keys = prefix_lens[b] + n, lo = first_key(e0, n, k0, keys);
      items.push_back(Item{i32(e0), i32(n), 0, i32(hkv), i32(b), false, resume, lo, keys,
                           (keys - lo) * (n + 4) * hkv});
      continue;
    }
    for (int64_t t0 = 0, nt = 0; t0 < n; t0 += nt) {
      nt = item_tokens(n - t0, tok_per_item);
      const int64_t keys = prefix_lens[b] + t0 + nt;
      const int64_t e0 = add_entries(b, t0, nt, false);
      const int64_t lo = first_key(e0, nt, k0, keys);
      for (int64_t h = 0; h < hkv; ++h) {
        items.push_back(Item{i32(e0), i32(nt), i32(h), 1, i32(b), false, resume, lo, keys,
                             (keys - lo) * (nt + 4)});
      }
    }
  }
  run_items(p, en, items, fast);
  return out;
}

bool has_fast_path(int64_t head_dim) { return fast_path_for(head_dim); }

bool amx_attention_available() { return amx_available(); }

bool set_amx_attention(bool on) {
  TORCH_CHECK(!on || amx_available(),
              "set_amx_attention: this host or build has no AMX-BF16 (oneDNN finds none, or Linux "
              "refused the tile state)");
  const bool before = amx_on();
  g_amx_attention = on ? 1 : 0;
  return before;
}

int64_t amx_attention_items() { return g_amx_items.load(); }
