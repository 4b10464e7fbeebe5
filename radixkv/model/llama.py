"""Our own Llama-family forward pass over the paged KV pool.

Supports Llama / SmolLM / Mistral-style / Qwen2 (QKV bias) decoder-only models: RMSNorm, RoPE
(with ``linear`` and ``llama3`` scaling), grouped-query attention, SwiGLU MLP, tied or untied
embeddings. Weights come from a transformers model's state dict; Q/K/V are fused into one
``Linear`` and gate/up into another, so a layer runs four matmuls.

The attention reads and writes the KV pool through a :class:`~radixkv.model.attention.base.ForwardBatch`,
so one forward can mix requests that extend (prefill after a cached prefix) and requests that
decode one token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixkv.model.attention.base import AttentionBackend, ForwardBatch
from radixkv.model.linear import prepack_linears

__all__ = ["ModelConfig", "LlamaModel", "RMSNorm", "RotaryEmbedding"]


@dataclass
class ModelConfig:
    """The architecture numbers our forward pass needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    eos_token_id: int | list[int] | None = None
    hidden_act: str = "silu"

    @classmethod
    def from_hf(cls, config: Any) -> ModelConfig:
        """Read a transformers config (Llama, Mistral, Qwen2...; transformers 4.x and 5.x)."""
        model_type = getattr(config, "model_type", "llama")
        if model_type not in {"llama", "mistral", "qwen2", "smollm3", "granite"} and not hasattr(
            config, "num_key_value_heads"
        ):
            raise ValueError(f"unsupported model_type {model_type!r}")
        num_heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        rope_params = getattr(config, "rope_parameters", None)
        rope_scaling = getattr(config, "rope_scaling", None)
        theta = getattr(config, "rope_theta", None)
        if isinstance(rope_params, dict):
            theta = rope_params.get("rope_theta", theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        if theta is None:
            theta = 10000.0
        attention_bias = bool(getattr(config, "attention_bias", False)) or model_type == "qwen2"
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 4096)),
            eos_token_id=getattr(config, "eos_token_id", None),
            hidden_act=str(getattr(config, "hidden_act", "silu")),
        )


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


def _rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32) and the attention scaling for the configured RoPE."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise NotImplementedError(f"RoPE scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """RoPE tables; :meth:`lookup` returns ``cos``/``sin`` rows for the batch's positions.

    ``sin`` is returned sign-folded (``[-sin, sin]`` halves) so that applying RoPE is
    ``x * cos + roll(x, D/2) * sin``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = _rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._grow(max(config.max_position_embeddings, 1))

    def _grow(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = freqs.shape[-1]
        sin = emb.sin() * self.attention_scaling
        sin[:, :half] = -sin[:, :half]
        self._cos = emb.cos() * self.attention_scaling
        self._sin = sin

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, D]`` in ``dtype`` for ``positions [T]``."""
        assert self._cos is not None and self._sin is not None
        max_pos = int(positions.max()) + 1 if positions.numel() else 0
        if max_pos > self._cos.shape[0]:
            self._grow(max(max_pos, 2 * self._cos.shape[0]))
        if self._cos.device != positions.device:
            self._cos = self._cos.to(positions.device)
            self._sin = self._sin.to(positions.device)
        cos = self._cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self._sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, H, D]`` with sign-folded ``sin`` (see RotaryEmbedding)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer with fused QKV and gate/up projections."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.sm_scale = config.head_dim**-0.5
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.intermediate_size = config.intermediate_size

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        meta: Any,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, -1)
        qk = apply_rope(qk, cos, sin)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, k_cache, v_cache, meta, self.sm_scale)
        x = x + self.o_proj(o.reshape(t, self.q_size))
        gate_up = self.gate_up_proj(self.post_attention_layernorm(x))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return x + self.down_proj(F.silu(gate).mul_(up))

    def forward_fused(
        self,
        ops: Any,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        meta: Any,
    ) -> torch.Tensor:
        """The same layer through the native fused ops (:mod:`radixkv.model.native`), bf16 or
        float32 rows.

        ``x`` is the residual stream, updated in place; ``pending`` is the previous layer's MLP
        output, not yet added (its add is fused into this layer's input RMSNorm). ``cos``/``sin``
        are float32 ``[T, D]``. Returns this layer's MLP output, pending for the next.
        """
        t = x.shape[0]
        eps = self.input_layernorm.eps
        w_in = self.input_layernorm.weight
        h = (
            ops.rms_norm(x, w_in, eps)
            if pending is None
            else ops.add_rms_norm(x, pending, w_in, eps)
        )
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        o = backend.forward_qkv(
            ops, self.qkv_proj(h), cos, sin, heads, k_cache, v_cache, meta, self.sm_scale
        )
        post = self.post_attention_layernorm
        h = ops.add_rms_norm(x, self.o_proj(o.reshape(t, self.q_size)), post.weight, post.eps)
        return self.down_proj(ops.silu_mul(self.gate_up_proj(h)))


class LlamaModel(nn.Module):
    """Decoder-only Llama-family causal LM over a paged KV pool."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
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
        self.rotary = RotaryEmbedding(config)
        # bf16 on the CPU runs norms, RoPE and SiLU through radixkv.model.native's fused ops when built
        self.use_fused_ops = True
        self.requires_grad_(False)

    @classmethod
    def from_hf_state_dict(
        cls,
        config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> LlamaModel:
        """Build from a transformers ``LlamaForCausalLM``-style state dict (fusing QKV, gate/up)."""
        with torch.device("meta"):
            model = cls(config)
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise KeyError(f"weight {name!r} missing from the state dict")
            return sd[name].to(device=device, dtype=dtype)

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.contiguous(), requires_grad=False)

        model.embed_tokens.weight = param(take("embed_tokens.weight"))
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            layer.qkv_proj.weight = param(
                torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"], dim=0)
            )
            if config.attention_bias:
                layer.qkv_proj.bias = param(
                    torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"], dim=0)
                )
            layer.o_proj.weight = param(take(a + "o_proj.weight"))
            layer.gate_up_proj.weight = param(
                torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0)
            )
            layer.down_proj.weight = param(take(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight = param(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight = param(
                take(p + "post_attention_layernorm.weight")
            )
        model.norm.weight = param(take("norm.weight"))
        if config.tie_word_embeddings or "lm_head.weight" not in sd:
            model.lm_head.weight = model.embed_tokens.weight
        else:
            model.lm_head.weight = param(take("lm_head.weight"))
        model.rotary = RotaryEmbedding(config).to(device)
        # CPU float32, and bf16 with native bf16: every linear prepacked for oneDNN
        # (see radixkv.model.linear)
        prepack_linears(model)
        return model.eval()

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
        ops = self._fused_ops(backend)
        if ops is not None:
            logits = self._forward_fused(
                ops, batch, k_caches, v_caches, backend, meta, return_all_logits
            )
        else:
            cos, sin = self.rotary.lookup(batch.positions, dtype)
            x = self.embed_tokens(batch.input_ids)
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, k_caches[i], v_caches[i], backend, meta)
            if not return_all_logits:
                (x,) = _last_token_rows(batch, x)
            logits = self.lm_head(self.norm(x))
        return logits.float() if float_logits else logits

    def _fused_ops(self, backend: AttentionBackend) -> Any | None:
        """The native fused ops when this model runs on the CPU and they are built: the attention
        backend's own native build where it has one (one ISA level per runner). bf16 models use
        them with every backend; float32 models only with a native attention backend (the plain
        torch backend, ``RADIXKV_FP32_ATTENTION=plain``, keeps transformers' own op order)."""
        w = self.embed_tokens.weight
        if w.device.type != "cpu" or not self.use_fused_ops:
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
        return_all_logits: bool,
    ) -> torch.Tensor:
        cos, sin = self.rotary.lookup(batch.positions, torch.float32)
        cos, sin = cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous()
        x = self.embed_tokens(batch.input_ids)
        pending = None
        for i, layer in enumerate(self.layers):
            pending = layer.forward_fused(
                ops, x, pending, cos, sin, k_caches[i], v_caches[i], backend, meta
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
