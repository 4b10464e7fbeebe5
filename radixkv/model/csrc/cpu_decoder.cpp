// A stack of decoder layers in one native call: the batch-1 decode step's fixed cost.
//
// A SmolLM2 decode step runs 30 layers of ~13 native ops each (norms, four linears, RoPE, the K/V
// store, the attention kernel, SiLU * up). From Python each op costs a binding call, argument
// conversion and the interpreter between calls: ~60 us a layer on the Zen 3 host, ~2 ms of a
// ~10 ms batch-1 step with 4-bit weights. Here the same ops run from one loop in C++: the same
// functions in the same order on the same tensors, so the results equal the Python loop's bit
// for bit (tests/test_decoder_stack.py compares them), and only the dispatch between them goes.

#include "cpu_decoder.h"

#include <ATen/ATen.h>

#include "cpu_attention.h"
#include "cpu_fused.h"
#include "cpu_kv_store.h"
#include "cpu_linear.h"
#include "cpu_quant_dot.h"

namespace {

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t int8_rows) {
  return kind < 0 ? f32_gemm(x, w) : quant_linear(x, w, kind, int8_rows);
}

}  // namespace

at::Tensor decoder_layers_f32(at::Tensor x, const std::optional<at::Tensor>& pending,
                              const std::vector<at::Tensor>& norms, const std::vector<double>& eps,
                              const std::vector<at::Tensor>& linears,
                              const std::vector<int64_t>& kinds,
                              const std::vector<int64_t>& int8_rows,
                              const std::vector<int64_t>& heads, const at::Tensor& cos,
                              const at::Tensor& sin, std::vector<at::Tensor> k_caches,
                              std::vector<at::Tensor> v_caches, const at::Tensor& out_slots,
                              const at::Tensor& page_table, const std::vector<int64_t>& prefix_lens,
                              const std::vector<int64_t>& extend_lens,
                              const std::vector<int64_t>& extend_starts, double sm_scale,
                              const std::vector<int64_t>& group_members,
                              const std::vector<int64_t>& group_offsets,
                              const std::vector<int64_t>& group_shared) {
  static constexpr const char* fn = "decoder_layers_f32";
  const size_t layers = k_caches.size();
  TORCH_CHECK(v_caches.size() == layers && norms.size() == 2 * layers &&
                  eps.size() == 2 * layers && linears.size() == 4 * layers &&
                  kinds.size() == 4 * layers && int8_rows.size() == 4 * layers,
              fn, ": per layer 2 norms and eps, 4 linears, kinds and int8_rows, 1 k and v cache; "
              "got ", layers, " k caches, ", v_caches.size(), " v caches, ", norms.size(),
              " norms, ", eps.size(), " eps, ", linears.size(), " linears");
  TORCH_CHECK(heads.size() == 3, fn, ": heads must be (Hq, Hkv, D)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), fn,
              ": x must be contiguous float32 rows [T, H], got ", x.scalar_type(), " ", x.sizes());
  const int64_t hq = heads[0], hkv = heads[1], d = heads[2], t = x.size(0);
  at::Tensor carry = pending.has_value() ? *pending : at::Tensor();
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* w = &linears[4 * i];
    const int64_t* kind = &kinds[4 * i];
    const int64_t* rows = &int8_rows[4 * i];
    const at::Tensor h = carry.defined() ? add_rms_norm(x, carry, norms[2 * i], eps[2 * i])
                                         : rms_norm(x, norms[2 * i], eps[2 * i]);
    at::Tensor qkv = linear(h, w[0], kind[0], rows[0]);
    rope_(qkv, cos, sin, hq + hkv, d);
    const std::vector<at::Tensor> qkv3 =
        qkv.view({t, hq + 2 * hkv, d}).split_with_sizes({hq, hkv, hkv}, 1);
    store_kv_(qkv3[1], qkv3[2], k_caches[i], v_caches[i], out_slots);
    const at::Tensor o = paged_attention_f32(qkv3[0].contiguous(), k_caches[i], v_caches[i],
                                             page_table, prefix_lens, extend_lens, extend_starts,
                                             sm_scale, group_members, group_offsets, group_shared,
                                             0);
    const at::Tensor a = linear(o.reshape({t, hq * d}), w[1], kind[1], rows[1]);
    const at::Tensor h2 = add_rms_norm(x, a, norms[2 * i + 1], eps[2 * i + 1]);
    carry = linear(silu_mul(linear(h2, w[2], kind[2], rows[2])), w[3], kind[3], rows[3]);
  }
  return carry;
}
