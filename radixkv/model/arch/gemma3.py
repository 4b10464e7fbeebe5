"""Gemma 3 (text): sandwich norms (before and after both the attention and the MLP) whose
weights apply as ``1 + w``, RMSNorm on each q and k head, embeddings scaled by ``sqrt(hidden)``
(in the model's dtype), GeGLU (gelu-tanh), softmax scale ``query_pre_attn_scalar ** -0.5``,
sliding-window layers (``layer_types``) with their own RoPE base (``rope_local_base_freq``, or
5.x's ``rope_parameters["sliding_attention"]``), full layers with ``rope_theta`` and its scaling,
and an optional ``final_logit_softcapping``. ``attn_logit_softcapping`` is refused."""

from __future__ import annotations

from functools import partial
from typing import Any

from radixkv.model.arch.common import (
    base_config,
    check_rope,
    layer_windows_from_types,
    llama_biases,
    map_standard,
    rope_parameters,
)
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("gemma3_text",)


def read_config(hf: Any) -> ModelConfig:
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        global_theta, global_scaling = rope_parameters(hf, "full_attention")
        local_theta, local_scaling = rope_parameters(hf, "sliding_attention")
        check_rope("gemma3_text", local_scaling)
        if local_scaling:  # transformers never scales the local RoPE
            local_scaling = None
    else:
        global_theta, global_scaling = rope_parameters(hf)
        local_theta = float(getattr(hf, "rope_local_base_freq", 10000.0))
    check_rope("gemma3_text", global_scaling)
    windows = layer_windows_from_types(hf, "gemma3_text")
    n = int(hf.num_hidden_layers)
    layer_rope = ["local" if windows and windows[i] else "global" for i in range(n)]
    softcap = getattr(hf, "final_logit_softcapping", None)
    return base_config(
        hf,
        "gemma3_text",
        **llama_biases(hf),
        qk_norm="head",
        norm_layout="sandwich",
        embedding_scale=float(hf.hidden_size) ** 0.5,
        attention_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        final_logit_softcap=float(softcap) if softcap else None,
        layer_windows=windows,
        layer_rope=layer_rope,
        local_rope_theta=local_theta,
        rope_theta=global_theta,
        rope_scaling=global_scaling,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )


#: every layer as Llama names it, norms as (1 + w)
map_weights = partial(map_standard, norm_offset=1.0)
