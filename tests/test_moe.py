"""radixkv.model.moe's dispatch against the dense definition of a mixture of experts, in
float64: ``sum over each token's top-k experts of weight * expert(token)``, with every expert run
on every token and the unchosen ones masked out. Grouping by expert, the gather, the per-expert
slices and the scatter-add must give the same sums; experts no token chose must not run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from architectures import CONFIGS

from radixkv.model.arch import read_config
from radixkv.model.moe import SparseMoeBlock


def _block(norm_topk_prob: bool, experts: int = 5, top_k: int = 2) -> SparseMoeBlock:
    """A sparse layer of the tiny Qwen3-MoE (hidden 96, experts of width 36), float64."""
    config = dataclasses.replace(
        read_config(CONFIGS["qwen3_moe"]()),
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
    )
    torch.manual_seed(0)
    return SparseMoeBlock(config).double().requires_grad_(False)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _dense(block: SparseMoeBlock, h: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by its routing weight where chosen, else 0."""
    probs = torch.softmax(block.router(h).float(), dim=-1)
    top = probs.topk(block.top_k, dim=-1)
    chosen = top.values / top.values.sum(-1, keepdim=True) if block.norm_topk_prob else top.values
    weights = torch.zeros(probs.shape, dtype=h.dtype).scatter_(1, top.indices, chosen.double())
    outs = torch.stack([e(h, _silu_mul) for e in block.experts], dim=1)  # [T, E, H]
    return (weights.unsqueeze(-1) * outs).sum(1)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 17])
def test_dispatch_equals_the_dense_mixture(norm_topk_prob: bool, tokens: int) -> None:
    block = _block(norm_topk_prob)
    h = torch.randn(tokens, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = block(h, _silu_mul)
    assert got.dtype == torch.float64 and got.shape == h.shape
    # the routing weights are float32 in both (transformers' softmax); the rest is float64
    # summed in another order
    torch.testing.assert_close(got, _dense(block, h), rtol=1e-12, atol=1e-12)


def test_experts_no_token_chose_do_not_run() -> None:
    block = _block(True, experts=6, top_k=1)
    h = torch.randn(3, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    chosen = set(block.route(h)[1].flatten().tolist())
    ran: list[int] = []
    for i, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda _m, args, _o, i=i: ran.append((i, args[0].shape[0])))
    block(h, _silu_mul)
    assert {i for i, _ in ran} == chosen and len(ran) == len(chosen)
    assert sum(n for _, n in ran) == 3  # each token's one row, once


def test_a_top_k_outside_the_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok=6"):
        _block(True, experts=5, top_k=6)
