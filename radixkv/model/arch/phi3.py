"""Phi-3 / Phi-4-mini: fused ``qkv_proj`` and ``gate_up_proj`` in the checkpoint (radixkv's own
layout), partial rotary where ``partial_rotary_factor`` < 1 (Phi-4-mini: 0.75), a sliding window
where ``sliding_window`` is set."""

from __future__ import annotations

from typing import Any

from radixkv.model.arch.common import (
    WeightTaker,
    base_config,
    finish_model,
    layer_norms,
    layer_windows_from_types,
)
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("phi3",)


def read_config(hf: Any) -> ModelConfig:
    params = getattr(hf, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    num_heads = int(hf.num_attention_heads)
    head_dim = int(getattr(hf, "head_dim", None) or int(hf.hidden_size) // num_heads)
    rotary = int(head_dim * float(factor or 1.0))
    window = getattr(hf, "sliding_window", None)
    return base_config(
        hf,
        "phi3",
        rotary_dim=rotary if rotary != head_dim else None,
        layer_windows=[int(window)] * int(hf.num_hidden_layers)
        if window
        else layer_windows_from_types(hf, "phi3"),
    )


def map_weights(config: ModelConfig, w: WeightTaker) -> dict[str, Any]:
    for i in range(config.num_layers):
        p = f"layers.{i}."
        w.put(p + "qkv_proj.weight", w.raw(p + "self_attn.qkv_proj.weight"))
        w.put(p + "o_proj.weight", w.raw(p + "self_attn.o_proj.weight"))
        w.put(p + "gate_up_proj.weight", w.raw(p + "mlp.gate_up_proj.weight"))
        w.put(p + "down_proj.weight", w.raw(p + "mlp.down_proj.weight"))
        layer_norms(w, config, i)
    return finish_model(w, config)
