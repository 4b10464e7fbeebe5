"""What radixkv will run for a model, and how: ``radixkv info MODEL``.

Reads only the model's config where it can (a local directory, a Hugging Face id in the local
cache, a ``.gguf`` file's metadata: :func:`~radixkv.model.gguf_config.gguf_config`); the packaged
SmolLM2 is read through the loader. The architecture module's reading
(:func:`radixkv.model.arch.read_config`) is the one the engine uses, so a model it refuses is
refused here with the same message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixkv.model.arch import read_config
from radixkv.model.model_config import ModelConfig

__all__ = ["describe", "hf_config_of"]


def hf_config_of(name: str) -> Any:
    """The transformers config of ``name`` (local files only, as the loader)."""
    from radixkv.model.loader import is_hf_id, load_model, resolve_hf_id

    path = Path(name).expanduser()
    if path.is_dir() or is_hf_id(name):
        from transformers import AutoConfig

        where = path if path.is_dir() else resolve_hf_id(name)
        return AutoConfig.from_pretrained(str(where), local_files_only=True)
    if path.is_file() and path.suffix == ".gguf":
        from radixkv.model.gguf_config import gguf_config

        return gguf_config(path)
    return load_model(name).config


def _windows(config: ModelConfig) -> str:
    if not config.has_windows:
        return "none (full attention on every layer)"
    windows = config.layer_windows or []
    sliding = [i for i, w in enumerate(windows) if w is not None]
    sizes = sorted({w for w in windows if w is not None})
    return (
        f"{', '.join(map(str, sizes))} tokens on {len(sliding)} of {config.num_layers} "
        "layers (pages kept; the native and Triton kernels read each query's window only)"
    )


def _experts(config: ModelConfig) -> str:
    sparse = sum(config.is_moe(i) for i in range(config.num_layers))
    return (
        f"{config.num_experts} experts of width {config.expert_intermediate_size}, top "
        f"{config.num_experts_per_tok}{' renormalised' if config.norm_topk_prob else ''}, on "
        f"{sparse} of {config.num_layers} layers"
    )


def _features(config: ModelConfig) -> list[str]:
    out = [_experts(config)] if config.num_experts else []
    if config.qk_norm:
        out.append(f"q/k RMSNorm ({'per head' if config.qk_norm == 'head' else 'projection'})")
    if config.norm_layout != "pre":
        out.append(f"{config.norm_layout} norms")
    if config.hidden_act != "silu":
        out.append(config.hidden_act)
    if config.attention_bias or config.o_bias or config.mlp_bias:
        out.append(
            "biases "
            + "/".join(
                n
                for n, on in (
                    ("qkv", config.attention_bias),
                    ("o", config.o_bias),
                    ("mlp", config.mlp_bias),
                )
                if on
            )
        )
    if config.rotary_dim:
        out.append(f"partial rotary {config.rotary_dim}/{config.head_dim}")
    if config.layer_rope and "none" in config.layer_rope:
        out.append(f"NoPE on {config.layer_rope.count('none')} layers")
    if config.layer_rope and "local" in config.layer_rope:
        out.append(f"local RoPE theta {config.local_rope_theta:g}")
    for name, value, neutral in (
        ("embedding x", config.embedding_scale, 1.0),
        ("residual x", config.residual_multiplier, 1.0),
        ("logits /", config.logits_divisor, 1.0),
    ):
        if value != neutral:
            out.append(f"{name}{value:g}")
    if config.attention_scale is not None:
        out.append(f"softmax scale {config.attention_scale:g}")
    if config.final_logit_softcap:
        out.append(f"logit soft-cap {config.final_logit_softcap:g}")
    return out


def describe(name: str) -> dict[str, Any]:
    """The architecture radixkv reads for ``name`` (raises
    :class:`~radixkv.model.arch.UnsupportedModelError` naming what it cannot serve)."""
    config = read_config(hf_config_of(name))
    scaling = config.rope_scaling or {}
    return {
        "model": name,
        "architecture": config.model_type,
        "layers": config.num_layers,
        "heads (q/kv)": f"{config.num_heads}/{config.num_kv_heads}",
        "head dim": config.head_dim,
        "hidden / intermediate": f"{config.hidden_size} / {config.intermediate_size}",
        "vocab": config.vocab_size,
        "rope": f"theta {config.rope_theta:g}"
        + (f", {scaling.get('rope_type', scaling.get('type'))} scaling" if scaling else ""),
        "sliding window": _windows(config),
        "features": _features(config) or ["plain Llama layer"],
    }
