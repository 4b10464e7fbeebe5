"""The Triton kernels' sliding window and head dims that are not powers of two (80, 96), and 256,
against a float64 oracle (under ``TRITON_INTERPRET=1`` without CUDA, see tests/conftest.py):
decodes and extends (fresh prompts, after a cached prefix) under windows shorter than the
context, and the keys before every window never read (NaN there stays out of the output)."""

from __future__ import annotations

import pytest
import torch
from test_kernels import DEVICE, PagedKV, _i32

from radixkv.kernels import (
    decode_attention,
    decode_attention_ref,
    extend_attention,
    extend_attention_ref,
    store_kvcache,
    store_kvcache_ref,
)

# float32 kernels against float64 (the oracle below); bf16 against it with bf16's bound
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def oracle(kv: PagedKV, q, reqs, window):
    """Float64 attention of each request's new tokens (``reqs``: (prefix, new)) over its
    contiguous K/V, the token at position p seeing keys max(0, p - window + 1) .. p (all of
    0 .. p without a window)."""
    out, row = [], 0
    hkv = kv.ks[0].shape[1]
    for (p, n), k, v in zip(reqs, kv.ks, kv.vs):
        g = q.shape[1] // hkv
        kk = k.double().repeat_interleave(g, 1)
        vv = v.double().repeat_interleave(g, 1)
        scores = torch.einsum("thd,khd->htk", q[row : row + n].cpu().double(), kk)
        scores = scores * q.shape[2] ** -0.5
        q_pos = (p + torch.arange(n))[:, None]
        k_pos = torch.arange(p + n)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out.append(torch.einsum("htk,khd->thd", scores.softmax(-1), vv))
        row += n
    return torch.cat(out)


def poison_before(kv: PagedKV, firsts: list[int], page_size: int) -> None:
    """NaN in each request's pages that lie wholly before its first visible key."""
    for b, first in enumerate(firsts):
        for i in range(first // page_size):
            page = int(kv.page_table[b, i])
            kv.k_cache[page] = float("nan")
            kv.v_cache[page] = float("nan")


def make_q(n: int, hq: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hq, d, generator=gen) * 1.5).to(dtype).to(DEVICE)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("window", [0, 1, 24, 70])
def test_decode_window_and_head_dims(head_dim: int, window: int) -> None:
    lens = [1, 40, 77, 150]
    page = 16
    kv = PagedKV(lens, page, 2, head_dim, torch.float32, seed=head_dim)
    q = make_q(len(lens), 6, head_dim, torch.float32, seed=window)
    want = oracle(kv, q, [(n - 1, 1) for n in lens], window)
    if window:
        poison_before(kv, [max(0, n - window) for n in lens], page)
    seq_lens = _i32(lens)
    for splits in (1, 3):
        got = decode_attention(
            q, kv.k_cache, kv.v_cache, kv.page_table, seq_lens, head_dim**-0.5,
            num_kv_splits=splits, window=window,
        )  # fmt: skip
        assert torch.isfinite(got).all(), (splits, window)
        err = (got.cpu().double() - want).abs().max().item()
        assert err < TOL[torch.float32], (splits, window, err)
    ref = decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.page_table, seq_lens, head_dim**-0.5, window
    )
    if not window:  # the torch oracle reads what the kernel does (NaN-free without a window)
        assert (ref.cpu().double() - want).abs().max().item() < TOL[torch.float32]


# fresh prompts, extends after a cached prefix (a chunked prefill's second chunk, a cache hit
# mid-prompt), a decode-sized extend, longer than the windows
EXTENDS = [(0, 45), (40, 3), (19, 1), (70, 33)]


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("window", [0, 1, 24])
def test_extend_window_and_head_dims(head_dim: int, window: int) -> None:
    page = 16
    kv = PagedKV([p + n for p, n in EXTENDS], page, 2, head_dim, torch.float32, seed=head_dim)
    q = make_q(sum(n for _, n in EXTENDS), 4, head_dim, torch.float32, seed=window)
    want = oracle(kv, q, EXTENDS, window)
    if window:
        poison_before(kv, [max(0, p - window + 1) for p, _ in EXTENDS], page)
    starts = [sum(n for _, n in EXTENDS[:i]) for i in range(len(EXTENDS))]
    args = (
        q, kv.k_cache, kv.v_cache, kv.page_table,
        _i32([p for p, _ in EXTENDS]), _i32([n for _, n in EXTENDS]), _i32(starts),
    )  # fmt: skip
    got = extend_attention(*args, head_dim**-0.5, window=window)
    assert torch.isfinite(got).all()
    assert (got.cpu().double() - want).abs().max().item() < TOL[torch.float32]
    if not window:
        ref = extend_attention_ref(*args, head_dim**-0.5)
        assert (ref.cpu().double() - want).abs().max().item() < TOL[torch.float32]


@pytest.mark.parametrize("head_dim", [80, 96])
def test_bf16_window_over_non_power_of_two_head_dims(head_dim: int) -> None:
    kv = PagedKV([p + n for p, n in EXTENDS], 16, 2, head_dim, torch.bfloat16, seed=3)
    q = make_q(sum(n for _, n in EXTENDS), 6, head_dim, torch.bfloat16, seed=4)
    starts = [sum(n for _, n in EXTENDS[:i]) for i in range(len(EXTENDS))]
    args = (
        q, kv.k_cache, kv.v_cache, kv.page_table,
        _i32([p for p, _ in EXTENDS]), _i32([n for _, n in EXTENDS]), _i32(starts),
    )  # fmt: skip
    got = extend_attention(*args, head_dim**-0.5, window=24)
    ref = extend_attention_ref(*args, head_dim**-0.5, 24)
    assert (got.cpu().double() - oracle(kv, q, EXTENDS, 24)).abs().max().item() < TOL[q.dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("head_dim", [80, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_store_kvcache_non_power_of_two_head_dims(head_dim: int, dtype: torch.dtype) -> None:
    """The store writes a row's D values (or D codes and its scale) and nothing past them."""
    d_row = head_dim + (2 if dtype == torch.int8 else 0)
    gen = torch.Generator().manual_seed(head_dim)
    k = torch.randn(5, 2, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(5, 2, head_dim, generator=gen).to(DEVICE)
    slots = torch.tensor([3, 17, 0, 31, 8], device=DEVICE)
    caches = [torch.zeros(2, 16, 2, d_row, dtype=dtype, device=DEVICE) for _ in range(4)]
    store_kvcache(k, v, caches[0], caches[1], slots)
    store_kvcache_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
