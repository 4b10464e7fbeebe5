"""radixkv's decoder: one forward pass for every architecture :mod:`radixkv.model.arch` reads,
over the paged KV pool.

The layer is Llama's (RMSNorm, RoPE, grouped-query attention, a gated MLP) with the features a
:class:`~radixkv.model.model_config.ModelConfig` switches on: q/k RMSNorm per head or over the
projection (Qwen3, Gemma 3, OLMo 2), norms before and/or after each sub-layer (Gemma 3's
sandwich, OLMo 2's post-norms), GeGLU, biases, a residual multiplier, a softmax scale, per-layer
sliding windows (in the native and Triton kernels; :mod:`radixkv.model.attention.window` for the
torch backends) and RoPE (global, local, none), partial
rotary (:mod:`radixkv.model.rope`), scaled embeddings, logit division and soft-capping. Q/K/V are
fused into one ``Linear`` and gate/up into another, so a layer runs four matmuls. A sparse layer
(Qwen3-MoE, Mixtral) runs routed experts in place of the dense MLP (:mod:`radixkv.model.moe`).

The attention reads and writes the KV pool through a
:class:`~radixkv.model.attention.base.ForwardBatch`, so one forward can mix requests that extend
(prefill after a cached prefix) and requests that decode one token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixkv.model.arch import map_weights, read_config
from radixkv.model.attention.base import AttentionBackend, ForwardBatch, split_qkv
from radixkv.model.attention.window import WindowPlan, plan_window, windowed_attention
from radixkv.model.decoder_stack import LayersKey, StackCache, layers_changed
from radixkv.model.linear import prepack_linears
from radixkv.model.model_config import ModelConfig
from radixkv.model.moe import SparseMoeBlock
from radixkv.model.placement import (
    DECODER_PROJECTIONS,
    WeightPlacer,
    pack_tied_head,
    trim_heap,
)
from radixkv.model.rope import RotaryEmbedding, apply_rope, rotary_for

__all__ = ["ModelConfig", "LlamaModel", "RMSNorm", "RotaryEmbedding", "apply_rope", "model_config"]

#: per forward: RoPE kind -> (cos, sin), None for NoPE layers
RopeTables = dict[str, "tuple[torch.Tensor, torch.Tensor] | None"]


def model_config(hf_config: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a transformers config (:func:`radixkv.model.arch.read_config`:
    refuses, by name, a ``model_type`` or field radixkv cannot serve exactly)."""
    return read_config(hf_config)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as transformers does), scaled in the weight's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class FusedParts(NamedTuple):
    """What :meth:`DecoderLayer.forward_fused` calls, looked up once (see ``fused_parts``)."""

    norm_in: RMSNorm
    post_norm: RMSNorm
    qkv: nn.Module
    o: nn.Module
    #: the dense gate/up projection; a sparse layer's experts (``moe(h, act)``)
    gate_up: nn.Module
    #: the down projection; None in a sparse layer
    down: nn.Module | None


def _norm_or_none(present: bool, dim: int, eps: float) -> RMSNorm | None:
    return RMSNorm(dim, eps) if present else None


class DecoderLayer(nn.Module):
    """One decoder layer with fused QKV and gate/up projections and the config's features."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.sm_scale = config.scale
        self.window = config.window(layer_id)
        self.rope_kind = config.rope_kind(layer_id)
        self.qk_norm_kind = config.qk_norm
        self.hidden_act = config.hidden_act
        self.residual_multiplier = config.residual_multiplier
        h, eps, layout = config.hidden_size, config.rms_norm_eps, config.norm_layout
        self.input_layernorm = _norm_or_none(layout in ("pre", "sandwich"), h, eps)
        self.attn_out_norm = _norm_or_none(layout in ("sandwich", "post"), h, eps)
        self.post_attention_layernorm = _norm_or_none(layout in ("pre", "sandwich"), h, eps)
        self.mlp_out_norm = _norm_or_none(layout in ("sandwich", "post"), h, eps)
        per_head = config.qk_norm == "head"
        self.q_norm = _norm_or_none(
            config.qk_norm is not None, self.head_dim if per_head else self.q_size, eps
        )
        self.k_norm = _norm_or_none(
            config.qk_norm is not None, self.head_dim if per_head else self.kv_size, eps
        )
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=config.o_bias)
        #: the routed experts where this layer's MLP is sparse (then it has no dense projections)
        self.moe = SparseMoeBlock(config) if config.is_moe(layer_id) else None
        if self.moe is None:
            self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=config.mlp_bias)
            self.down_proj = nn.Linear(config.intermediate_size, h, bias=config.mlp_bias)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__.pop("_parts_cache", None)  # a submodule may change: look them up afresh
        layers_changed()
        super().__setattr__(name, value)

    def fused_parts(self) -> FusedParts:
        """``(input norm, post-attention norm, qkv, o, gate_up, down)`` for :meth:`forward_fused`,
        whose ``forward`` it calls (``nn.Module.__call__`` and ``__getattr__`` cost ~1 us each,
        ~13 us a layer on the Zen 3 host); made once, again after any attribute of the layer is
        set. A sparse layer's gate_up is its experts, its down None."""
        parts = self.__dict__.get("_parts_cache")
        if parts is None:
            norm_in, post = self.input_layernorm, self.post_attention_layernorm
            assert norm_in is not None and post is not None
            attn = (norm_in, post, self.qkv_proj, self.o_proj)
            if self.moe is None:
                parts = FusedParts(*attn, self.gate_up_proj, self.down_proj)
            else:
                parts = FusedParts(*attn, self.moe, None)
            self.__dict__["_parts_cache"] = parts
        return parts

    def norm_qk_(self, qkv: torch.Tensor) -> None:
        """q/k RMSNorm of the fused projection's rows, in place (before RoPE)."""
        if self.q_norm is None or self.k_norm is None:
            return
        t, qs, ks = qkv.shape[0], self.q_size, self.kv_size
        q, k = qkv[:, :qs], qkv[:, qs : qs + ks]
        if self.qk_norm_kind == "head":
            q.copy_(self.q_norm(q.reshape(t, self.num_heads, -1)).view(t, qs))
            k.copy_(self.k_norm(k.reshape(t, self.num_kv_heads, -1)).view(t, ks))
        else:
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of ``[rows, 2 * I]`` gate|up projections."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.hidden_act == "gelu_tanh":
            return F.gelu(gate, approximate="tanh").mul_(up)
        return F.silu(gate).mul_(up)

    def _mlp(self, h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The dense MLP, or the routed experts, with gated activation ``act``."""
        if self.moe is not None:
            return self.moe(h, act)
        return self.down_proj(act(self.gate_up_proj(h)))

    def _residual(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return x + out

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        meta: Any,
        windows: dict[int, WindowPlan],
    ) -> torch.Tensor:
        t = x.shape[0]
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        qkv = self.qkv_proj(h)
        self.norm_qk_(qkv)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, -1)
        tables = rope[self.rope_kind]
        if tables is not None:
            qk = apply_rope(qk, *tables)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        plan = windows.get(self.window) if self.window is not None else None
        if plan is not None:
            o = windowed_attention(q, k, v, k_cache, v_cache, plan, self.sm_scale)
        elif self.window is not None and backend.windows_in_kernel:
            o = backend.forward(q, k, v, k_cache, v_cache, meta, self.sm_scale, self.window)
        else:
            o = backend.forward(q, k, v, k_cache, v_cache, meta, self.sm_scale)
        a = self.o_proj(o.reshape(t, self.q_size))
        if self.attn_out_norm is not None:
            a = self.attn_out_norm(a)
        x = self._residual(x, a)
        h = self.post_attention_layernorm(x) if self.post_attention_layernorm is not None else x
        m = self._mlp(h, self._gated)
        if self.mlp_out_norm is not None:
            m = self.mlp_out_norm(m)
        return self._residual(x, m)

    def forward_fused(
        self,
        ops: Any,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        rope: RopeTables,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        meta: Any,
        windows: dict[int, WindowPlan],
    ) -> torch.Tensor:
        """The same layer through the native fused ops (:mod:`radixkv.model.native`), bf16 or
        float32 rows; pre-norm layers with SwiGLU only (:meth:`LlamaModel.fused_ops_apply`).

        ``x`` is the residual stream, updated in place; ``pending`` is the previous layer's MLP
        output (times the residual multiplier), not yet added (its add is fused into this
        layer's input RMSNorm). ``rope`` holds float32 ``[T, D]`` tables ("none": the identity,
        cos 1 and sin 0). Returns this layer's MLP output, pending for the next.
        """
        t = x.shape[0]
        norm_in, post, qkv_proj, o_proj, gate_up_proj, down_proj = self.fused_parts()
        w_in = norm_in.weight
        h = (
            ops.rms_norm(x, w_in, norm_in.eps)
            if pending is None
            else ops.add_rms_norm(x, pending, w_in, norm_in.eps)
        )
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        qkv = qkv_proj.forward(h)
        if self.q_norm is not None:
            self.norm_qk_(qkv)
        tables = rope[self.rope_kind]
        assert tables is not None
        plan = windows.get(self.window) if self.window is not None else None
        if plan is not None:
            ops.rope_(qkv, tables[0], tables[1], self.num_heads + self.num_kv_heads, self.head_dim)
            q, k, v = split_qkv(qkv, heads)
            o = windowed_attention(q, k, v, k_cache, v_cache, plan, self.sm_scale)
        else:
            window = self.window if backend.windows_in_kernel else None
            o = backend.forward_qkv(
                ops, qkv, tables[0], tables[1], heads, k_cache, v_cache, meta, self.sm_scale, window
            )
        a = o_proj.forward(o.reshape(t, self.q_size))
        if self.residual_multiplier != 1.0:
            a.mul_(self.residual_multiplier)
        h = ops.add_rms_norm(x, a, post.weight, post.eps)
        if down_proj is None:  # the routed experts
            m = gate_up_proj(h, ops.silu_mul)
        else:
            m = down_proj.forward(ops.silu_mul(gate_up_proj.forward(h)))
        if self.residual_multiplier != 1.0:
            m.mul_(self.residual_multiplier)
        return m


class LlamaModel(nn.Module):
    """The decoder-only causal LM of every supported architecture, over a paged KV pool."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish", "gelu_tanh"):
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported")
        if config.num_heads % config.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotaries = self._make_rotaries()
        # CPU: norms, RoPE and SiLU through radixkv.model.native's fused ops when built
        self.use_fused_ops = True
        #: the fused layers as one native call where they allow it (:class:`StackCache`)
        self.use_decoder_stack = True
        self.stack_cache = StackCache()
        self.requires_grad_(False)

    def _make_rotaries(self) -> dict[str, RotaryEmbedding]:
        kinds = {self.config.rope_kind(i) for i in range(self.config.num_layers)} - {"none"}
        with torch.device("cpu"):
            return {kind: rotary_for(self.config, kind) for kind in sorted(kinds)}

    @property
    def rotary(self) -> RotaryEmbedding:
        """The global layers' RoPE tables."""
        return self.rotaries["global"]

    @property
    def fused_ops_apply(self) -> bool:
        """Whether the native fused layer (pre-norms, SwiGLU) computes this architecture."""
        return self.config.norm_layout == "pre" and self.config.hidden_act in ("silu", "swish")

    @classmethod
    def from_weights(
        cls, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device | str
    ) -> LlamaModel:
        """Build from weights in radixkv's layout (:mod:`radixkv.model.arch.common`), every
        linear prepacked for the host. ``weights`` is emptied: each tensor then lives in the
        model alone, so a projection whose packed copy is all its GEMM reads frees its plain
        one when its layer is packed (:class:`~radixkv.model.placement.WeightPlacer`)."""
        model, place = cls._placing(config)
        for name in list(weights):  # popped: the model holds the only reference
            place(name, weights.pop(name))
        return model._placed(place, device)

    @classmethod
    def from_hf_state_dict(
        cls,
        config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantization: str | None = None,
    ) -> LlamaModel:
        """Build from a transformers state dict of ``config``'s architecture
        (:func:`radixkv.model.arch.map_weights` fuses QKV and gate/up, and refuses a weight it
        would drop). Each weight is placed as it is made and each layer packed once whole, so
        a streamed checkpoint never has the whole model in both layouts; a checkpoint that hands
        out tensors nobody else holds (``fresh_tensors``) lets each be packed without both its
        layouts held whole (:mod:`radixkv.model.repack`). ``quantization="int8"``: each layer's
        projections become :class:`~radixkv.model.int8_linear.Int8Linear` as it completes."""
        owned = bool(getattr(state_dict, "fresh_tensors", False))
        model, place = cls._placing(config, owned, quantization)
        map_weights(config, state_dict, dtype, device, sink=place)
        return model._placed(place, device)

    @classmethod
    def _placing(
        cls, config: ModelConfig, owned: bool = False, quantization: str | None = None
    ) -> tuple[LlamaModel, WeightPlacer]:
        with torch.device("meta"):
            model = cls(config)
        return model, WeightPlacer(model, config.model_type, owned, quantization)

    def _placed(self, placer: WeightPlacer, device: torch.device | str) -> LlamaModel:
        """The model once every weight is placed: the head tied where none was given, RoPE
        tables on ``device``, the linears not packed yet (the head) packed: a tied head whose
        packed copy is all its GEMM reads held once (:func:`~radixkv.model.placement.
        pack_tied_head`), an untied one without its plain weight."""
        if "lm_head.weight" not in placer.placed:
            self.lm_head.weight = self.embed_tokens.weight
        missing = placer.missing()
        if missing:
            raise KeyError(f"weight {missing[0]!r} missing from the state dict")
        for rotary in self.rotaries.values():  # made on the CPU when the model was
            rotary.to(device)
        trim_heap()  # what the last layer freed, before the head's packing
        # CPU float32, and bf16 with native bf16: every linear prepacked (radixkv.model.linear),
        # keeping only its packed copy where that is all the GEMM reads
        pack_tied_head(self, placer.owned_kind)
        prepack_linears(self, release=(*DECODER_PROJECTIONS, "lm_head"), owned=placer.owned_kind)
        trim_heap()
        return self.eval()

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype, rows: bool) -> RopeTables:
        """Per RoPE kind, ``cos, sin`` at ``positions``: ``[T, 1, D]`` in ``dtype``, or with
        ``rows`` float32 ``[T, D]`` contiguous (the fused ops'), where "none" is the identity."""
        tables: RopeTables = {"none": None}
        for kind, rotary in self.rotaries.items():
            cos, sin = rotary.lookup(positions, torch.float32 if rows else dtype)
            tables[kind] = (
                (cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous()) if rows else (cos, sin)
            )
        if rows and self._has_unrotated_layer():
            t, d = positions.shape[0], self.config.head_dim
            ones = torch.ones(t, d, dtype=torch.float32, device=positions.device)
            tables["none"] = (ones, torch.zeros_like(ones))
        return tables

    def _has_unrotated_layer(self) -> bool:
        """Whether some layer's RoPE kind is "none" (looked up again after the layers change)."""
        cached = self.__dict__.get("_unrotated")
        if cached is None or not cached[0].matches(self.layers):
            key = LayersKey(self.layers)
            cached = (key, any(layer.rope_kind == "none" for layer in key.layers))
            self.__dict__["_unrotated"] = cached
        return cached[1]

    def _window_plans(
        self, batch: ForwardBatch, backend: AttentionBackend
    ) -> dict[int, WindowPlan]:
        """The step's plan of each layer window that a request's span exceeds, for a backend
        whose kernels do not take windows (none for one that does: it is given the window)."""
        plans: dict[int, WindowPlan] = {}
        if backend.windows_in_kernel:
            return plans
        for w in {layer.window for layer in self.layers if layer.window is not None}:
            plan = plan_window(batch, w)
            if plan is not None:
                plans[w] = plan
        return plans

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        scale = self.config.embedding_scale
        if scale == 1.0:
            return x
        if self.config.model_type.startswith("gemma"):  # the scale rounded to the dtype first
            return x * torch.tensor(scale, dtype=x.dtype, device=x.device)
        return x * scale

    def _final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.logits_divisor != 1.0:
            logits = logits / self.config.logits_divisor
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        backend: AttentionBackend,
        return_all_logits: bool = False,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """Run one step; returns logits ``[B, vocab]`` (or ``[T, vocab]``): float32, or with
        ``float_logits=False`` in the model's dtype as the head computed them (a bf16 model's
        float32 copy is exact, so a consumer may make it when it needs one)."""
        dtype = self.embed_tokens.weight.dtype
        meta = backend.prepare(batch, dtype)
        windows = self._window_plans(batch, backend)
        ops = self._fused_ops(backend)
        if ops is not None:
            logits = self._forward_fused(
                ops, batch, k_caches, v_caches, backend, meta, windows, return_all_logits
            )
        else:
            rope = self._rope_tables(batch.positions, dtype, rows=False)
            x = self._embed(batch.input_ids)
            for i, layer in enumerate(self.layers):
                x = layer(x, rope, k_caches[i], v_caches[i], backend, meta, windows)
            if not return_all_logits:
                (x,) = _last_token_rows(batch, x)
            logits = self.lm_head(self.norm(x))
        logits = self._final_logits(logits)
        return logits.float() if float_logits else logits

    def _fused_ops(self, backend: AttentionBackend) -> Any | None:
        """The native fused ops when this model runs on the CPU, its layers are pre-norm SwiGLU
        and the ops are built: the attention backend's own native build where it has one (one
        ISA level per runner). bf16 models use them with every backend; float32 models only
        with a native attention backend (the plain torch backend, ``RADIXKV_FP32_ATTENTION=
        plain``, keeps transformers' own op order)."""
        w = self.norm.weight  # the embedding's may be a meta tensor (PackedEmbedding)
        if w.device.type != "cpu" or not self.use_fused_ops or not self.fused_ops_apply:
            return None
        module = getattr(backend, "module", None)
        if w.dtype == torch.float32:
            return module
        if w.dtype != torch.bfloat16:
            return None
        if module is not None:
            return module
        from radixkv.model import native

        return native.load()

    def _forward_fused(
        self,
        ops: Any,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        backend: AttentionBackend,
        meta: Any,
        windows: dict[int, WindowPlan],
        return_all_logits: bool,
    ) -> torch.Tensor:
        rope = self._rope_tables(batch.positions, torch.float32, rows=True)
        x = self._embed(batch.input_ids)
        stack = self.stack_cache.for_step(self, ops, backend, x, k_caches, windows)
        tables = None if stack is None else rope[stack.rope_kind]
        pending = None
        if stack is not None and tables is not None:
            pending = stack.run(ops, x, tables[0], tables[1], k_caches, v_caches, meta)
        else:
            for i, layer in enumerate(self.layers):
                pending = layer.forward_fused(
                    ops, x, pending, rope, k_caches[i], v_caches[i], backend, meta, windows
                )
        assert pending is not None
        if not return_all_logits:
            x, pending = _last_token_rows(batch, x, pending)
        h = ops.add_rms_norm(x, pending, self.norm.weight, self.norm.eps)
        return self.lm_head(h)


def _last_token_rows(batch: ForwardBatch, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rows of each request's last new token in each of ``xs`` (``[T, ...]`` tensors)."""
    rows = batch.last_token_rows
    if rows == list(range(xs[0].shape[0])):
        return xs
    idx = torch.tensor(rows, dtype=torch.long, device=xs[0].device)
    return tuple(x.index_select(0, idx) for x in xs)
