"""``ModelConfig``: the architecture numbers and features radixkv's decoder runs.

An architecture module (:mod:`radixkv.model.arch`) reads a transformers config into one of these,
refusing whatever it cannot serve exactly; :class:`radixkv.model.llama.LlamaModel` is built from
it. Every feature here has a default that is plain Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelConfig"]


@dataclass
class ModelConfig:
    """The architecture numbers and features of a decoder-only model.

    Per-layer lists (``layer_windows``, ``layer_rope``) have ``num_layers`` entries when set;
    None means every layer is a plain full-attention, global-RoPE layer.
    """

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
    #: biases on q, k, v (Qwen2; Llama/Granite ``attention_bias``) / on o / on the MLP
    attention_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    eos_token_id: int | list[int] | None = None
    #: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU, Gemma)
    hidden_act: str = "silu"
    model_type: str = "llama"
    #: RMSNorm of q and k before RoPE: ``"head"`` (over each head: Qwen3, Gemma 3) or ``"proj"``
    #: (over the whole projection: OLMo 2); None for none
    qk_norm: str | None = None
    #: where a layer's norms sit: ``"pre"`` (Llama: before attention and before the MLP),
    #: ``"sandwich"`` (Gemma 3: also on the attention's and the MLP's outputs), ``"post"``
    #: (OLMo 2: only on the outputs)
    norm_layout: str = "pre"
    #: the token embeddings are multiplied by this (Gemma 3: sqrt(hidden) in the model's dtype;
    #: Granite: ``embedding_multiplier``)
    embedding_scale: float = 1.0
    #: each sub-layer's output is multiplied by this before the residual add (Granite)
    residual_multiplier: float = 1.0
    #: the attention's softmax scale; None is ``head_dim ** -0.5``
    attention_scale: float | None = None
    #: logits are divided by this (Granite's ``logits_scaling``)
    logits_divisor: float = 1.0
    #: ``tanh(logits / c) * c`` (Gemma's ``final_logit_softcapping``); None for none
    final_logit_softcap: float | None = None
    #: per layer, the sliding window (a token sees itself and the ``w - 1`` before it) or None
    layer_windows: list[int | None] | None = None
    #: per layer, ``"global"`` (``rope_theta``, ``rope_scaling``), ``"local"``
    #: (``local_rope_theta``, no scaling: Gemma 3's sliding layers) or ``"none"`` (NoPE)
    layer_rope: list[str] | None = None
    local_rope_theta: float | None = None
    #: dims of a head that rotate (partial rotary, Phi-3); None is all of them
    rotary_dim: int | None = None
    #: mixture of experts: the routed experts of each sparse layer (0: a dense model), how many
    #: each token is sent to, the width of each expert's MLP, and whether the chosen experts'
    #: softmax weights are renormalised to sum to 1 (Mixtral always; Qwen3-MoE's
    #: ``norm_topk_prob``)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    #: per layer, whether its MLP is the sparse experts (else the dense ``intermediate_size``
    #: MLP: Qwen3-MoE's ``mlp_only_layers``); None with experts means every layer
    layer_experts: list[bool] | None = None
    #: what the architecture module noted about how it reads the checkpoint (``radixkv info``)
    notes: list[str] = field(default_factory=list)

    @property
    def scale(self) -> float:
        """The softmax scale of every layer's attention."""
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    def rope_kind(self, layer: int) -> str:
        """Layer ``layer``'s RoPE: ``"global"``, ``"local"`` or ``"none"``."""
        return self.layer_rope[layer] if self.layer_rope else "global"

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is routed experts (:mod:`radixkv.model.moe`)."""
        if not self.num_experts:
            return False
        return self.layer_experts[layer] if self.layer_experts else True

    @property
    def expert_intermediate_size(self) -> int:
        """The hidden width of each expert's gated MLP."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.layer_windows or ())
