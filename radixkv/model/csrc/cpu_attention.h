// Paged attention for the CPU over radixkv's KV pool (see cpu_attention.cpp). Both kernels take a
// sliding window (`window` > 0: the query at position p sees keys p - window + 1 .. p, as
// transformers' sliding_window mask; 0: every key up to p).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

#include <cstdint>
#include <memory>
#include <vector>

// bf16 pools, AVX512-BF16 dot products, with shared-prefix groups (cpu_attention.cpp)
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor page_table, std::vector<int64_t> prefix_lens,
                           std::vector<int64_t> extend_lens, std::vector<int64_t> extend_starts,
                           double sm_scale, std::vector<int64_t> group_members,
                           std::vector<int64_t> group_offsets, std::vector<int64_t> group_shared,
                           int64_t window);
bool has_fast_path(int64_t head_dim);
// Whether paged_attention can run its row-tile items on AMX (an AVX512-BF16 build on a host
// whose oneDNN packs bf16 for AMX), and the switch (on by default where available; returns the
// previous setting).
bool amx_attention_available();
bool set_amx_attention(bool on);
// How many work items this process has run on AMX (for tests and diagnosis).
int64_t amx_attention_items();
// float32 math over float32 / bf16 / fp16 pools, with shared-prefix groups (cpu_attention_f32.cpp)
at::Tensor paged_attention_f32(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor page_table, std::vector<int64_t> prefix_lens,
                               std::vector<int64_t> extend_lens,
                               std::vector<int64_t> extend_starts, double sm_scale,
                               std::vector<int64_t> group_members,
                               std::vector<int64_t> group_offsets,
                               std::vector<int64_t> group_shared, int64_t window);
const char* f32_kernel_isa();

// paged_attention_f32 for many layers of one step (the decoder stack's team of threads,
// cpu_decoder.cpp): the batch (q's shape, the pools' shape and dtype, the page table, lengths and
// prefix groups; no window) checked and its work items built once; each layer then runs on its
// own q, pools and output. Every row of q must belong to a request. The results equal
// paged_attention_f32's bit for bit (the same items, each run by one thread).
class PagedAttentionF32Plan {
 public:
  PagedAttentionF32Plan(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& page_table, const std::vector<int64_t>& prefix_lens,
                        const std::vector<int64_t>& extend_lens,
                        const std::vector<int64_t>& extend_starts, double sm_scale,
                        const std::vector<int64_t>& group_members,
                        const std::vector<int64_t>& group_offsets,
                        const std::vector<int64_t>& group_shared);
  ~PagedAttentionF32Plan();
  // Whether a layer's pools have the shape, dtype and layout the plan was checked with.
  bool fits(const at::Tensor& k_cache, const at::Tensor& v_cache) const;
  // One layer: q and out [T, Hq, D] float32 contiguous, the pools as fits() accepts. Called by
  // every thread tid < threads of an OpenMP parallel region (it holds a barrier between the
  // prefix groups' phase and the requests' own; out is complete after the caller's barrier).
  void run_team(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache, float* out,
                int tid, int threads) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
