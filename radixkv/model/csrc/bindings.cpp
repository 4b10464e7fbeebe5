// Python bindings of radixkv's native CPU kernels (built by radixkv/model/native.py).
#include <torch/extension.h>

#include "cpu_attention.h"
#include "cpu_decoder.h"
#include "cpu_fused.h"
#include "cpu_int8_linear.h"
#include "cpu_kv_store.h"
#include "cpu_linear.h"
#include "cpu_quant_dot.h"
#include "cpu_quant_linear.h"
#include "cpu_sample.h"

#include <cstdlib>
#include <cstring>
#include <utility>

namespace {

// Whether the kernels run with the GIL released: yes unless RADIXKV_NATIVE_GIL=hold (read once).
// Released, a server's other Python threads (HTTP parsing, tokenization, streaming) run while
// the engine thread is inside a kernel, as they do during torch's own ops.
bool release_gil() {
  static const bool release = [] {
    const char* v = std::getenv("RADIXKV_NATIVE_GIL");
    return v == nullptr || std::strcmp(v, "hold") != 0;
  }();
  return release;
}

// Fn's binding: its arguments are converted with the GIL held, the call runs without it. The
// kernels touch no Python object (tensors and std::vectors only).
template <auto Fn>
struct NoGil;
template <class R, class... A, R (*Fn)(A...)>
struct NoGil<Fn> {
  static R call(A... args) {
    if (release_gil()) {
      pybind11::gil_scoped_release released;
      return Fn(std::forward<A>(args)...);
    }
    return Fn(std::forward<A>(args)...);
  }
};

}  // namespace

// The attention kernels' arguments by name; the sliding window last, optional (0: full attention).
#define RADIXKV_ATTENTION_ARGS                                                                  \
  pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),                      \
      pybind11::arg("page_table"), pybind11::arg("prefix_lens"), pybind11::arg("extend_lens"), \
      pybind11::arg("extend_starts"), pybind11::arg("sm_scale"),                               \
      pybind11::arg("group_members"), pybind11::arg("group_offsets"),                          \
      pybind11::arg("group_shared"), pybind11::arg("window") = 0

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &NoGil<&paged_attention>::call,
        "Paged attention over the KV pool for a step's decodes and extends (bf16, CPU); "
        "window > 0: each query sees its last `window` keys (itself included)",
        RADIXKV_ATTENTION_ARGS);
  m.def("has_fast_path", &has_fast_path, "Whether the AVX512-BF16 path serves this head dim");
  m.def("amx_attention_available", &amx_attention_available,
        "Whether paged_attention can run row tiles on AMX here");
  m.def("set_amx_attention", &set_amx_attention,
        "Turn paged_attention's AMX items on or off; returns the previous setting");
  m.def("amx_attention_items", &amx_attention_items,
        "How many paged_attention work items this process has run on AMX");
  m.def("paged_attention_f32", &NoGil<&paged_attention_f32>::call,
        "Paged attention, float32 math over float32/bf16/fp16 pools, shared-prefix groups; "
        "window > 0: each query sees its last `window` keys (itself included)",
        RADIXKV_ATTENTION_ARGS);
  m.def("kernel_isa", []() { return std::string(f32_kernel_isa()); },
        "The ISA level this build was compiled for");
  m.def("rms_norm", &NoGil<&rms_norm>::call, "RMSNorm of bf16 rows (float32 math)");
  m.def("add_rms_norm", &NoGil<&add_rms_norm>::call,
        "residual += x in place, then RMSNorm of the residual");
  m.def("silu_mul", &NoGil<&silu_mul>::call, "silu(gate) * up of a [rows, 2 * n] bf16 tensor");
  m.def("sample_rows", &NoGil<&sample_rows>::call,
        "Inverse-CDF draw per row of float32 logits at a temperature (the sampler's plain rows)");
  m.def("argmax_rows", &NoGil<&argmax_rows>::call,
        "torch.argmax(logits, -1) of contiguous float32 rows, rows in parallel");
  m.def("apply_token_bitmask_", &NoGil<&apply_token_bitmask_>::call,
        "logits[r, j] = -inf where bit j of bitmask[r] is 0, r in rows (xgrammar's layout), in place");
  m.def("hadamard_rows", &NoGil<&hadamard_rows>::call,
        "x H * scale over the last dim (kv_quant.hadamard's +-1 block Hadamard), float32/bf16");
  m.def("hadamard_rows_", &NoGil<&hadamard_rows_>::call, "hadamard_rows in place");
  m.def("rope_hadamard_", &NoGil<&rope_hadamard_>::call,
        "In place on bf16 rows: RoPE on the first rope_heads heads, then x H on the first heads "
        "(the bits of rope_ then hadamard_rows): the fused QKV output in the stored basis of "
        "rotated KV pages");
  m.def("store_kv_quant_", &NoGil<&store_kv_quant_>::call,
        "Quantize k, v rows as kv_quant.quantize does and write them with their scales to slots");
  m.def("store_kv_", &NoGil<&store_kv_>::call,
        "Copy k, v token rows [T, Hkv, D] to slots of same-dtype caches (any token stride)");
  m.def("copy_pages_", &NoGil<&copy_pages_>::call,
        "Copy page src[i] to dst[i] in every cache of a list (one shape and dtype, contiguous)");
  m.def("has_bf16_gemm", &has_bf16_gemm, "Whether this build has the AVX512-BF16 GEMM");
  m.def("has_f32_gemm", &has_f32_gemm, "Whether this build has the float32 GEMM (AVX2/AVX-512)");
  m.def("f32_gemm_cols", &f32_gemm_cols, "Output columns per packed float32 block");
  m.def("bf16_gemm_block", &bf16_gemm_block,
        "(output columns, inputs per step) of a packed bf16 block: out_features and in_features "
        "must be multiples of them");
  m.def("pack_bf16_weight", &NoGil<&pack_bf16_weight>::call,
        "W [N, K] bf16 -> [N / 16, K / 2, 32], the layout bf16_gemm reads");
  m.def("bf16_gemm", &NoGil<&bf16_gemm>::call,
        "x [M, K] W^T for bf16 rows, W from pack_bf16_weight");
  m.def("bf16_gemm_amx_available", &bf16_gemm_amx_available,
        "Whether bf16_gemm_amx can run here (AVX512-BF16 build, AMX-BF16 host, tile state)");
  m.def("bf16_gemm_amx", &NoGil<&bf16_gemm_amx>::call,
        "bf16_gemm on AMX tiles over the same packed weight (in_features % 32 == 0)");
  m.def("pack_f32_weight", &NoGil<&pack_f32_weight>::call,
        "W [N, K] float32 -> [N / cols, K, cols], the layout f32_gemm reads");
  m.def("f32_gemm", &NoGil<&f32_gemm>::call,
        "x [M, K] W^T for float32 rows, W from pack_f32_weight");
  m.def("quant_gemm_types", &quant_gemm_types,
        "GGML type ids quant_gemm multiplies natively (Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12, Q6_K 14)");
  m.def("quant_gemm_into", &NoGil<&quant_gemm_into>::call,
        "out[:, :N] = x [M, K] (float32/bf16) Wdeq^T, w [N, row_bytes] uint8 raw GGML rows of "
        "ggml_type, decoded exactly in registers, float32 sums; out float32 or x's dtype, "
        "last stride 1",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("ggml_type"), pybind11::arg("out"));
  m.def("quant_gemm", &NoGil<&quant_gemm>::call,
        "quant_gemm_into into a new [M, N] tensor of x's dtype", pybind11::arg("x"),
        pybind11::arg("w"), pybind11::arg("ggml_type"));
  m.def("quant_dot_types", &quant_dot_types,
        "GGML type ids quant_gemm_q8_into multiplies (Q4_0 2, Q4_1 3, Q8_0 8)");
  m.def("quant_dot_max_rows", &quant_dot_max_rows, "The most rows of x quant_gemm_q8_into takes");
  m.def("quant_gemm_q8_into", &NoGil<&quant_gemm_q8_into>::call,
        "out[:, :N] ~= x [M <= 8, K] float32 Wdeq^T with x quantized to int8 per 32-block "
        "(scale amax / 127, float32) and integer block dots, as llama.cpp; w [N, row_bytes] uint8 "
        "raw GGML rows of ggml_type; out float32, last stride 1; terms = 2 (M <= 4): x as two "
        "int8 terms (its codes and the codes of what they leave), the products summed",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("ggml_type"), pybind11::arg("out"),
        pybind11::arg("terms") = 1);
  m.def("quant_linear", &NoGil<&quant_linear>::call,
        "A QuantLinear segment's whole call: x [M, K] Wdeq^T as a new tensor, through "
        "quant_gemm_q8_into when x is float32 with M <= int8_rows (and the type is served), else "
        "quant_gemm",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("ggml_type"),
        pybind11::arg("int8_rows"), pybind11::arg("terms") = 1);
  m.def("decoder_layers_f32", &NoGil<&decoder_layers_f32>::call,
        "A pre-norm SwiGLU model's decoder layers over float32 rows and pools in one call (the "
        "Python loop's native ops in its order); x updated in place, returns the last MLP output; "
        "team: a decode's int8-activation layers in one parallel region",
        pybind11::arg("x"), pybind11::arg("pending"), pybind11::arg("norms"), pybind11::arg("eps"),
        pybind11::arg("linears"), pybind11::arg("kinds"), pybind11::arg("int8_rows"),
        pybind11::arg("heads"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("k_caches"), pybind11::arg("v_caches"), pybind11::arg("out_slots"),
        pybind11::arg("page_table"), pybind11::arg("prefix_lens"), pybind11::arg("extend_lens"),
        pybind11::arg("extend_starts"), pybind11::arg("sm_scale"), pybind11::arg("group_members"),
        pybind11::arg("group_offsets"), pybind11::arg("group_shared"),
        pybind11::arg("team") = false, pybind11::arg("terms") = 1);
  m.def("int8_linear_rows", &NoGil<&int8_linear_rows>::call,
        "x [M, K] (q * s)^T as float32 [M, N]: q int8 [N, K], s [N] (float32 or bfloat16), "
        "1 <= M <= int8_linear_max_rows()",
        pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("s"));
  m.def("int8_linear_max_rows", &int8_linear_max_rows,
        "The most rows of x int8_linear_rows takes");
  m.def("quant_decode_rows", &quant_decode_rows,
        "The most float32 rows quant_gemm's decode path takes (0: none in this build)");
  m.def("quant_dequantize_rows", &NoGil<&quant_dequantize_rows>::call,
        "Rows ids (int64 [T]) of raw GGML rows w dequantized exactly, as [T, K] of dtype",
        pybind11::arg("w"), pybind11::arg("ggml_type"), pybind11::arg("ids"),
        pybind11::arg("dtype"));
  m.def("rope_", &NoGil<&rope_>::call,
        "In-place rotate-half RoPE on the first heads of each bf16 row");
}
