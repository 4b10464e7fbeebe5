"""What every architecture module shares: reading the common config fields, refusing what radixkv
cannot serve exactly (by the field's name), and taking a checkpoint's weights into radixkv's
layout with nothing left over.

radixkv's layout of a decoder layer ``layers.{i}.``: ``qkv_proj`` (q rows, then k, then v),
``o_proj``, ``gate_up_proj`` (gate rows, then up), ``down_proj`` (each ``.weight``, ``.bias``
where the config says), the norms ``input_layernorm`` (before attention), ``attn_out_norm`` (on
the attention's output), ``post_attention_layernorm`` (before the MLP, Llama's name),
``mlp_out_norm`` (on the MLP's output), ``q_norm``, ``k_norm``; then ``embed_tokens``, ``norm``,
``lm_head``. Norm weights are stored as the multiplier they apply (Gemma's ``1 + w`` is added at
load, in float32, as Gemma's RMSNorm computes it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from radixkv.model.model_config import ModelConfig
from radixkv.model.rope import SUPPORTED_ROPE_TYPES, partial_rotary_permutation

__all__ = ["UnsupportedModelError", "WeightTaker", "base_config", "refuse"]


class UnsupportedModelError(ValueError):
    """A checkpoint radixkv cannot serve exactly; the message names the ``model_type``, config
    field or weight it does not support."""


def refuse(model_type: str, what: str, why: str = "") -> UnsupportedModelError:
    """The error for an unsupported ``what`` (a field with its value, or a weight's name)."""
    tail = f": {why}" if why else ""
    return UnsupportedModelError(f"{model_type}: {what} is not supported by radixkv{tail}")


def _get(hf: Any, name: str, default: Any = None) -> Any:
    return getattr(hf, name, default)


def rope_parameters(hf: Any, layer_type: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling or None)`` of a transformers 4.x or 5.x config (5.x's
    ``rope_parameters`` may be keyed by layer type, Gemma 3's)."""
    params = _get(hf, "rope_parameters")
    if isinstance(params, dict) and layer_type and layer_type in params:
        params = params[layer_type]
    theta = _get(hf, "rope_theta")
    scaling = _get(hf, "rope_scaling")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = params if params.get("rope_type", "default") != "default" else None
    return float(theta if theta is not None else 10000.0), (dict(scaling) if scaling else None)


def check_rope(model_type: str, scaling: dict[str, Any] | None) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise refuse(
            model_type,
            f"rope_scaling rope_type={kind!r}",
            f"radixkv computes {', '.join(SUPPORTED_ROPE_TYPES)}",
        )


#: Fields whose non-default value changes the forward pass in a way no architecture module here
#: computes: (field, the values radixkv serves).
NEVER_SUPPORTED: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("attn_logit_softcapping", lambda v: v is None),
    ("use_bidirectional_attention", lambda v: not v),
    ("num_experts", lambda v: not v),
    ("num_local_experts", lambda v: not v),
    ("mup_scale", lambda v: v is None),
)


def base_config(
    hf: Any, model_type: str, *, computed: tuple[str, ...] = (), **features: Any
) -> ModelConfig:
    """The fields every family shares, read from ``hf``; ``features`` set the rest. Refuses
    the fields of :data:`NEVER_SUPPORTED` but those the architecture module says it
    ``computed`` itself (the MoE modules: the expert counts), quantized checkpoints and unknown
    RoPE kinds."""
    for name, ok in NEVER_SUPPORTED:
        if name not in computed and hasattr(hf, name) and not ok(getattr(hf, name)):
            raise refuse(model_type, f"{name}={getattr(hf, name)!r}")
    quant = _get(hf, "quantization_config")
    if quant:
        method = (
            quant.get("quant_method")
            if isinstance(quant, dict)
            else getattr(quant, "quant_method", quant)
        )
        raise refuse(
            model_type,
            f"quantization_config (quant_method={method!r})",
            "serve an unquantized checkpoint, or a GGUF file",
        )
    num_heads = int(hf.num_attention_heads)
    hidden = int(hf.hidden_size)
    head_dim = int(_get(hf, "head_dim") or hidden // num_heads)
    theta, scaling = rope_parameters(hf)
    check_rope(model_type, scaling)
    act = str(_get(hf, "hidden_act") or _get(hf, "hidden_activation") or "silu")
    act = {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(act, act)
    if act not in ("silu", "gelu_tanh"):
        raise refuse(model_type, f"hidden_act={act!r}", "radixkv runs silu and gelu_pytorch_tanh")
    values: dict[str, Any] = dict(
        vocab_size=int(hf.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(hf.intermediate_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(_get(hf, "num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(_get(hf, "rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        max_position_embeddings=int(_get(hf, "max_position_embeddings") or 4096),
        eos_token_id=_get(hf, "eos_token_id"),
        hidden_act=act,
        model_type=model_type,
    )
    values.update(features)
    config = ModelConfig(**values)
    if config.num_heads % config.num_kv_heads:
        raise refuse(
            model_type,
            f"num_attention_heads={config.num_heads} with "
            f"num_key_value_heads={config.num_kv_heads}",
            "not a multiple",
        )
    return config


def layer_windows_from_types(hf: Any, model_type: str) -> list[int | None] | None:
    """Per-layer windows from transformers' ``layer_types`` (``sliding_attention`` layers get
    ``sliding_window``), else from ``sliding_window`` alone (Mistral, Phi-3: every layer)."""
    window = _get(hf, "sliding_window")
    types = _get(hf, "layer_types")
    n = int(hf.num_hidden_layers)
    if types:
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise refuse(model_type, f"layer_types {sorted(unknown)}")
        if "sliding_attention" in types and not window:
            raise refuse(model_type, "sliding_attention layers without sliding_window")
        windows = [int(window) if t == "sliding_attention" else None for t in types]
        return windows if any(w is not None for w in windows) else None
    if _get(hf, "use_sliding_window") is False:
        return None
    return [int(window)] * n if window else None


class WeightTaker:
    """Takes a checkpoint's tensors by name, in the target dtype; :meth:`finish` refuses any
    weight nobody took (a feature this module does not know would otherwise be dropped).

    Each tensor :meth:`put` makes is final when it is put (partial rotary's permutation is
    applied then, with ``config``): it goes to ``sink`` where one is given (the model's builder,
    which packs a layer as soon as it is whole, so the load never holds the whole model twice),
    else into ``out``."""

    #: checkpoint entries that carry no weights of the model
    IGNORED = ("rotary_emb.inv_freq",)

    def __init__(
        self,
        model_type: str,
        state_dict: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str,
        config: ModelConfig | None = None,
        sink: Callable[[str, torch.Tensor], None] | None = None,
    ) -> None:
        self.model_type = model_type
        self.source = state_dict  # a dict, or a checkpoint read tensor by tensor on access
        self.sd = {k.removeprefix("model."): k for k in state_dict}  # our name -> its name
        self.dtype = dtype
        self.device = device
        self.taken: set[str] = set()
        self.out: dict[str, torch.Tensor] = {}
        self.stored: set[str] = set()  # every name put, sunk or in out
        self.sink = sink
        partial = config is not None and config.rotary_dim and config.rotary_dim != config.head_dim
        self.rotary = config if partial else None

    def has(self, name: str) -> bool:
        return name in self.sd

    def raw(self, name: str) -> torch.Tensor:
        """The checkpoint's tensor ``name`` as stored (marked taken)."""
        if name not in self.sd:
            raise refuse(
                self.model_type,
                f"a checkpoint without weight {name!r}",
                "the config says the model has it",
            )
        self.taken.add(name)
        return self.source[self.sd[name]]

    def take(self, name: str) -> torch.Tensor:
        return self.raw(name).to(device=self.device, dtype=self.dtype)

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` (radixkv's name) in the target dtype, contiguous."""
        tensor = tensor.to(device=self.device, dtype=self.dtype).contiguous()
        if self.rotary is not None:
            tensor = permute_rotary(name, tensor, self.rotary)
        self.stored.add(name)
        if self.sink is not None:
            self.sink(name, tensor)
        else:
            self.out[name] = tensor

    def cat(self, name: str, sources: Iterable[str]) -> None:
        self.put(name, torch.cat([self.raw(s).to(self.dtype) for s in sources], dim=0))

    def norm(self, name: str, source: str, offset: float = 0.0) -> None:
        """A norm weight; ``offset`` 1.0 for Gemma's ``(1 + w)`` (added in float32)."""
        w = self.raw(source)
        self.put(name, w.float() + offset if offset else w)

    def finish(self, tied: bool) -> dict[str, torch.Tensor]:
        left = [k for k in self.sd if k not in self.taken and not k.endswith(self.IGNORED)]
        if tied:
            left = [k for k in left if k != "lm_head.weight"]
        if left:
            raise refuse(
                self.model_type,
                f"weight {sorted(left)[0]!r}"
                + (f" (and {len(left) - 1} more)" if len(left) > 1 else ""),
                "radixkv would drop it",
            )
        return self.out


def standard_layer(w: WeightTaker, config: ModelConfig, i: int, norm_offset: float = 0.0) -> None:
    """Layer ``i`` of a checkpoint with separate ``q/k/v_proj`` and ``gate/up_proj`` (Llama's
    names), its pre-attention and pre-MLP norms as the config's ``norm_layout`` places them,
    and q/k norms where the config has them."""
    attention_weights(w, config, i)
    m, dst = f"layers.{i}.mlp.", f"layers.{i}."
    w.cat(dst + "gate_up_proj.weight", (m + "gate_proj.weight", m + "up_proj.weight"))
    w.put(dst + "down_proj.weight", w.raw(m + "down_proj.weight"))
    if config.mlp_bias:
        w.cat(dst + "gate_up_proj.bias", (m + "gate_proj.bias", m + "up_proj.bias"))
        w.put(dst + "down_proj.bias", w.raw(m + "down_proj.bias"))
    layer_norms(w, config, i, norm_offset)


def attention_weights(w: WeightTaker, config: ModelConfig, i: int) -> None:
    """Layer ``i``'s separate ``q/k/v_proj`` fused into ``qkv_proj``, and ``o_proj`` (biases
    where the config says)."""
    src, dst = f"layers.{i}.", f"layers.{i}."
    a = src + "self_attn."
    w.cat(dst + "qkv_proj.weight", (a + f"{n}_proj.weight" for n in "qkv"))
    if config.attention_bias:
        w.cat(dst + "qkv_proj.bias", (a + f"{n}_proj.bias" for n in "qkv"))
    w.put(dst + "o_proj.weight", w.raw(a + "o_proj.weight"))
    if config.o_bias:
        w.put(dst + "o_proj.bias", w.raw(a + "o_proj.bias"))


def layer_norms(w: WeightTaker, config: ModelConfig, i: int, norm_offset: float = 0.0) -> None:
    p = f"layers.{i}."
    names = {
        "pre": [
            ("input_layernorm", "input_layernorm"),
            ("post_attention_layernorm", "post_attention_layernorm"),
        ],
        "sandwich": [
            ("input_layernorm", "input_layernorm"),
            ("attn_out_norm", "post_attention_layernorm"),
            ("post_attention_layernorm", "pre_feedforward_layernorm"),
            ("mlp_out_norm", "post_feedforward_layernorm"),
        ],
        "post": [
            ("attn_out_norm", "post_attention_layernorm"),
            ("mlp_out_norm", "post_feedforward_layernorm"),
        ],
    }[config.norm_layout]
    for dst, src in names:
        w.norm(p + dst + ".weight", p + src + ".weight", norm_offset)
    if config.qk_norm:
        for n in ("q_norm", "k_norm"):
            w.norm(p + n + ".weight", p + "self_attn." + n + ".weight", norm_offset)


def finish_model(w: WeightTaker, config: ModelConfig, norm_offset: float = 0.0) -> dict[str, Any]:
    """Embeddings, final norm and head; the leftover check."""
    embed = "embed_tokens.weight"
    if not w.has(embed) and config.tie_word_embeddings and w.has("lm_head.weight"):
        embed = "lm_head.weight"  # tied weights saved once (safetensors keeps one name)
    w.put("embed_tokens.weight", w.raw(embed))
    w.norm("norm.weight", "norm.weight", norm_offset)
    if not config.tie_word_embeddings and w.has("lm_head.weight"):
        w.put("lm_head.weight", w.raw("lm_head.weight"))
    return w.finish(tied=config.tie_word_embeddings or "lm_head.weight" not in w.stored)


def permute_rotary(name: str, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Partial rotary: ``t`` (radixkv's ``name``) with every q and k head's dims reordered by
    :func:`partial_rotary_permutation` where it has them (rows of ``qkv_proj``, per-head q/k
    norm weights), else ``t``."""
    d = config.head_dim
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        perm = torch.tensor(partial_rotary_permutation(d, config.rotary_dim or d))
        qk_heads = config.num_heads + config.num_kv_heads
        qk = t[: qk_heads * d].reshape(qk_heads, d, *t.shape[1:])[:, perm]
        return torch.cat([qk.reshape(qk_heads * d, *t.shape[1:]), t[qk_heads * d :]]).contiguous()
    if config.qk_norm == "head" and name.endswith(("q_norm.weight", "k_norm.weight")):
        return t[torch.tensor(partial_rotary_permutation(d, config.rotary_dim or d))].contiguous()
    return t


def map_standard(config: ModelConfig, w: WeightTaker, norm_offset: float = 0.0) -> dict[str, Any]:
    """Every layer by :func:`standard_layer`, then :func:`finish_model`: the weight map of each
    architecture whose checkpoint names Llama's projections separately."""
    for i in range(config.num_layers):
        standard_layer(w, config, i, norm_offset)
    return finish_model(w, config, norm_offset)


def llama_biases(hf: Any) -> dict[str, bool]:
    """Llama's bias switches: ``attention_bias`` on q, k, v and o, ``mlp_bias`` on the MLP."""
    bias = bool(getattr(hf, "attention_bias", False))
    return dict(attention_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf, "mlp_bias", False)))
