// A stack of decoder layers in one native call: the batch-1 decode step's fixed cost.
//
// A SmolLM2 decode step runs 30 layers of ~13 native ops each (norms, four linears, RoPE, the K/V
// store, the attention kernel, SiLU * up). From Python each op costs a binding call, argument
// conversion and the interpreter between calls: ~60 us a layer on the Zen 3 host, ~2 ms of a
// ~10 ms batch-1 step with 4-bit weights. Here the same ops run from one loop in C++: the same
// functions in the same order on the same tensors, so the results equal the Python loop's bit
// for bit (tests/test_decoder_stack.py compares them), and only the dispatch between them goes.
//
// With `team` (a decode's few rows, every linear a block GEMV: int8 activations, or the float
// decode path of quant_gemm_into on AVX2 builds) the layers run inside one OpenMP parallel
// region instead of ~5 a layer: each thread keeps its own copy of the residual rows and computes
// the norms, x's preparation (int8 quantization, or the float decode path's reordering) and
// SiLU * up on it (a few thousand values: cheaper than waking a thread), multiplies its share of
// each linear's output rows (whole groups, as the GEMVs split them) and runs its share of the
// attention items (PagedAttentionF32Plan, checked once a step); thread 0 applies RoPE and stores
// the new K/V rows. Six barriers a layer, no tensor allocated in the layer loop. The same
// functions on the same values, so again the loop's results bit for bit. An error raised in
// thread 0's part (RoPE's or the K/V store's checks) ends every thread's loop at the next
// barrier and is raised after the region (an exception must not leave an OpenMP region).

#include "cpu_decoder.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <omp.h>

#include <exception>

#include "cpu_attention.h"
#include "cpu_fused.h"
#include "cpu_kv_store.h"
#include "cpu_linear.h"
#include "cpu_quant_dot.h"
#include "cpu_quant_linear.h"
#include "cpu_work.h"

namespace {

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t int8_rows,
                  int64_t terms) {
  return kind < 0 ? f32_gemm(x, w) : quant_linear(x, w, kind, int8_rows, terms);
}

// A thread's inputs of the linears, prepared once per layer input and kept between calls.
struct TeamInput {
  radixkv_qdot::QuantizedRows xq;  // int8 activations
  std::vector<float> xf;           // the float decode path's reordered x
};

// One thread's share of y [t, N] = x W^T, W raw rows of a GGML type, x [t, k]: int8 activations
// (x quantized into in.xq) or float ones (the decode path of quant_gemm_into), as quant_linear
// picks. Every thread prepares x itself (the same values: a few thousand, cheaper than a
// barrier).
void team_linear(const at::Tensor& w, int64_t kind, int64_t int8_rows, int64_t terms,
                 const float* x, int64_t t, int64_t k, TeamInput& in, float* y, int tid,
                 int threads) {
  const int64_t n = w.size(0);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (radixkv_qdot::serves_rows(kind, int8_rows, t, terms)) {
    radixkv_qdot::quantize_rows(x, t, k, in.xq, terms);
    const int64_t workers = radixkv_work::unit_workers(n, radixkv_qdot::kGroupRows, threads);
    if (tid >= workers) return;
    const auto [n0, n1] = radixkv_work::unit_rows(n, radixkv_qdot::kGroupRows, tid, workers);
    radixkv_qdot::dot_rows_range(kind, wp, w.size(1), in.xq, k, y, n, n0, n1);
  } else {
    const float* xd = radixkv_qlin::decode_input(kind, x, t, k, in.xf);
    const int64_t workers = radixkv_work::unit_workers(n, radixkv_qlin::kRowUnit, threads);
    if (tid >= workers) return;
    const auto [n0, n1] = radixkv_work::unit_rows(n, radixkv_qlin::kRowUnit, tid, workers);
    radixkv_qlin::decode_rows_range(kind, wp, w.size(1), xd, t, k, y, n, n0, n1);
  }
}

// The team path (file comment). x [T, H] is updated in place; returns the last MLP output.
at::Tensor decoder_layers_team(at::Tensor& x, const at::Tensor& pending,
                               const std::vector<at::Tensor>& norms,
                               const std::vector<double>& eps,
                               const std::vector<at::Tensor>& linears,
                               const std::vector<int64_t>& kinds,
                               const std::vector<int64_t>& int8_rows, int64_t terms,
                               int64_t hq, int64_t hkv,
                               int64_t d, const at::Tensor& cos, const at::Tensor& sin,
                               std::vector<at::Tensor>& k_caches, std::vector<at::Tensor>& v_caches,
                               const at::Tensor& out_slots, const PagedAttentionF32Plan& plan) {
  static constexpr const char* fn = "decoder_layers_f32 (team)";
  const size_t layers = k_caches.size();
  const int64_t t = x.size(0), h = x.size(1), qkv_n = (hq + 2 * hkv) * d;
  TORCH_CHECK(t >= 1 && t <= team_rows_max(), fn, ": a team step takes 1 to ",
              team_rows_max(), " rows, got ", t);
  for (size_t i = 0; i < layers; ++i) {
    for (int j = 0; j < 4; ++j) {
      const at::Tensor& w = linears[4 * i + j];
      const int64_t kind = kinds[4 * i + j];
      TORCH_CHECK(kind >= 0 && w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
                  fn, ": layer ", i, " linear ", j, " is not raw GGML rows");
      TORCH_CHECK(radixkv_qdot::serves_rows(kind, int8_rows[4 * i + j], t, terms) ||
                      radixkv_qlin::decode_rows_max() >= t,
                  fn, ": layer ", i, " linear ", j, " has no decode path at ", t,
                  " rows in this build (int8 activations off and no AVX2 decode)");
    }
    TORCH_CHECK(plan.fits(k_caches[i], v_caches[i]), fn, ": layer ", i,
                "'s pools differ from the first layer's");
    TORCH_CHECK(norms[2 * i].numel() == h && norms[2 * i + 1].numel() == h &&
                    norms[2 * i].is_contiguous() && norms[2 * i + 1].is_contiguous(),
                fn, ": layer ", i, "'s norm weights must be contiguous [H]");
  }
  const int64_t inter = linears[2].size(0) / 2;
  TORCH_CHECK(h % 32 == 0 && (hq * d) % 32 == 0 && inter % 32 == 0, fn,
              ": the hidden, attention and intermediate sizes must be multiples of 32");
  const int64_t outs[4] = {qkv_n, h, 2 * inter, h}, ins[4] = {h, hq * d, h, inter};
  for (size_t i = 0; i < layers; ++i) {
    for (int j = 0; j < 4; ++j) {
      const at::Tensor& w = linears[4 * i + j];
      TORCH_CHECK(w.size(0) == outs[j] &&
                      w.size(1) == radixkv_qlin::row_bytes_of(kinds[4 * i + j], ins[j]),
                  fn, ": layer ", i, " linear ", j, " is ", w.sizes(), " raw bytes, not ",
                  outs[j], " rows of ", ins[j], " weights");
    }
  }
  auto opts = x.options();
  at::Tensor qkv = at::empty({t, qkv_n}, opts);  // rows of [q | k | v]; RoPE'd in place
  const std::vector<at::Tensor> qkv3 =
      qkv.view({t, hq + 2 * hkv, d}).split_with_sizes({hq, hkv, hkv}, 1);
  const at::Tensor q = qkv3[0].contiguous();  // a copy per layer (attention reads contiguous q)
  at::Tensor attn = at::empty({t, hq * d}, opts);
  at::Tensor o_out = at::empty({t, h}, opts);
  at::Tensor gate_up = at::empty({t, 2 * inter}, opts);
  at::Tensor carry = at::empty({t, h}, opts);
  if (pending.defined()) carry.copy_(pending);
  const bool has_pending = pending.defined();
  float* xs = x.data_ptr<float>();
  const int threads = at::get_num_threads();
  std::exception_ptr failure;  // thread 0's, read by all after a barrier
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    // this thread's residual rows, norm output, activations and quantized x
    std::vector<float> res(xs, xs + t * h), hn(t * h), act(t * inter);
    TeamInput in;
    float* cy = carry.data_ptr<float>();
    bool add = has_pending;
    for (size_t i = 0; i < layers; ++i) {
      const at::Tensor* w = &linears[4 * i];
      const int64_t* kind = &kinds[4 * i];
      const int64_t* rows = &int8_rows[4 * i];
      const float e0 = static_cast<float>(eps[2 * i]), e1 = static_cast<float>(eps[2 * i + 1]);
      if (add) {
        add_rms_norm_rows_f32(res.data(), h, cy, h, norms[2 * i].data_ptr<float>(), hn.data(), h,
                              e0, 0, t);
      } else {
        rms_norm_rows_f32(res.data(), h, norms[2 * i].data_ptr<float>(), hn.data(), h, e0, 0, t);
      }
      add = true;
      team_linear(w[0], kind[0], rows[0], terms, hn.data(), t, h, in, qkv.data_ptr<float>(), tid,
                  nt);
#pragma omp barrier
      if (tid == 0) {
        try {
          rope_(qkv, cos, sin, hq + hkv, d);
          store_kv_(qkv3[1], qkv3[2], k_caches[i], v_caches[i], out_slots);
          q.copy_(qkv3[0]);
        } catch (...) {
          failure = std::current_exception();
        }
      }
#pragma omp barrier
      if (failure) break;  // every thread, after the same barrier
      plan.run_team(q.data_ptr<float>(), k_caches[i], v_caches[i], attn.data_ptr<float>(), tid,
                    nt);
#pragma omp barrier
      team_linear(w[1], kind[1], rows[1], terms, attn.data_ptr<float>(), t, hq * d, in,
                  o_out.data_ptr<float>(), tid, nt);
#pragma omp barrier
      add_rms_norm_rows_f32(res.data(), h, o_out.data_ptr<float>(), h,
                            norms[2 * i + 1].data_ptr<float>(), hn.data(), h, e1, 0, t);
      team_linear(w[2], kind[2], rows[2], terms, hn.data(), t, h, in, gate_up.data_ptr<float>(),
                  tid, nt);
#pragma omp barrier
      silu_mul_rows_f32(gate_up.data_ptr<float>(), 2 * inter, act.data(), inter, 0, t);
      team_linear(w[3], kind[3], rows[3], terms, act.data(), t, inter, in, cy, tid, nt);
#pragma omp barrier
    }
    if (tid == 0 && !failure) std::copy(res.begin(), res.end(), xs);
  }
  if (failure) std::rethrow_exception(failure);
  return carry;
}

}  // namespace

int64_t team_rows_max() {
  return std::max(quant_dot_max_rows(), radixkv_qlin::decode_rows_max());
}

int64_t quant_decode_rows() { return radixkv_qlin::decode_rows_max(); }

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
                              const std::vector<int64_t>& group_shared, bool team,
                              int64_t terms) {
  static constexpr const char* fn = "decoder_layers_f32";
  const size_t layers = k_caches.size();
  TORCH_CHECK(v_caches.size() == layers && norms.size() == 2 * layers &&
                  eps.size() == 2 * layers && linears.size() == 4 * layers &&
                  kinds.size() == 4 * layers && int8_rows.size() == 4 * layers,
              fn, ": per layer 2 norms and eps, 4 linears, kinds and int8_rows, 1 k and v cache; "
              "got ", layers, " k caches, ", v_caches.size(), " v caches, ", norms.size(),
              " norms, ", eps.size(), " eps, ", linears.size(), " linears");
  TORCH_CHECK(heads.size() == 3, fn, ": heads must be (Hq, Hkv, D)");
  TORCH_CHECK(terms == 1 || terms == 2, fn, ": terms is 1 or 2, got ", terms);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), fn,
              ": x must be contiguous float32 rows [T, H], got ", x.scalar_type(), " ", x.sizes());
  const int64_t hq = heads[0], hkv = heads[1], d = heads[2], t = x.size(0);
  at::Tensor carry = pending.has_value() ? *pending : at::Tensor();
  if (team && layers > 0) {
    const at::Tensor q_shape = at::empty({t, hq, d}, x.options());
    const PagedAttentionF32Plan plan(q_shape, k_caches[0], v_caches[0], page_table, prefix_lens,
                                     extend_lens, extend_starts, sm_scale, group_members,
                                     group_offsets, group_shared);
    return decoder_layers_team(x, carry, norms, eps, linears, kinds, int8_rows, terms, hq, hkv, d,
                               cos, sin, k_caches, v_caches, out_slots, plan);
  }
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* w = &linears[4 * i];
    const int64_t* kind = &kinds[4 * i];
    const int64_t* rows = &int8_rows[4 * i];
    const at::Tensor h = carry.defined() ? add_rms_norm(x, carry, norms[2 * i], eps[2 * i])
                                         : rms_norm(x, norms[2 * i], eps[2 * i]);
    at::Tensor qkv = linear(h, w[0], kind[0], rows[0], terms);
    rope_(qkv, cos, sin, hq + hkv, d);
    const std::vector<at::Tensor> qkv3 =
        qkv.view({t, hq + 2 * hkv, d}).split_with_sizes({hq, hkv, hkv}, 1);
    store_kv_(qkv3[1], qkv3[2], k_caches[i], v_caches[i], out_slots);
    const at::Tensor o = paged_attention_f32(qkv3[0].contiguous(), k_caches[i], v_caches[i],
                                             page_table, prefix_lens, extend_lens, extend_starts,
                                             sm_scale, group_members, group_offsets, group_shared,
                                             0);
    const at::Tensor a = linear(o.reshape({t, hq * d}), w[1], kind[1], rows[1], terms);
    const at::Tensor h2 = add_rms_norm(x, a, norms[2 * i + 1], eps[2 * i + 1]);
    carry = linear(silu_mul(linear(h2, w[2], kind[2], rows[2], terms)), w[3], kind[3], rows[3],
                   terms);
  }
  return carry;
}
