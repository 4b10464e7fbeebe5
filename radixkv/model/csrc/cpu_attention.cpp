// Paged attention for the CPU, reading K/V in place from the paged pool.
//
// One call per layer serves every request of a step: decodes (one new token after a cached
// prefix), extends (new tokens after a cached prefix) and fresh prefills (nothing cached). Query
// token t of request b (absolute position prefix_b + t) attends to keys 0 .. prefix_b + t of that
// request, which live in the pages page_table[b][pos / page_size] at slot pos % page_size. The new
// tokens' K/V must already be stored in the pool.
//
// Work is split into items (request, block of query tokens, KV head); the G query heads of a KV
// head are folded into the item's rows, so every key is loaded once for all of them. Within an
// item keys are visited in blocks with an online softmax (running max m, running sum l):
//   S = Q K^T  (bf16 dot products, float32 accumulation; AVX512-BF16 vdpbf16ps)
//   P = exp2((S * scale * log2 e) - m)          (float32, then bf16 for the P V product)
//   O = O * exp2(m_old - m_new) + P V           (float32 accumulators)
// and the output is O / l in bf16. Items run on torch's intra-op threads, longest first, taken
// from a shared counter so causal prefills (whose later blocks cost more) balance.
//
// A portable scalar path (any CPU, any head dim) computes the same thing; the AVX512 path needs a
// head dim that is a multiple of 32 and at most 256.

#include "cpu_attention.h"

#include <ATen/Parallel.h>

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

namespace {

using bf16 = uint16_t;

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kKeyBlock = 64;   // keys per online-softmax step
constexpr int kRowsPerItem = 96;  // query rows (tokens x G heads) per work item

inline float bf16_to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline bf16 float_to_bf16(float f) {  // round to nearest even (NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

struct Problem {
  const bf16* q;
  const bf16* k_cache;
  const bf16* v_cache;
  const int32_t* page_table;
  bf16* out;
  int64_t table_stride;
  int64_t page_size;
  int64_t hq, hkv, group, d;
  float scale_log2;  // sm_scale * log2(e)
  const std::vector<int64_t>* prefix;
  const std::vector<int64_t>* start;
};

struct Item {
  int32_t req;
  int32_t t0;  // first query token (relative to the request's new tokens)
  int32_t nt;  // query tokens in this item
  int32_t h0;  // first KV head
  int32_t nh;  // KV heads in this item
  int64_t cost;
};

// Offset (in elements) of key `pos` of request `b`, KV head `h`, in the cache.
inline int64_t key_offset(const Problem& p, int64_t b, int64_t pos, int64_t h) {
  const int64_t page = p.page_table[b * p.table_stride + pos / p.page_size];
  return ((page * p.page_size + pos % p.page_size) * p.hkv + h) * p.d;
}

// ------------------------------------------------------------------------------------------
// Portable path
// ------------------------------------------------------------------------------------------

void run_item_scalar(const Problem& p, const Item& it) {
  const int64_t d = p.d, G = p.group;
  const int64_t prefix = (*p.prefix)[it.req];
  const int64_t qstart = (*p.start)[it.req];
  std::vector<float> qrow(d), acc(d), scores;
  for (int64_t ti = 0; ti < it.nt; ++ti) {
    const int64_t tok = qstart + it.t0 + ti;
    const int64_t nkeys = prefix + it.t0 + ti + 1;
    scores.resize(nkeys);
    for (int64_t g = 0; g < it.nh * G; ++g) {
      const int64_t kvh = it.h0 + g / G;
      const int64_t qh = it.h0 * G + g;
      const bf16* qp = p.q + (tok * p.hq + qh) * d;
      for (int64_t i = 0; i < d; ++i) qrow[i] = bf16_to_float(qp[i]);
      float mx = -INFINITY;
      for (int64_t j = 0; j < nkeys; ++j) {
        const bf16* kp = p.k_cache + key_offset(p, it.req, j, kvh);
        float s = 0.f;
        for (int64_t i = 0; i < d; ++i) s += qrow[i] * bf16_to_float(kp[i]);
        scores[j] = s * p.scale_log2;
        mx = std::max(mx, scores[j]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float l = 0.f;
      for (int64_t j = 0; j < nkeys; ++j) {
        const float w = std::exp2(scores[j] - mx);
        l += w;
        const bf16* vp = p.v_cache + key_offset(p, it.req, j, kvh);
        for (int64_t i = 0; i < d; ++i) acc[i] += w * bf16_to_float(vp[i]);
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

// 2^x for x <= 0 (clamped at -127): x = n + f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.5403530393381606e-4f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146428443e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076284772e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

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

// Per-thread scratch (grow-only).
struct Scratch {
  std::vector<bf16> qbuf;     // [rows][D]
  std::vector<float> s;       // [rows][kKeyBlock]
  std::vector<bf16> pbuf;     // [rows][kKeyBlock]
  std::vector<bf16> vpack;    // [kKeyBlock / 2][D][2], pairs of keys interleaved
  std::vector<float> o;       // [rows][D], lanes in vpack order
  std::vector<float> m, l;    // [rows]
  std::vector<int64_t> koff;   // [kKeyBlock] token row offsets of this key block
  std::vector<int64_t> knext;  // [kKeyBlock] those of the next block
};

// Element offsets of the token rows kb .. kb + nk - 1 of request `req` (padded to nk16 by
// repeating the last), walking its page table without a division per key.
inline void fill_token_offsets(const Problem& p, int64_t req, int64_t kb, int nk, int nk16,
                               int64_t token_stride, int64_t* dst) {
  const int32_t* row = p.page_table + req * p.table_stride;
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

template <int D>
void run_item_avx512(const Problem& p, const Item& it, Scratch& sc) {
  constexpr int QV = D / 32;        // bf16 vectors per row
  constexpr int OV = D / 16;        // float32 vectors per row
  constexpr int PV_ROWS = 24 / OV;  // rows per P.V register tile
  const int64_t G = p.group;
  const int64_t head_rows = it.nt * G;  // rows of one KV head: (token, g), token-major
  const int64_t rows = it.nh * head_rows;
  const int64_t prefix = (*p.prefix)[it.req];
  const int64_t qstart = (*p.start)[it.req];
  const int64_t kv_end = prefix + it.t0 + it.nt;  // keys seen by the last row
  sc.qbuf.resize(rows * D);
  sc.s.resize(rows * kKeyBlock);
  sc.pbuf.resize(rows * kKeyBlock);
  sc.vpack.resize(kKeyBlock * D);
  sc.o.assign(rows * D, 0.f);
  sc.m.assign(rows, -INFINITY);
  sc.l.assign(rows, 0.f);
  sc.koff.resize(kKeyBlock);
  sc.knext.resize(kKeyBlock);
  for (int64_t hh = 0; hh < it.nh; ++hh) {
    for (int64_t ti = 0; ti < it.nt; ++ti) {
      const bf16* src = p.q + ((qstart + it.t0 + ti) * p.hq + (it.h0 + hh) * G) * D;
      std::memcpy(&sc.qbuf[(hh * head_rows + ti * G) * D], src, G * D * sizeof(bf16));
    }
  }
  const __m512 scale = _mm512_set1_ps(p.scale_log2);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const int64_t token_stride = p.hkv * D;
  for (int64_t kb = 0; kb < kv_end; kb += kKeyBlock) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyBlock, kv_end - kb));
    const int nk16 = (nk + 15) & ~15;
    const int npairs = nk16 / 2;
    if (kb == 0) fill_token_offsets(p, it.req, 0, nk, nk16, token_stride, sc.koff.data());
    if (kb + kKeyBlock < kv_end) {
      // Offsets of the next block, and a software prefetch of its K/V rows (the heads of this
      // item), whose pages are scattered over the pool (neutral on the 2-core reference host,
      // where this loop is bound by its reductions rather than by memory).
      const int nk_next = static_cast<int>(std::min<int64_t>(kKeyBlock, kv_end - kb - kKeyBlock));
      const int nk16_next = (nk_next + 15) & ~15;
      fill_token_offsets(p, it.req, kb + kKeyBlock, nk_next, nk16_next, token_stride,
                         sc.knext.data());
      const int64_t first = it.h0 * D * 2, bytes = it.nh * D * 2;  // byte range of a row
      for (int j = 0; j < nk_next; ++j) {
        const char* kr = reinterpret_cast<const char*>(p.k_cache + sc.knext[j]) + first;
        const char* vr = reinterpret_cast<const char*>(p.v_cache + sc.knext[j]) + first;
        for (int64_t off = 0; off < bytes; off += 64) {
          _mm_prefetch(kr + off, _MM_HINT_T0);
          _mm_prefetch(vr + off, _MM_HINT_T0);
        }
      }
    }
    // Tokens whose last visible key precedes this block see none of it.
    const int64_t first_tok = std::max<int64_t>(0, kb - prefix - it.t0);
    for (int64_t hh = 0; hh < it.nh; ++hh) {
      const int64_t head_off = (it.h0 + hh) * D;
      const bf16* kbase = p.k_cache + head_off;
      const bf16* vbase = p.v_cache + head_off;
      const int64_t r_begin = hh * head_rows + first_tok * G;
      const int64_t r_end = (hh + 1) * head_rows;
      // ---- S = Q K^T, scaled, masked; online softmax; P in bf16 -------------------------
      for (int64_t r = r_begin; r < r_end; ++r) {
        __m512i qv[QV];
        for (int c = 0; c < QV; ++c) qv[c] = _mm512_loadu_si512(&sc.qbuf[r * D + 32 * c]);
        const int64_t ti = (r - hh * head_rows) / G;
        const int64_t limit = prefix + it.t0 + ti - kb;  // last visible key in this block
        float* srow = &sc.s[r * kKeyBlock];
        __m512 bmax = neg_inf;
        for (int j0 = 0; j0 < nk16; j0 += 16) {
          __m512 acc[16];
          for (int j = 0; j < 16; ++j) {
            const bf16* kp = kbase + sc.koff[j0 + j];
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < QV; ++c) {
              a = _mm512_dpbf16_ps(a, as_bh(qv[c]), as_bh(_mm512_loadu_si512(kp + 32 * c)));
            }
            acc[j] = a;
          }
          __m512 sv = _mm512_mul_ps(reduce16(acc), scale);
          const int64_t valid = std::min<int64_t>({16, nk - j0, limit - j0 + 1});
          const __mmask16 keep =
              valid >= 16 ? __mmask16(0xffff)
                          : (valid <= 0 ? __mmask16(0) : __mmask16((1u << valid) - 1));
          sv = _mm512_mask_mov_ps(neg_inf, keep, sv);
          _mm512_storeu_ps(srow + j0, sv);
          bmax = _mm512_max_ps(bmax, sv);
        }
        const float m_old = sc.m[r];
        const float m_new = std::max(m_old, _mm512_reduce_max_ps(bmax));
        bf16* prow = &sc.pbuf[r * kKeyBlock];
        if (m_new == -INFINITY) {  // nothing visible yet (cannot happen for block 0)
          std::memset(prow, 0, nk16 * sizeof(bf16));
          continue;
        }
        const __m512 mv = _mm512_set1_ps(m_new);
        __m512 lsum = _mm512_setzero_ps();
        for (int j0 = 0; j0 < nk16; j0 += 16) {
          const __m512 sv = _mm512_loadu_ps(srow + j0);
          const __mmask16 live = _mm512_cmp_ps_mask(sv, neg_inf, _CMP_NEQ_OQ);
          const __m512 pv = _mm512_maskz_mov_ps(live, exp2_ps(_mm512_sub_ps(sv, mv)));
          lsum = _mm512_add_ps(lsum, pv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j0),
                              (__m256i)_mm512_cvtneps_pbh(pv));
        }
        const float alpha = m_old == -INFINITY ? 0.f : std::exp2(m_old - m_new);
        sc.l[r] = sc.l[r] * alpha + _mm512_reduce_add_ps(lsum);
        sc.m[r] = m_new;
        if (alpha != 1.f) {
          float* orow = &sc.o[r * D];
          const __m512 av = _mm512_set1_ps(alpha);
          for (int c = 0; c < OV; ++c) {
            _mm512_storeu_ps(orow + 16 * c, _mm512_mul_ps(av, _mm512_loadu_ps(orow + 16 * c)));
          }
        }
      }
      // ---- V pairs interleaved: vpack[jp][c] = keys 2jp, 2jp+1 for 16 lanes of vector c --
      // Padded keys (past nk) repeat a real key with P = 0 exactly; a missing second key of a
      // pair is zero.
      for (int jp = 0; jp < npairs; ++jp) {
        const bool second_valid = 2 * jp + 1 < nk;
        const bf16* va = vbase + sc.koff[2 * jp];
        const bf16* vb = vbase + sc.koff[2 * jp + 1];
        bf16* dst = &sc.vpack[jp * 2 * D];
        for (int c = 0; c < QV; ++c) {
          const __m512i a = _mm512_loadu_si512(va + 32 * c);
          const __m512i b =
              second_valid ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
          _mm512_storeu_si512(dst + 64 * c, _mm512_unpacklo_epi16(a, b));
          _mm512_storeu_si512(dst + 64 * c + 32, _mm512_unpackhi_epi16(a, b));
        }
      }
      // ---- O += P V -------------------------------------------------------------------------
      for (int64_t rt = r_begin; rt < r_end; rt += PV_ROWS) {
        const int nr = static_cast<int>(std::min<int64_t>(PV_ROWS, r_end - rt));
        __m512 acc[PV_ROWS][OV];
        for (int i = 0; i < nr; ++i) {
          for (int c = 0; c < OV; ++c) {
            acc[i][c] = _mm512_loadu_ps(&sc.o[(rt + i) * D + 16 * c]);
          }
        }
        for (int jp = 0; jp < npairs; ++jp) {
          __m512i vv[OV];
          for (int c = 0; c < OV; ++c) {
            vv[c] = _mm512_loadu_si512(&sc.vpack[jp * 2 * D + 32 * c]);
          }
          for (int i = 0; i < nr; ++i) {
            int32_t pair;
            std::memcpy(&pair, &sc.pbuf[(rt + i) * kKeyBlock + 2 * jp], sizeof(pair));
            const __m512i pb = _mm512_set1_epi32(pair);
            for (int c = 0; c < OV; ++c) {
              acc[i][c] = _mm512_dpbf16_ps(acc[i][c], as_bh(pb), as_bh(vv[c]));
            }
          }
        }
        for (int i = 0; i < nr; ++i) {
          for (int c = 0; c < OV; ++c) {
            _mm512_storeu_ps(&sc.o[(rt + i) * D + 16 * c], acc[i][c]);
          }
        }
      }
    }
    std::swap(sc.koff, sc.knext);
  }
  // ---- out = O / l, lanes back in head-dim order ------------------------------------------
  // Vector c covers the 32-dim chunk c / 2; its lane L holds dim 8 * (L / 4) + L % 4, plus 4
  // for the odd (unpackhi) vector.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t hh = r / head_rows, ti = (r % head_rows) / G, g = r % G;
    bf16* dst = p.out + ((qstart + it.t0 + ti) * p.hq + (it.h0 + hh) * G + g) * D;
    const float inv = 1.f / sc.l[r];
    const float* orow = &sc.o[r * D];
    for (int c = 0; c < OV; ++c) {
      for (int lane = 0; lane < 16; ++lane) {
        const int dim = 32 * (c / 2) + 8 * (lane / 4) + 4 * (c % 2) + lane % 4;
        dst[dim] = float_to_bf16(orow[16 * c + lane] * inv);
      }
    }
  }
}

#endif  // RADIXKV_AVX512BF16

bool fast_path_for(int64_t d) {
#if RADIXKV_AVX512BF16
  return d == 64 || d == 128;
#else
  (void)d;
  return false;
#endif
}

}  // namespace

// Attention of every new token of a step over the paged KV pool (see the file comment).
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor page_table, std::vector<int64_t> prefix_lens,
                              std::vector<int64_t> extend_lens,
                              std::vector<int64_t> extend_starts, double sm_scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: tensors must be on the CPU");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "paged_attention: q and the caches must be bfloat16");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: q [T, Hq, D], caches [pages, page_size, Hkv, D]");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2,
              "paged_attention: page_table must be int32 [B, max_pages]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  page_table.is_contiguous(),
              "paged_attention: inputs must be contiguous");
  const int64_t B = static_cast<int64_t>(extend_lens.size());
  TORCH_CHECK(static_cast<int64_t>(prefix_lens.size()) == B &&
                  static_cast<int64_t>(extend_starts.size()) == B && page_table.size(0) >= B,
              "paged_attention: one prefix_len, extend_len, extend_start and page row per request");
  const int64_t hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0, "paged_attention: head shapes disagree");
  const int64_t page_size = k_cache.size(1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t total = prefix_lens[b] + extend_lens[b];
    TORCH_CHECK(extend_lens[b] >= 0 && prefix_lens[b] >= 0 &&
                    extend_starts[b] + extend_lens[b] <= q.size(0) &&
                    (total + page_size - 1) / page_size <= page_table.size(1),
                "paged_attention: request ", b, " does not fit q or its page table");
  }
  auto out = at::empty_like(q);
  Problem p{};
  p.q = reinterpret_cast<const bf16*>(q.data_ptr<at::BFloat16>());
  p.k_cache = reinterpret_cast<const bf16*>(k_cache.data_ptr<at::BFloat16>());
  p.v_cache = reinterpret_cast<const bf16*>(v_cache.data_ptr<at::BFloat16>());
  p.page_table = page_table.data_ptr<int32_t>();
  p.out = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  p.table_stride = page_table.size(1);
  p.page_size = page_size;
  p.hq = hq;
  p.hkv = hkv;
  p.group = hq / hkv;
  p.d = d;
  p.scale_log2 = static_cast<float>(sm_scale) * kLog2e;
  p.prefix = &prefix_lens;
  p.start = &extend_starts;

  // Short extends and decodes: one item covers every KV head of the request, so each token's
  // K/V row (all heads, contiguous) is read once, in order. Longer ones: one item per KV head and
  // block of query tokens.
  const int64_t tok_per_item = std::max<int64_t>(1, kRowsPerItem / p.group);
  std::vector<Item> items;
  auto i32 = [](int64_t x) { return static_cast<int32_t>(x); };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = extend_lens[b];
    if (n > 0 && n * hq <= kRowsPerItem) {
      items.push_back(Item{i32(b), 0, i32(n), 0, i32(hkv), (prefix_lens[b] + n) * (n + 4) * hkv});
      continue;
    }
    for (int64_t t0 = 0; t0 < n; t0 += tok_per_item) {
      const int64_t nt = std::min(tok_per_item, n - t0);
      const int64_t keys = prefix_lens[b] + t0 + nt;
      for (int64_t h = 0; h < hkv; ++h) {
        items.push_back(Item{i32(b), i32(t0), i32(nt), i32(h), 1, keys * (nt + 4)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const bool fast = fast_path_for(d);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
#if RADIXKV_AVX512BF16
    Scratch sc;
#endif
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
#if RADIXKV_AVX512BF16
      if (fast) {
        if (d == 64) {
          run_item_avx512<64>(p, it, sc);
        } else {
          run_item_avx512<128>(p, it, sc);
        }
        continue;
      }
#endif
      (void)fast;
      run_item_scalar(p, it);
    }
  });
  return out;
}

bool has_fast_path(int64_t head_dim) { return fast_path_for(head_dim); }
