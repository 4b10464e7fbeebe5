"""Tiny random-weight models of every architecture radixkv serves, built with transformers' own
config classes, each with its special features switched on (a window shorter than the test
prompts, soft-capping, multipliers, NoPE layers, biases, partial rotary), odd sizes, and weights
scaled so attention is far from uniform. Shared by tests/test_architectures.py and the server
test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: the byte-level test tokenizer's vocabulary (bench/tiny_model.py: 3 specials + 256 bytes)
VOCAB = 259
#: llama3 RoPE scaling, with an original context short enough that the test prompts reach it
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
#: the sliding window of the windowed architectures: shorter than the test prompts (30-51)
WINDOW = 20


def _common(**extra: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=136,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    base.update(extra)
    return base


def llama3() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **_common(
            head_dim=32,
            rope_parameters=dict(LLAMA3_ROPE),
        )
    )


def mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_common(head_dim=128, sliding_window=WINDOW))


def qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_common(hidden_size=576, tie_word_embeddings=True))  # head dim 96


def qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(head_dim=64, attention_bias=True))


def gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_common(
            head_dim=256,
            num_hidden_layers=4,
            sliding_window=WINDOW,
            query_pre_attn_scalar=60,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            final_logit_softcapping=4.0,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    )


def phi3() -> Any:
    from transformers import Phi3Config

    # head dim 80, 60 of them rotating
    return Phi3Config(
        **_common(
            hidden_size=480,
            num_key_value_heads=3,
            sliding_window=WINDOW,
            pad_token_id=0,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
            },
        )
    )


def granite() -> Any:
    from transformers import GraniteConfig

    return GraniteConfig(
        **_common(
            embedding_multiplier=3.0,
            attention_multiplier=0.09,
            residual_multiplier=0.5,
            logits_scaling=2.5,
            attention_bias=True,
            mlp_bias=True,
        )
    )


def smollm3() -> Any:
    from transformers import SmolLM3Config

    return SmolLM3Config(
        **_common(no_rope_layers=[1, 0, 1], tie_word_embeddings=True, pad_token_id=0)
    )


def olmo2() -> Any:
    from transformers import Olmo2Config

    return Olmo2Config(**_common(pad_token_id=0))


def qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    # 6 experts of width 36, top-2 unrenormalised (Mixtral covers renormalised); layer 1 dense
    return Qwen3MoeConfig(
        **_common(
            head_dim=32,
            attention_bias=True,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=36,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
        )
    )


def mixtral() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        **_common(num_local_experts=5, num_experts_per_tok=2, sliding_window=WINDOW)
    )


#: name -> the config of its tiny model
CONFIGS: dict[str, Callable[[], Any]] = {
    "llama3": llama3,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma3": gemma3,
    "phi3": phi3,
    "granite": granite,
    "smollm3": smollm3,
    "olmo2": olmo2,
    "qwen3_moe": qwen3_moe,
    "mixtral": mixtral,
}

#: the mixture-of-experts models, whose routing :func:`route_by_token` makes tie-free
MOE = ("qwen3_moe", "mixtral")
#: the router's gain on the routing code (:func:`route_by_token`)
ROUTER_GAIN = 0.5


def tiny_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """The float32 transformers model of ``name`` (head dims: llama3 32, mistral 128, qwen2 96,
    qwen3 64, gemma3 256, phi3 80, the rest 16): random weights, the 2-D ones scaled x3 (as
    tests/conftest.py's tiny Llama), norms and biases randomised so none is a no-op.
    ``overrides`` are set on the config first."""
    from transformers import AutoModelForCausalLM

    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    if name in MOE:  # the per-expert loop: the grouped-GEMM default has no float64 oracle
        config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in pname:
                p.mul_(3.0)
            elif p.dim() == 1 and "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if name == "gemma3" else 1.0))
            elif p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1)
        if name in MOE:
            route_by_token(model, seed)
    return model


def route_by_token(model: Any, seed: int) -> None:
    """Make a tiny MoE model's routing free of near ties, so no valid float32 or bf16
    computation can pick other experts than the float64 oracle (which would move the logits by
    far more than rounding, on a random model's near-tie: a flaky test).

    The first ``E`` (number of experts) hidden dims carry a routing code: token ``t``'s
    embedding holds a per-token permutation of ``(2, 1, 0, -0.5, ...)`` there, no attention or
    MLP output writes to them (those rows of ``o_proj`` and every ``down_proj`` are zero), and
    the pre-MLP norm weights 1 on them, so they reach every router as ``code * g`` with ``g > 0``
    the RMSNorm's scale. The router is ``ROUTER_GAIN`` on those dims plus a tenth of its random
    weights: each token's top-2 are the code's (gap ``ROUTER_GAIN * g`` between the 2nd and
    3rd), while its weights still vary with the context (``g`` and the random part).
    tests/test_architectures.py checks the oracle's smallest margin against the bf16 error."""
    cfg = model.config
    e = int(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    g = torch.Generator().manual_seed(seed + 1)
    values = torch.tensor([2.0, 1.0] + [-0.5 * j for j in range(e - 2)])
    codes = torch.stack([values[torch.randperm(e, generator=g)] for _ in range(cfg.vocab_size)])
    with torch.no_grad():
        model.model.embed_tokens.weight[:, :e] = codes
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:e] = 0.0
            layer.post_attention_layernorm.weight[:e] = 1.0
            mlp = layer.mlp
            if hasattr(mlp, "gate"):  # a sparse layer: router gate, experts fused [E, H, I]
                mlp.experts.down_proj[:, :e] = 0.0
                mlp.gate.weight.mul_(0.1)
                mlp.gate.weight[:, :e] += ROUTER_GAIN * torch.eye(e)
            else:
                mlp.down_proj.weight[:e] = 0.0
