"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k
experts, and only those experts' gated MLPs run on it.

Routing is transformers': ``probs = softmax(router(h))`` in float32, the top ``k`` of them, their
weights renormalised to sum to 1 where the config says (``norm_topk_prob``; Mixtral always).

Dispatch groups the tokens by expert: the ``T * k`` (token, expert) pairs are sorted by expert id
(a stable sort, so each expert's rows keep token order), the hidden rows gathered once in that
order (``index_select``), each expert's gate/up and down projections run on its own contiguous
slice of rows only, and the weighted outputs scatter-added back to their tokens (``index_add_``).
Experts no token chose cost nothing. The projections are the model's packed linears
(:class:`~radixkv.model.linear.PackedLinear`, which :func:`~radixkv.model.linear.prepack_linears`
swaps in when it packs the layer): each expert is an ordinary ``gate_up_proj`` / ``down_proj``
pair, so radixkv's native GEMM (or oneDNN's, or ``F.linear``) runs it at whatever row count the
step gives it, exactly as it runs a dense layer's.

The weighted sum of a token's ``k`` expert outputs is accumulated in float32 (float64 for a
float64 model) and rounded to the model's dtype once (transformers adds them in the model's dtype), so a bf16 model lands at least
as near the float64 oracle as transformers' bf16 forward does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from radixkv.model.model_config import ModelConfig

__all__ = ["Expert", "SparseMoeBlock"]

#: ``[rows, 2 * I]`` gate|up projections -> ``[rows, I]`` activations (silu(gate) * up, ...)
GatedActivation = Callable[[torch.Tensor], torch.Tensor]


class Expert(nn.Module):
    """One expert: a gated MLP of hidden width ``I`` (``gate_up_proj``: gate rows then up)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, act: GatedActivation) -> torch.Tensor:
        return self.down_proj(act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """The routed experts of one layer: ``router`` (``[num_experts, hidden]``, no bias) and
    ``experts``. Invariant: ``1 <= top_k <= num_experts``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, n = config.hidden_size, config.num_experts
        self.num_experts = n
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        if not 1 <= self.top_k <= n:
            raise ValueError(f"num_experts_per_tok={self.top_k} with num_experts={n}")
        self.router = nn.Linear(h, n, bias=False)
        self.experts = nn.ModuleList(Expert(h, config.expert_intermediate_size) for _ in range(n))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, each ``[T, top_k]``: each token's chosen experts, most probable
        first, and their float32 weights."""
        probs = torch.softmax(self.router(h), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, h: torch.Tensor, act: GatedActivation) -> torch.Tensor:
        """``sum_j weight_j * expert_j(h)`` over each row's chosen experts, in ``h``'s dtype."""
        t, k = h.shape[0], self.top_k
        weights, chosen = self.route(h)
        flat = chosen.reshape(-1)  # pair p = token p // k's choice p % k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        rows = h.index_select(0, tokens)  # grouped by expert
        acc = torch.promote_types(h.dtype, torch.float32)
        out = torch.empty(rows.shape, dtype=acc, device=h.device)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                out[start : start + n] = expert(rows[start : start + n], act)
                start += n
        out.mul_(weights.reshape(-1, 1).index_select(0, order))
        total = torch.zeros(t, h.shape[1], dtype=acc, device=h.device)
        return total.index_add_(0, tokens, out).to(h.dtype)
