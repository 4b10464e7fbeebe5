// AMX items of the bf16 paged-attention kernel (cpu_attention.cpp, whose file comment describes
// the kernel; what its paths share is in cpu_attention_bf16.h), and whether this build and host
// may run radixkv's AMX tile code at all (cpu_amx.h). Compiled for every ISA level; the tile
// code exists only in AVX512-BF16 builds, whose run_items calls run_item_amx for D = 64 and 128.

#include "cpu_attention_bf16.h"
#include "cpu_amx.h"

#include <ATen/native/CPUBlas.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if RADIXKV_AVX512BF16

namespace radixkv_bf16 {
namespace {

// ---- AMX: items with row tiles over bf16 pools, on hosts with AMX-BF16 ----------------------
// The same items, blocks and online softmax as run_item_avx512's row tiles, with both products
// on AMX tiles (TDPBF16PS: bf16 pairs, float32 accumulation), one KV head and one chunk of 32
// query rows (16 for D = 128) at a time, rows in natural layout:
//   S [rows][nk] = Q [rows][D] . K^T     (B operand: K^T in VNNI pairs, [D / 2][nk32][2])
//   O [rows][D] += P [rows][nk] . V      (B operand: V in VNNI pairs, [nk32 / 2][D][2])
// K^T and V of a head's key block are packed once for all the item's chunks; a chunk's scores
// and P stay in L1 between the products, and a chunk skips the keys past its last row's causal
// limit. (oneDNN's brgemm through ATen ran these products before, on all of a head's rows per
// call: the tile code was 7-12% faster on a 16-request burst and 4-8% on a group's shared
// decode rows, level on a 2,048-token prefill, Xeon model 207, alternated in one process.)
// The softmax between them (amx_softmax_tile) computes what the row path's does (scores times
// sm_scale log2 e, keys past the row's limit left out, exp2, P rounded to bf16, l summed from
// the float32 P) in two passes over the scores instead of three. A group's phase-A state is
// handed over in the vpack lane order the other paths use (vpack_dim), so phase A and phase B
// may run on different paths.

// The head dim of position `pos` of O in vpack lane order (see store_dims32, cpu_attention.cpp).
inline int vpack_dim(int pos) {
  const int chunk = pos / 32, odd = (pos % 32) / 16, lane = pos % 16;
  return 32 * chunk + 8 * (lane / 4) + lane % 4 + 4 * odd;
}

// Permutations of one 32-dim chunk between head-dim order and vpack lane order (as indices into
// the pair of vectors (a, b) that _mm512_permutex2var_ps reads): to[i] is the head-dim index
// vpack position i holds (vpack_dim), from[j] the vpack position holding dim j.
struct VpackOrders {
  alignas(64) int32_t to[32];
  alignas(64) int32_t from[32];
  VpackOrders() {
    for (int pos = 0; pos < 32; ++pos) {
      to[pos] = vpack_dim(pos);
      from[vpack_dim(pos)] = pos;
    }
  }
};
const VpackOrders kVpackOrders;

// dst = src with each 32-dim chunk permuted by `order` (dst[c + i] = src[c + order[i]]):
// kVpackOrders.to takes O from head-dim order to vpack lane order, kVpackOrders.from back.
template <int D>
inline void permute_chunks(const int32_t* order, const float* src, float* dst) {
  const __m512i lo = _mm512_load_si512(order), hi = _mm512_load_si512(order + 16);
  for (int c = 0; c < D; c += 32) {
    const __m512 a = _mm512_loadu_ps(src + c), b = _mm512_loadu_ps(src + c + 16);
    _mm512_storeu_ps(dst + c, _mm512_permutex2var_ps(a, lo, b));
    _mm512_storeu_ps(dst + c + 16, _mm512_permutex2var_ps(a, hi, b));
  }
}

// kt = K^T of one head's nk16 keys at byte offsets `off` in VNNI pairs: dword (dp, j) holds
// dims 2 dp, 2 dp + 1 of key j (16 keys' rows of 16 dwords transposed at a time).
template <int D>
inline void amx_pack_k(const char* kbase, const int64_t* off, int nk16, bf16* kt) {
  float* dst = reinterpret_cast<float*>(kt);
  __m512 v[16];
  for (int j0 = 0; j0 < nk16; j0 += 16) {
    for (int d0 = 0; d0 < D / 2; d0 += 16) {
      for (int j = 0; j < 16; ++j) {
        v[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(kbase + off[j0 + j]) + d0);
      }
      transpose16(v);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(dst + (d0 + c) * nk16 + j0, v[c]);
    }
  }
}

// Keys per online-softmax step of an AMX item: larger than the vector path's, so the per-row
// softmax work (reductions, rescale) is spread over more keys. (2,048-token causal prefill, one
// layer, Xeon model 207, with brgemm: 64 keys 21.6 ms, 256 keys 15.3 ms, 512 keys 17.1 ms, the
// vector path 38-46 ms in the same runs; with the tile code 128 keys was slower than 256.)
constexpr int kAmxKeyBlock = 256;
constexpr int kAmxPLd = kAmxKeyBlock + 32;  // bf16 per P row of an AMX chunk

// Word indices interleaving two keys' 32 dims: lo = dims 0-15, hi = 16-31, as (a, b) pairs.
struct PairOrders {
  alignas(64) uint16_t lo[32];
  alignas(64) uint16_t hi[32];
  PairOrders() {
    for (int i = 0; i < 16; ++i) {
      lo[2 * i] = static_cast<uint16_t>(i);
      lo[2 * i + 1] = static_cast<uint16_t>(32 + i);
      hi[2 * i] = static_cast<uint16_t>(16 + i);
      hi[2 * i + 1] = static_cast<uint16_t>(48 + i);
    }
  }
};
const PairOrders kPairOrders;

// vv = V of one head's keys at byte offsets `off` in VNNI pairs: dword (jp, dim) holds keys
// 2 jp, 2 jp + 1 at `dim` (a second key past nk is zero; padded keys get P = 0 anyway).
template <int D>
inline void amx_pack_v(const char* vbase, const int64_t* off, int nk, int nk16, bf16* vv) {
  const __m512i lo = _mm512_load_si512(kPairOrders.lo), hi = _mm512_load_si512(kPairOrders.hi);
  for (int jp = 0; jp < nk16 / 2; ++jp) {
    const bf16* va = reinterpret_cast<const bf16*>(vbase + off[2 * jp]);
    const bf16* vb = reinterpret_cast<const bf16*>(vbase + off[2 * jp + 1]);
    const bool second = 2 * jp + 1 < nk;
    bf16* dst = vv + jp * 2 * D;
    for (int c = 0; c < D / 32; ++c) {
      const __m512i a = _mm512_loadu_si512(va + 32 * c);
      const __m512i b = second ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 64 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + 64 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// P = 2^(s scale - mv) of one row's first `valid` scores (finite; keys past it get P = 0)
// written to prow in bf16, for the nk16 scores of the block; returns their sum (float32 P) as
// a vector of partial sums. Two accumulators, so the sum's add chain does not bound the loop.
inline __m512 amx_exp_row(const float* srow, int gs, int nk16, int valid, __m512 scale,
                         __m512 mv, bf16* prow) {
  const int full = valid & ~15, tail = valid - full;
  __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
  int j0 = 0;
  for (; j0 + 32 <= full; j0 += 32) {
    const __m512 x0 = _mm512_fmsub_ps(_mm512_loadu_ps(srow + j0 / 16 * gs), scale, mv);
    const __m512 x1 = _mm512_fmsub_ps(_mm512_loadu_ps(srow + (j0 / 16 + 1) * gs), scale, mv);
    const __m512 p0 = exp2_finite_ps(x0), p1 = exp2_finite_ps(x1);
    sum0 = _mm512_add_ps(sum0, p0);
    sum1 = _mm512_add_ps(sum1, p1);
    _mm512_storeu_si512(prow + j0, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  for (; j0 < full; j0 += 16) {
    const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(srow + j0 / 16 * gs), scale, mv);
    const __m512 pv = exp2_finite_ps(x);
    sum0 = _mm512_add_ps(sum0, pv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j0), (__m256i)_mm512_cvtneps_pbh(pv));
  }
  if (tail > 0) {
    const __mmask16 keep = static_cast<__mmask16>((1u << tail) - 1);
    const __m512 x = _mm512_maskz_fmsub_ps(keep, _mm512_loadu_ps(srow + full / 16 * gs), scale, mv);
    const __m512 pv = _mm512_maskz_mov_ps(keep, exp2_finite_ps(x));
    sum0 = _mm512_add_ps(sum0, pv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + full), (__m256i)_mm512_cvtneps_pbh(pv));
    j0 = full + 16;
  }
  if (j0 < nk16) std::memset(prow + j0, 0, (nk16 - j0) * sizeof(bf16));
  return _mm512_add_ps(sum0, sum1);
}

// Up to 16 rows' online-softmax step over an AMX item's key block (one row tile of a chunk):
// row i's raw scores Q K^T of the block's nk16 keys lie in 16-key groups at s + i * 16 + g * gs,
// the first valid[i] of them visible (its causal limit); m[i], l[i] and O's row o + i * D are
// its running state, prow + i * kAmxPLd its P (16 rows: those past n get P = 0, for the P V
// product's whole tile). Two passes over each row's scores: the block max
// of the raw scores (scale > 0, so it is scaled once, after), then P = 2^(s scale - m) against
// the new max (amx_exp_row). The rows' maxima and sums are reduced across lanes for all 16 rows
// at once (a transpose), and the rescale factors exp2(m_old - m_new) come from one vector exp2:
// per row, only O's rescale is left. Keys past valid[i] get P = 0; a row that sees none of the
// block keeps its state and gets P = 0. (Keeping m while a block's scores rose at most 8 above
// it, FlashAttention-4's conditional rescale, skipped the max pass for 3-4% more on a burst, but
// its P above 1 are rounded where the max key's P = 1 is exact: mean error +8-14% on random
// rows, and the AMX test's max-error bound against the vector path failed. Not kept.)
template <int D>
inline void amx_softmax_tile(const float* s, int gs, int nk16, const int* valid, int n,
                             __m512 scale, float* m, float* l, float* o, bf16* prow) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 v[16];
  for (int i = 0; i < 16; ++i) {  // each row's lane-wise max of its visible scores
    const int vi = i < n ? valid[i] : 0;
    const float* srow = s + i * 16;
    const int full = vi & ~15, tail = vi - full;
    __m512 b0 = neg_inf, b1 = neg_inf;
    int j0 = 0;
    for (; j0 + 32 <= full; j0 += 32) {
      b0 = _mm512_max_ps(b0, _mm512_loadu_ps(srow + j0 / 16 * gs));
      b1 = _mm512_max_ps(b1, _mm512_loadu_ps(srow + (j0 / 16 + 1) * gs));
    }
    if (j0 < full) b0 = _mm512_max_ps(b0, _mm512_loadu_ps(srow + j0 / 16 * gs));
    if (tail > 0) {
      const __mmask16 keep = static_cast<__mmask16>((1u << tail) - 1);
      b0 = _mm512_mask_max_ps(b0, keep, b0, _mm512_loadu_ps(srow + full / 16 * gs));
    }
    v[i] = _mm512_max_ps(b0, b1);
  }
  transpose16(v);  // v[c] lane i = row i's lane c
  __m512 bmax = v[0];
  for (int c = 1; c < 16; ++c) bmax = _mm512_max_ps(bmax, v[c]);
  const __mmask16 rows = static_cast<__mmask16>((1u << n) - 1);
  const __m512 m_old = _mm512_mask_loadu_ps(neg_inf, rows, m);
  const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(bmax, scale));
  alignas(64) float mn[16];
  _mm512_store_ps(mn, m_new);
  for (int i = 0; i < 16; ++i) {  // P and each row's lane-wise sum of it (rows past n: P = 0)
    const int vi = i < n ? valid[i] : 0;
    if (vi == 0) {
      std::memset(prow + i * kAmxPLd, 0, nk16 * sizeof(bf16));
      v[i] = _mm512_setzero_ps();
      continue;
    }
    v[i] = amx_exp_row(s + i * 16, gs, nk16, vi, scale, _mm512_set1_ps(mn[i]), prow + i * kAmxPLd);
  }
  const __m512 sum = reduce16(v);
  // alpha = exp2(m_old - m_new), 0 while a row has seen nothing (m_old = -inf); 2^0 is exactly
  // 1, so a row whose max held keeps its O unscaled
  const __mmask16 seen = _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ);
  const __m512 alpha = _mm512_maskz_mov_ps(seen, exp2_ps(_mm512_sub_ps(m_old, m_new)));
  const __m512 l_new = _mm512_fmadd_ps(_mm512_mask_loadu_ps(_mm512_setzero_ps(), rows, l), alpha, sum);
  _mm512_mask_storeu_ps(l, rows, l_new);
  _mm512_mask_storeu_ps(m, rows, m_new);
  alignas(64) float al[16];
  _mm512_store_ps(al, alpha);
  for (int i = 0; i < n; ++i) scale_row<D>(al[i], o + i * D);
}

// Query rows per chunk of an AMX item's head: the chunk's scores and P stay in L1 between the
// two products. Two row tiles for D = 64 (their four Q tiles stay loaded across the key tiles),
// one for D = 128 (its four Q tiles are one row tile's).
template <int D>
constexpr int amx_chunk_rows() {
  return D == 64 ? 32 : 16;
}

// Tiles 6 and 7 (scores of key groups j and j + 16, one row tile) += Q tile A . the K^T pairs
// of 16 dim pairs at k (key j; k + 32 is key j + 16), through B tiles 4 and 5. A macro: GCC's
// tile intrinsics paste their tile numbers into the instruction's text.
#define RADIXKV_AMX_QK_TWO_GROUPS(A, k, kstride) \
  do {                                           \
    _tile_loadd(4, (k), (kstride));              \
    _tile_loadd(5, (k) + 32, (kstride));         \
    _tile_dpbf16ps(6, A, 4);                     \
    _tile_dpbf16ps(7, A, 5);                     \
  } while (0)

// S of one chunk = Q K^T, in 16-key groups: the scores of key 16 g + c for the chunk's row r at
// s[(g * CR + r) * 16 + c] (CR = the chunk's rows), so each tile's store is one contiguous 1 KiB
// (row-strided stores ran at about half the rate). q is the chunk's first row ([row][D] bf16,
// rows past the chunk readable), kt the head's K^T pairs ([D / 2][ldk][2]), nkeys a multiple of
// 32 (<= ldk).
template <int D>
RADIXKV_AMX_TARGET inline void amx_scores(const bf16* q, int rt_n, const bf16* kt, int ldk,
                                          int nkeys, float* s) {
  static_assert(D == 64 || D == 128, "AMX items take head dims 64 and 128");
  constexpr int CR = amx_chunk_rows<D>();
  const int kstride = ldk * 4;
  _tile_loadd(0, q, D * 2);  // Q's first row tile, 32 dims a tile
  _tile_loadd(1, q + 32, D * 2);
  if constexpr (D == 128) {
    _tile_loadd(2, q + 64, D * 2);
    _tile_loadd(3, q + 96, D * 2);
  } else if (rt_n == 2) {  // D = 64: the second row tile's Q too
    _tile_loadd(2, q + 16 * D, D * 2);
    _tile_loadd(3, q + 16 * D + 32, D * 2);
    for (int j = 0; j < nkeys; j += 16) {  // the two row tiles' chains interleaved
      float* sg = s + j * CR;
      _tile_zero(6);
      _tile_zero(7);
      _tile_loadd(4, kt + 2 * j, kstride);              // dim pairs 0-15
      _tile_dpbf16ps(6, 0, 4);
      _tile_dpbf16ps(7, 2, 4);
      _tile_loadd(5, kt + 2 * (16 * ldk + j), kstride);  // dim pairs 16-31
      _tile_dpbf16ps(6, 1, 5);
      _tile_dpbf16ps(7, 3, 5);
      _tile_stored(6, sg, 64);
      _tile_stored(7, sg + 256, 64);
    }
    return;
  }
  for (int j = 0; j < nkeys; j += 32) {  // one row tile: two key groups' chains interleaved
    _tile_zero(6);
    _tile_zero(7);
    RADIXKV_AMX_QK_TWO_GROUPS(0, kt + 2 * j, kstride);
    RADIXKV_AMX_QK_TWO_GROUPS(1, kt + 2 * (16 * ldk + j), kstride);
    if constexpr (D == 128) {
      RADIXKV_AMX_QK_TWO_GROUPS(2, kt + 2 * (32 * ldk + j), kstride);
      RADIXKV_AMX_QK_TWO_GROUPS(3, kt + 2 * (48 * ldk + j), kstride);
    }
    _tile_stored(6, s + j * CR, 64);
    _tile_stored(7, s + (j + 16) * CR, 64);
  }
}

// O [16 rt_n rows][D] += P V for one chunk: p its P rows ([row][kAmxPLd] bf16, zero past each
// row's visible keys and for rows past the chunk), vv the head's V pairs ([nkeys / 2][D][2]),
// o the chunk's first O row ([row][D] float32, 16 rt_n rows writable), nkeys a multiple of 32.
template <int D>
RADIXKV_AMX_TARGET inline void amx_accumulate(const bf16* p, int rt_n, const bf16* vv,
                                              int nkeys, float* o) {
  constexpr int ostride = D * 4, vstride = D * 4;
  for (int rt = 0; rt < rt_n; ++rt) {
    const bf16* prt = p + rt * 16 * kAmxPLd;
    for (int d0 = 0; d0 < D; d0 += 64) {
      float* ot = o + rt * 16 * D + d0;
      _tile_loadd(0, ot, ostride);
      _tile_loadd(1, ot + 16, ostride);
      _tile_loadd(2, ot + 32, ostride);
      _tile_loadd(3, ot + 48, ostride);
      for (int kk = 0; kk < nkeys; kk += 32) {
        const bf16* vb = vv + kk * D + 2 * d0;  // key pair kk / 2, dim d0
        _tile_loadd(4, prt + kk, kAmxPLd * 2);
        _tile_loadd(5, vb, vstride);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, vb + 32, vstride);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, vb + 64, vstride);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, vb + 96, vstride);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, ot, ostride);
      _tile_stored(1, ot + 16, ostride);
      _tile_stored(2, ot + 32, ostride);
      _tile_stored(3, ot + 48, ostride);
    }
  }
}

}  // namespace

template <int D>
RADIXKV_AMX_TARGET void run_item_amx(const Problem& p, const Item& it, const Entries& en,
                                     Scratch& sc) {
  constexpr int KB = kAmxKeyBlock, CR = amx_chunk_rows<D>();
  const int64_t G = p.group;
  const int64_t head_rows = it.ne * G;
  const int64_t head_pad = (head_rows + 15) & ~int64_t{15};  // O rows per head, tiles whole
  const int64_t rows = it.nh * head_rows;
  const int64_t* tok = en.tok.data() + it.e0;
  const int64_t* lim = en.limit.data() + it.e0;
  const int64_t* low = en.lower.data() + it.e0;
  const int32_t* table = p.page_table + it.req * p.table_stride;
  sc.s.resize(CR * KB);
  sc.pbuf.resize(CR * kAmxPLd);
  sc.o.resize(it.nh * head_pad * D);
  sc.m.resize(rows);
  sc.l.resize(rows);
  sc.koff.resize(KB);
  sc.knext.resize(KB);
  sc.kt.resize(D * KB);
  sc.vv.resize(KB * D);
  gather_rows<D>(p, it, tok, sc);
  sc.qbuf.resize((rows + 16) * D);  // a last partial row tile reads zeros past the rows
  auto orow = [&](int64_t r) { return &sc.o[((r / head_rows) * head_pad + r % head_rows) * D]; };
  for (int64_t hh = 0; hh < it.nh; ++hh) {  // a partial tile's missing rows: O = 0, never read
    std::memset(&sc.o[(hh * head_pad + head_rows) * D], 0, (head_pad - head_rows) * D * sizeof(float));
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = orow(r);
    if (it.resume) {  // phase A's state, O from vpack lane order
      const int64_t qr = sc.qr[r];
      sc.m[r] = p.gm[qr];
      sc.l[r] = p.gl[qr];
      permute_chunks<D>(kVpackOrders.from, p.go + qr * D, o);
    } else {
      sc.m[r] = -INFINITY;
      sc.l[r] = 0.f;
      std::memset(o, 0, D * sizeof(float));
    }
  }
  const __m512 scale = _mm512_set1_ps(p.scale_log2);
  const int64_t token_stride = p.hkv * p.row_bytes;
  sc.amx_used = true;
  _tile_loadconfig(&radixkv_amx::kTileConfig);
  g_amx_items.fetch_add(1, std::memory_order_relaxed);
  for (int64_t kb = it.k0; kb < it.k1; kb += KB) {
    const int nk = static_cast<int>(std::min<int64_t>(KB, it.k1 - kb));
    const int nk32 = (nk + 31) & ~31;
    if (kb == it.k0) fill_token_offsets(p, table, kb, nk, nk32, token_stride, sc.koff.data());
    if (kb + KB < it.k1) {
      const int nk_next = static_cast<int>(std::min<int64_t>(KB, it.k1 - kb - KB));
      fill_token_offsets(p, table, kb + KB, nk_next, (nk_next + 31) & ~31, token_stride,
                         sc.knext.data());
      item_rows(p, it, sc.knext.data(), nk_next, prefetch_lines);
    }
    for (int64_t hh = 0; hh < it.nh; ++hh) {
      const int64_t head_off = (it.h0 + hh) * p.row_bytes;
      amx_pack_k<D>(p.k_cache + head_off, sc.koff.data(), nk32, sc.kt.data());
      amx_pack_v<D>(p.v_cache + head_off, sc.koff.data(), nk, nk32, sc.vv.data());
      for (int64_t c0 = 0; c0 < head_rows; c0 += CR) {
        const int64_t cr = std::min<int64_t>(CR, head_rows - c0);
        // rows see nondecreasing limits: the chunk's last row sees the most keys
        const int nkc = static_cast<int>(std::clamp<int64_t>(lim[(c0 + cr - 1) / G] - kb + 1, 0, nk));
        if (nkc == 0) continue;  // no row of the chunk sees this block yet
        if (p.window > 0) {  // nor when every row's window starts past the chunk's keys
          int64_t low_min = INT64_MAX;
          for (int64_t i = 0; i < cr; ++i) low_min = std::min(low_min, low[(c0 + i) / G]);
          if (low_min - kb >= nkc) continue;
        }
        const int np = (nkc + 31) & ~31;
        const int rt_n = static_cast<int>((cr + 15) / 16);
        const int64_t r0 = hh * head_rows + c0;
        amx_scores<D>(&sc.qbuf[r0 * D], rt_n, sc.kt.data(), nk32, np, sc.s.data());
        for (int rt = 0; rt < rt_n; ++rt) {
          const int64_t i0 = 16 * rt;
          const int n = static_cast<int>(std::min<int64_t>(16, cr - i0));
          int valid[16];
          for (int i = 0; i < n; ++i) {
            const int64_t e = (c0 + i0 + i) / G;
            valid[i] = static_cast<int>(std::clamp<int64_t>(lim[e] - kb + 1, 0, nkc));
            // keys before the row's window: a score of -1e30 (finite: amx_softmax_tile's exp2
            // takes finite arguments) leaves the row's max to its visible keys and gives P = 0
            // (2^(-1e30 scale - m) is 0 for any scale above 1e-27); none visible: valid 0
            const int first = static_cast<int>(std::clamp<int64_t>(low[e] - kb, 0, nkc));
            if (first >= valid[i]) {
              valid[i] = 0;
              continue;
            }
            float* srow = &sc.s[(i0 + i) * 16];  // key j at srow[(j / 16) CR 16 + j % 16]
            for (int j = 0; j < first; ++j) srow[(j / 16) * CR * 16 + j % 16] = -1e30f;
          }
          amx_softmax_tile<D>(&sc.s[i0 * 16], CR * 16, np, valid, n, scale, &sc.m[r0 + i0],
                              &sc.l[r0 + i0], orow(r0 + i0), &sc.pbuf[i0 * kAmxPLd]);
        }
        amx_accumulate<D>(sc.pbuf.data(), rt_n, sc.vv.data(), np,
                          &sc.o[(hh * head_pad + c0) * D]);
      }
    }
    std::swap(sc.koff, sc.knext);
  }
  sc.next_item.issue_all();
  if (it.shared) {  // phase A: hand the rows' state over, O in vpack lane order
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qr = sc.qr[r];
      p.gm[qr] = sc.m[r];
      p.gl[qr] = sc.l[r];
      permute_chunks<D>(kVpackOrders.to, orow(r), p.go + qr * D);
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {  // out = O / l in bf16
    const __m512 inv = _mm512_set1_ps(1.f / sc.l[r]);
    const float* o = orow(r);
    bf16* dst = p.out + sc.qr[r] * D;
    for (int c = 0; c < D / 16; ++c) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(o + 16 * c))));
    }
  }
}

template void run_item_amx<64>(const Problem& p, const Item& it, const Entries& en, Scratch& sc);
template void run_item_amx<128>(const Problem& p, const Item& it, const Entries& en, Scratch& sc);

}  // namespace radixkv_bf16

#endif  // RADIXKV_AVX512BF16

// (cpu_amx.h) Asked once, by whichever AMX user comes first.
bool amx_tiles_permitted() {
#if RADIXKV_AVX512BF16 && defined(__linux__) && defined(SYS_arch_prctl)
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

bool amx_available() {
#if RADIXKV_AVX512BF16
  return at::native::cpublas::could_pack(at::kBFloat16) && amx_tiles_permitted();
#else
  return false;
#endif
}
