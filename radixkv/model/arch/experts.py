"""What the mixture-of-experts architectures share (Qwen3-MoE, Mixtral): reading the routing
fields, refusing the MoE features of other families radixkv does not compute, and taking each
sparse layer's router and experts into radixkv's layout.

radixkv's layout of a sparse layer ``layers.{i}.``: attention and norms as a dense layer's
(:mod:`.common`), then ``moe.router.weight`` (``[num_experts, hidden]``),
``moe.experts.{e}.gate_up_proj.weight`` (gate rows, then up) and
``moe.experts.{e}.down_proj.weight``.
A checkpoint names the experts either one by one (safetensors files as saved, transformers 4.x:
``{block}.experts.{e}.{gate,up,down}.weight``) or fused into 3-D tensors (transformers 5.x's
modules: ``{block}.experts.gate_up_proj`` ``[E, 2I, H]``, gate rows first, and
``{block}.experts.down_proj`` ``[E, H, I]``); both are read, and the router is
``{block}.gate.weight``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixkv.model.arch.common import (
    WeightTaker,
    attention_weights,
    finish_model,
    layer_norms,
    refuse,
    standard_layer,
)
from radixkv.model.model_config import ModelConfig

__all__ = ["EXPERT_COUNTS", "expert_features", "map_sparse"]

#: the expert-count fields of :data:`~.common.NEVER_SUPPORTED` these modules compute
EXPERT_COUNTS = ("num_experts", "num_local_experts")

#: other families' MoE fields that change the forward, refused where a config sets them:
#: (field, the values radixkv serves)
OTHER_MOE_FIELDS: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("shared_expert_intermediate_size", lambda v: not v),  # Qwen2-MoE's shared expert
    ("n_shared_experts", lambda v: not v),  # DeepSeek's
    ("routed_scaling_factor", lambda v: v in (None, 1, 1.0)),
    ("scoring_func", lambda v: v in (None, "softmax")),
    ("n_group", lambda v: v in (None, 1)),
)


def expert_features(
    hf: Any, model_type: str, sparse: list[bool], intermediate: int, norm_topk_prob: bool
) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of the experts: ``sparse`` says which layers route
    (the rest run the dense ``intermediate_size`` MLP), ``intermediate`` is each expert's
    width. Refuses :data:`OTHER_MOE_FIELDS` and a top-k outside ``1..num_experts``."""
    for name, ok in OTHER_MOE_FIELDS:
        if hasattr(hf, name) and not ok(getattr(hf, name)):
            raise refuse(model_type, f"{name}={getattr(hf, name)!r}")
    experts = int(getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", 0) or 0)
    top_k = int(getattr(hf, "num_experts_per_tok", 0) or 0)
    if experts and not 1 <= top_k <= experts:
        raise refuse(model_type, f"num_experts_per_tok={top_k} with {experts} experts")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=intermediate,
        norm_topk_prob=norm_topk_prob,
        layer_experts=[s and experts > 0 for s in sparse],
    )


def map_sparse(
    config: ModelConfig, w: WeightTaker, blocks: tuple[str, ...], names: tuple[str, str, str]
) -> dict[str, Any]:
    """Every layer: a dense one by :func:`~.common.standard_layer`, a sparse one's attention,
    norms, router and experts from the first of ``blocks`` (the MoE module's name: ``mlp``,
    Mixtral's ``block_sparse_moe``) the checkpoint has; ``names``: a per-expert checkpoint's
    gate, up and down projections."""
    for i in range(config.num_layers):
        if not config.is_moe(i):
            standard_layer(w, config, i)
            continue
        attention_weights(w, config, i)
        block = next((b for b in blocks if w.has(f"layers.{i}.{b}.gate.weight")), blocks[0])
        experts_of_layer(w, config, i, f"layers.{i}.{block}.", names)
        layer_norms(w, config, i)
    return finish_model(w, config)


def experts_of_layer(
    w: WeightTaker, config: ModelConfig, i: int, src: str, names: tuple[str, str, str]
) -> None:
    """Layer ``i``'s router and experts from the checkpoint's module ``src``, per expert or
    fused; a fused tensor of another shape than transformers' is refused by name."""
    dst, n = f"layers.{i}.moe.", config.num_experts
    w.put(dst + "router.weight", w.raw(src + "gate.weight"))
    fused = src + "experts.gate_up_proj"
    if w.has(fused):
        h, inter = config.hidden_size, config.expert_intermediate_size
        fused_down = src + "experts.down_proj"
        gate_up, down = w.raw(fused), w.raw(fused_down)
        for name, t, shape in (
            (fused, gate_up, (n, 2 * inter, h)),
            (fused_down, down, (n, h, inter)),
        ):
            if tuple(t.shape) != shape:
                raise refuse(
                    config.model_type, f"{name!r} of shape {tuple(t.shape)}", f"expected {shape}"
                )
        for e in range(n):
            w.put(f"{dst}experts.{e}.gate_up_proj.weight", gate_up[e])
            w.put(f"{dst}experts.{e}.down_proj.weight", down[e])
        return
    gate, up, down_name = names
    for e in range(n):
        q = f"{src}experts.{e}."
        w.cat(f"{dst}experts.{e}.gate_up_proj.weight", (q + gate + ".weight", q + up + ".weight"))
        w.put(f"{dst}experts.{e}.down_proj.weight", w.raw(q + down_name + ".weight"))
