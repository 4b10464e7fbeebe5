// What radixkv's two paged-attention kernels share: cpu_attention.cpp (bf16 math over bf16 or
// quantized pools, AVX512-BF16 / AMX / portable paths) and cpu_attention_f32.cpp (float32 math
// over float32, bf16, fp16 or quantized pools, every ISA level).
//
// - bfloat16 bit conversions (a bf16 widens to float32 exactly; narrowing rounds to nearest even);
// - PagedBatch: a step's batch as both kernels read it (the K/V pools, the page table, each
//   request's prefix / extend lengths and first q row, the head counts, the sliding window),
//   checked and filled by check_paged_batch, and each kernel's Problem extends it;
// - the shared-prefix group checks (check_prefix_groups) and a query's window start.
//
// Not shared, because the kernels really differ there: the rest of each Problem (q / out element
// types; the bf16 kernel's q row stride, quantization kind, phase-A state and AMX switch; the
// float32 kernel's running max / sum buffers), the work Items (bf16: ranges of query entries and
// of KV heads with shared / resume flags, split by item_tokens; float32: a group's row block or a
// request's token block of one KV head), the per-thread Scratch (vpack, row tiles, AMX packs and
// prefetch queues; float32 K / V blocks and transposed queries) and the key-block sizes, and
// each kernel's dtype checks (passed to check_paged_batch as the row's extra bytes and q's layout).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace radixkv_attn {

constexpr float kLog2e = 1.4426950408889634f;

// The float32 value of a bfloat16's bits (exact: the bits shifted up 16).
inline float bf16_to_float(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The bfloat16 bits nearest f (ties to even; a NaN stays a NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// The first key a query at absolute position `pos` sees: pos - window + 1 with a sliding window
// (window > 0, transformers' kv > q - window), else 0.
inline int64_t window_start(int64_t window, int64_t pos) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// A step's paged batch: request b's new tokens are q rows start[b] .. start[b] + ext[b], at
// absolute positions prefix[b] ..; its keys 0 .. prefix[b] + ext[b] - 1 live in the pages
// page_table[b * table_stride + pos / page_size] at slot pos % page_size, each (token, KV head)
// row of row_bytes at byte ((page * page_size + slot) * hkv + head) * row_bytes of the pools.
// The vectors are the kernel call's arguments (they outlive the call's Problem).
struct PagedBatch {
  const char* k_cache;
  const char* v_cache;
  const int32_t* page_table;
  int64_t table_stride, page_size;
  int64_t hq, hkv, group, d;  // query and KV heads, hq / hkv, head dim
  int64_t row_bytes;          // bytes of one (token, head) row: D values, or D codes + scale
  int64_t window;             // sliding window (0: none): position p sees keys p - window + 1 .. p
  const std::vector<int64_t>* prefix;
  const std::vector<int64_t>* ext;
  const std::vector<int64_t>* start;
};

// What a kernel takes beyond the common checks (its dtypes are its own to check).
struct BatchRules {
  int64_t row_extra;     // elements of a pool row past its D values (a quantized row's scale)
  bool q_strided_rows;   // q may be a view of wider rows: each token's [Hq, D] contiguous
  int64_t max_head_dim;  // 0: no limit
};

// Checks the shapes and layouts of one call (q [T, Hq, D], caches [pages, page_size, Hkv, D +
// row_extra], an int32 page table with a row per request, every request inside q and its page
// table, every page id it uses inside the pool) and returns the batch they describe. `who`
// prefixes the error messages.
inline PagedBatch check_paged_batch(const char* who, const at::Tensor& q,
                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& page_table,
                                    const std::vector<int64_t>& prefix_lens,
                                    const std::vector<int64_t>& extend_lens,
                                    const std::vector<int64_t>& extend_starts, int64_t window,
                                    const BatchRules& rules) {
  TORCH_CHECK(q.device().is_cpu(), who, ": tensors must be on the CPU");
  TORCH_CHECK(window >= 0, who, ": window must be >= 0 (0: full attention)");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), who,
              ": q [T, Hq, D], caches [pages, page_size, Hkv, D] (D + 2 when quantized)");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2, who,
              ": page_table must be int32 [B, max_pages]");
  // a view of the fused QKV rows: each token's [Hq, D] row contiguous, rows strided
  const bool q_rows = q.is_contiguous() ||
                      (rules.q_strided_rows && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
                       q.stride(0) >= q.size(1) * q.size(2));
  TORCH_CHECK(q_rows && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  page_table.is_contiguous(),
              who, ": inputs must be contiguous",
              rules.q_strided_rows ? " (q: each token's [Hq, D] row)" : "");
  const int64_t B = static_cast<int64_t>(extend_lens.size());
  TORCH_CHECK(static_cast<int64_t>(prefix_lens.size()) == B &&
                  static_cast<int64_t>(extend_starts.size()) == B && page_table.size(0) >= B,
              who, ": one prefix_len, extend_len, extend_start and page row per request");
  const int64_t hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d + rules.row_extra && hq % hkv == 0 &&
                  (rules.max_head_dim == 0 || d <= rules.max_head_dim),
              who, ": head shapes disagree",
              rules.max_head_dim ? " (or head dim > " + std::to_string(rules.max_head_dim) + ")"
                                 : std::string());
  const int64_t page_size = k_cache.size(1);
  const int64_t num_pages = k_cache.size(0);
  const int32_t* tab = page_table.data_ptr<int32_t>();
  const int64_t stride = page_table.size(1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t total = prefix_lens[b] + extend_lens[b];
    TORCH_CHECK(extend_lens[b] >= 0 && prefix_lens[b] >= 0 && extend_starts[b] >= 0 &&
                    extend_starts[b] + extend_lens[b] <= q.size(0) &&
                    (total + page_size - 1) / page_size <= stride,
                who, ": request ", b, " does not fit q or its page table");
    for (int64_t i = 0; i < (total + page_size - 1) / page_size; ++i) {
      TORCH_CHECK(tab[b * stride + i] >= 0 && tab[b * stride + i] < num_pages, who, ": request ",
                  b, " has a page id outside the pool");
    }
  }
  PagedBatch batch{};
  batch.k_cache = static_cast<const char*>(k_cache.data_ptr());
  batch.v_cache = static_cast<const char*>(v_cache.data_ptr());
  batch.page_table = tab;
  batch.table_stride = stride;
  batch.page_size = page_size;
  batch.hq = hq;
  batch.hkv = hkv;
  batch.group = hq / hkv;
  batch.d = d;
  batch.row_bytes = k_cache.size(3) * k_cache.element_size();
  batch.window = window;
  batch.prefix = &prefix_lens;
  batch.ext = &extend_lens;
  batch.start = &extend_starts;
  return batch;
}

// Checks a step's shared-prefix groups (members of group g are members[offsets[g] ..
// offsets[g + 1]), each request in one group at most, shared[g] <= every member's prefix, the
// members' first pages the same ids) and returns each request's shared length (0 outside
// groups). `who` prefixes the error messages.
inline std::vector<int64_t> check_prefix_groups(const char* who, const PagedBatch& batch,
                                                const std::vector<int64_t>& members,
                                                const std::vector<int64_t>& offsets,
                                                const std::vector<int64_t>& shared) {
  const std::vector<int64_t>& prefix_lens = *batch.prefix;
  const int32_t* tab = batch.page_table;
  const int64_t stride = batch.table_stride, page_size = batch.page_size;
  const int64_t B = static_cast<int64_t>(prefix_lens.size());
  const int64_t n_groups = static_cast<int64_t>(shared.size());
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == (n_groups ? n_groups + 1 : 0) ||
                  (n_groups == 0 && offsets.size() <= 1),
              who, ": group_offsets must have one entry per group plus one");
  std::vector<int64_t> shared_of(B, 0);
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t g0 = offsets[g], g1 = offsets[g + 1];
    TORCH_CHECK(0 <= g0 && g0 < g1 && g1 <= static_cast<int64_t>(members.size()), who,
                ": group ", g, " has bad member offsets");
    const int64_t S = shared[g];
    const int64_t ref = members[g0];
    for (int64_t mi = g0; mi < g1; ++mi) {
      const int64_t b = members[mi];
      TORCH_CHECK(b >= 0 && b < B && shared_of[b] == 0 && S >= 0 && S <= prefix_lens[b], who,
                  ": group ", g, " member ", b,
                  " is not a request, is in two groups, or its prefix is shorter than the "
                  "shared part");
      for (int64_t i = 0; i < (S + page_size - 1) / page_size; ++i) {
        TORCH_CHECK(tab[b * stride + i] == tab[ref * stride + i], who, ": group ", g,
                    " members do not share their first pages");
      }
      shared_of[b] = S;
    }
  }
  return shared_of;
}

}  // namespace radixkv_attn
