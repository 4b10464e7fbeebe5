"""A GGUF file served in its own quantization (``--quantization gguf``): radixkv's model built
straight from the file's tensors, the block-quantized ones kept as the file's bytes.

:class:`~radixkv.model.gguf_weights.GgufWeights` is what :mod:`radixkv.model.loader` hands the
runner instead of a checkpoint: the file's header (read once), and each tensor read on demand
at its offset (the process never maps the whole file, and no float copy of a quantized tensor is
ever made): the quantized linears' and embedding's bytes straight into one
:class:`~radixkv.model.weight_arena.WeightArena` (one after another, in huge pages; q/k/v and
gate/up of one type adjacent, so each fused projection is one tensor with no copy), the rest
into memory of their own.
:func:`build_quantized_model` places them into a :class:`~radixkv.model.llama.LlamaModel` built
on the meta device, by llama.cpp's tensor names:

- ``blk.{i}.attn_q/attn_k/attn_v`` -> ``qkv_proj`` (one :class:`~radixkv.model.quant_linear.
  QuantLinear`, a segment per tensor, so q/k/v of different types still fuse),
  ``attn_output`` -> ``o_proj``, ``ffn_gate/ffn_up`` -> ``gate_up_proj``, ``ffn_down`` ->
  ``down_proj``; biases (Qwen2's q/k/v) float, in the model's dtype;
- ``attn_norm``, ``ffn_norm``, ``output_norm`` -> the RMSNorms (float);
- ``token_embd`` -> a :class:`~radixkv.model.quant_linear.QuantEmbedding`, and the head
  (``output``, or ``token_embd``'s own rows when the file ties them: held once).

llama.cpp permutes the q and k rows of ``llama`` files (rotate-half pairs to interleaved,
``convert_hf_to_gguf.py``'s ``LlamaModel.permute``); transformers' reader undoes it on the
dequantized weights. The permutation moves whole output rows, and every row is whole blocks,
so it is undone here on the raw rows (and the biases) before they are fused: the model's q/k
are transformers'.

Which form each projection takes (:func:`projection_kind`): block-quantized rows the native build
multiplies (``quant_gemm_into``) stay quantized; where the build has no such op at all (no
compiler, or an older build), they stay quantized too and the torch fallback dequantizes per call
(slow, warned); a type the native op lacks but gguf-py reads, or a float tensor (F32/F16/BF16),
is dequantized here into a plain float linear (a log line says which); a type neither reads is
refused by name.

Architectures: the ``llama`` (Llama, SmolLM2, Mistral) and ``qwen2`` GGUFs, dense; any other is
refused by name (:func:`~radixkv.model.gguf_weights.check_quantized_architecture`). Memory: the quantized bytes plus the float
norms and biases, about the file's size.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from radixkv.model.arch.common import UnsupportedModelError
from radixkv.model.gguf_weights import (
    FLOAT_TYPES,
    GgufWeights,
    check_quantized_architecture,
    dequantize_rows,
    type_name,
)
from radixkv.model.linear import prepack_linears
from radixkv.model.llama import LlamaModel
from radixkv.model.model_config import ModelConfig
from radixkv.model.placement import trim_heap
from radixkv.model.quant_linear import (
    QuantEmbedding,
    QuantLinear,
    can_dequantize,
    native_types,
    same_run,
)
from radixkv.model.weight_arena import ALIGN, WeightArena

__all__ = ["build_quantized_model", "projection_kind"]

log = logging.getLogger(__name__)


def projection_kind(types: list[int]) -> str:
    """``"quant"`` (a :class:`QuantLinear`) or ``"plain"`` (dequantized at load) for a
    projection whose row segments have ggml ``types``; raises naming a type nothing reads."""
    for t in types:
        if t not in native_types() and not can_dequantize(t):
            raise UnsupportedModelError(
                f"--quantization gguf: ggml type {type_name(t)} has no native kernel here and "
                "gguf-py cannot dequantize it"
            )
    if any(t in FLOAT_TYPES for t in types):
        return "plain"
    native = native_types()
    if not native or all(t in native for t in types):
        return "quant"
    return "plain"


def _llama_unpermute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation on ``t``'s rows (raw rows or a bias):
    transformers' ``_reverse_permute_weights``."""
    half = t.shape[0] // n_head // 2
    return t.reshape(n_head, half, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape).contiguous()


class _Builder:
    """Reads the file's tensors into linears, embeddings and norms of ``config``'s model."""

    def __init__(self, config: ModelConfig, weights: GgufWeights, dtype: torch.dtype) -> None:
        self.config, self.weights, self.dtype = config, weights, dtype
        self.permute = weights.header.arch == "llama"
        self.plain: list[str] = []
        self.used: set[str] = set()
        #: the quantized linears' and embedding's bytes, one after another in huge pages
        #: (capacity: the file's whole tensor data, an upper bound; committed only where used)
        self.arena = WeightArena(weights.data_bytes() + ALIGN * len(weights.header.tensors))

    def rows(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name``'s raw rows (llama's q/k un-permuted), in memory of their own or read
        into ``out`` (:meth:`GgufWeights.raw_into`)."""
        self.used.add(name)
        raw = self.weights.raw(name) if out is None else self.weights.raw_into(name, out)
        if self.permute and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.config.num_heads if "attn_q" in name else self.config.num_kv_heads
            fixed = _llama_unpermute(raw, heads)
            raw = fixed if out is None else out.copy_(fixed)
        return raw

    def quant_segments(self, names: list[str], types: list[int]) -> list[tuple[torch.Tensor, int]]:
        """A quantized linear's ``(raw, ggml_type)`` segments: each run of adjacent tensors of
        one type and row size as one (:func:`merge_segments`' runs), read straight into the
        arena where it is on (else read one by one, for :class:`QuantLinear` to merge)."""
        runs: list[tuple[list[str], int, int]] = []
        for name, t in zip(names, types, strict=True):
            row_bytes = self.weights.row_shape(name)[1]
            if runs and same_run(runs[-1][1], runs[-1][2], t, row_bytes):
                runs[-1][0].append(name)
            else:
                runs.append(([name], t, row_bytes))
        segments: list[tuple[torch.Tensor, int]] = []
        for run, t, row_bytes in runs:
            counts = [self.weights.row_shape(name)[0] for name in run]
            view = self.arena.reserve(sum(counts), row_bytes)
            if view is None:
                segments.extend((self.rows(name), t) for name in run)
                continue
            r0 = 0
            for name, n in zip(run, counts, strict=True):
                self.rows(name, view[r0 : r0 + n])
                r0 += n
            segments.append((view, t))
        return segments

    def float_tensor(self, name: str) -> torch.Tensor:
        self.used.add(name)
        t = self.weights.dense(name, torch.float32)
        if self.permute and name.endswith(("attn_q.bias", "attn_k.bias")):
            heads = self.config.num_heads if "attn_q" in name else self.config.num_kv_heads
            t = _llama_unpermute(t, heads)
        return t.to(self.dtype).contiguous()

    def linear(self, names: list[str], bias: bool, label: str) -> nn.Module:
        """One projection over tensors ``names`` (their rows concatenated)."""
        types = [self.weights.ggml_type(n) for n in names]
        k = self.weights.shape(names[0])[-1]
        b = None
        if bias:
            b = torch.cat([self.float_tensor(n.replace(".weight", ".bias")) for n in names])
        if projection_kind(types) == "quant":
            return QuantLinear(self.quant_segments(names, types), k, b)
        self.plain.append(f"{label} ({'/'.join(type_name(t) for t in types)})")
        w = torch.cat([dequantize_rows(self.rows(n), t, self.dtype) for n, t in zip(names, types)])
        linear = nn.Linear(k, w.shape[0], bias=b is not None, device="meta")
        linear.weight = nn.Parameter(w, requires_grad=False)
        if b is not None:
            linear.bias = nn.Parameter(b, requires_grad=False)
        return linear

    def norm(self, module: Any, name: str) -> None:
        module.weight = nn.Parameter(self.float_tensor(name), requires_grad=False)


def build_quantized_model(config: ModelConfig, weights: GgufWeights, dtype: torch.dtype) -> Any:
    """The :class:`~radixkv.model.llama.LlamaModel` of ``config`` with GGUF
    ``weights`` placed as the module says: every tensor of the file read once, none left over
    (``rope_freqs`` is the config's), no parameter left on the meta device but the quantized
    embedding's shape-only ``weight``."""
    header = weights.header
    check_quantized_architecture(header.arch, config.model_type)
    if config.is_moe(0) or config.norm_layout != "pre" or config.qk_norm:
        raise UnsupportedModelError(
            f"--quantization gguf: {config.model_type} with these features is not built from "
            "GGUF; leave --quantization unset"
        )
    build = _Builder(config, weights, dtype)
    # the heap the tokenizer's load freed (~30 MB for a 49k vocabulary) back to the OS first:
    # the blocks are read into fresh mappings, which would not reuse it
    trim_heap()
    with torch.device("meta"):
        model = LlamaModel(config)
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        qkv = [p + f"attn_{n}.weight" for n in "qkv"]
        layer.qkv_proj = build.linear(qkv, config.attention_bias, f"layer {i} qkv")
        layer.o_proj = build.linear([p + "attn_output.weight"], config.o_bias, f"layer {i} o")
        gate_up = [p + "ffn_gate.weight", p + "ffn_up.weight"]
        layer.gate_up_proj = build.linear(gate_up, config.mlp_bias, f"layer {i} gate_up")
        layer.down_proj = build.linear([p + "ffn_down.weight"], config.mlp_bias, f"layer {i} down")
        build.norm(layer.input_layernorm, p + "attn_norm.weight")
        build.norm(layer.post_attention_layernorm, p + "ffn_norm.weight")
    build.norm(model.norm, "output_norm.weight")
    _place_embedding_and_head(model, build, config)
    build.arena.check_integrity()
    left = sorted(set(header.tensors) - build.used - {"rope_freqs.weight"})
    if left:
        raise UnsupportedModelError(
            f"--quantization gguf: GGUF tensor {left[0]!r} is read by nothing"
        )
    for rotary in model.rotaries.values():
        rotary.to("cpu")
    if build.plain:
        log.info(
            "--quantization gguf: dequantized at load into float linears (no native kernel for "
            "their type, or float in the file): %s",
            ", ".join(build.plain),
        )
    meta = [n for n, t in model.named_parameters() if t.is_meta and n != "embed_tokens.weight"]
    assert not meta, f"parameters left unplaced: {meta}"
    # the float linears (dequantized here) packed as every float model's are
    prepack_linears(model, release=("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"))
    return model.eval()


def _place_embedding_and_head(model: Any, build: _Builder, config: ModelConfig) -> None:
    """``token_embd`` as a :class:`QuantEmbedding` (a float one where the file stores floats),
    and the head: ``output`` where the file has it, else the embedding's own rows (tied)."""
    weights, h = build.weights, config.hidden_size
    kind = weights.ggml_type("token_embd.weight")
    tied = "output.weight" not in weights
    if kind in FLOAT_TYPES:
        table = build.weights.dense("token_embd.weight", build.dtype)
        build.used.add("token_embd.weight")
        model.embed_tokens = nn.Embedding(table.shape[0], h, device="meta")
        model.embed_tokens.weight = nn.Parameter(table, requires_grad=False)
        if tied:
            head = nn.Linear(h, table.shape[0], bias=False, device="meta")
            head.weight = model.embed_tokens.weight
            model.lm_head = head
    else:
        ((raw, _),) = build.quant_segments(["token_embd.weight"], [kind])
        model.embed_tokens = QuantEmbedding(raw, kind, h, build.dtype)
        if tied:
            model.lm_head = (
                QuantLinear([(raw, kind)], h)
                if projection_kind([kind]) == "quant"
                else build.linear(["token_embd.weight"], False, "tied lm_head")
            )
    if not tied:
        model.lm_head = build.linear(["output.weight"], False, "lm_head")
