"""Tests of the Triton kernels (``radixkv.kernels``) against the torch oracles, and of the oracles
against a naive contiguous attention.

Without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` so the kernels run on the CPU
under Triton's interpreter; shapes are kept small for it. With CUDA the same tests run the real
kernels on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from radixkv.kernels import (
    choose_num_kv_splits,
    decode_attention,
    decode_attention_ref,
    extend_attention,
    extend_attention_ref,
    store_kvcache,
    store_kvcache_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


class PagedKV:
    """A paged KV cache holding some requests' contiguous K/V under shuffled page ids."""

    def __init__(
        self,
        lens: list[int],
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        pages_per_req = [math.ceil(n / page_size) for n in lens]
        num_pages = sum(pages_per_req) + 3  # spare pages hold garbage that must never be read
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        # Garbage everywhere (large, so reading a wrong slot shows), then the requests' tokens.
        self.k_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
        self.v_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
        perm = torch.randperm(num_pages, generator=gen)  # non-contiguous, shuffled page ids
        max_pages = max(pages_per_req) + 1  # an extra padding column of zeros
        self.page_table = torch.zeros(len(lens), max_pages, dtype=torch.int32)
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []
        flat_k = self.k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = self.v_cache.view(-1, num_kv_heads, head_dim)
        used = 0
        for b, (n, n_pages) in enumerate(zip(lens, pages_per_req, strict=True)):
            pages = perm[used : used + n_pages]
            used += n_pages
            self.page_table[b, :n_pages] = pages.to(torch.int32)
            pos = torch.arange(n)
            slots = pages[pos // page_size] * page_size + pos % page_size
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            flat_k[slots] = k
            flat_v[slots] = v
            self.ks.append(k)
            self.vs.append(v)
        self.k_cache = self.k_cache.to(DEVICE)
        self.v_cache = self.v_cache.to(DEVICE)
        self.page_table = self.page_table.to(DEVICE)


def _naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Causal attention of the last ``Lq`` positions of a contiguous sequence ``k, v [L, Hkv, D]``.

    ``q [Lq, Hq, D]`` are the queries of positions ``L-Lq .. L-1``. Independent of the oracles:
    torch SDPA with its own GQA handling and a bottom-right aligned causal mask, in ``dtype``.
    """
    lq, length = q.shape[0], k.shape[0]
    allowed = torch.arange(length)[None, :] <= torch.arange(length - lq, length)[:, None]
    out = F.scaled_dot_product_attention(
        q.to(dtype).transpose(0, 1),
        k.to(dtype).transpose(0, 1),
        v.to(dtype).transpose(0, 1),
        attn_mask=allowed,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def _run_decode(
    lens: list[int],
    page_size: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    num_kv_heads: int = 2,
    num_kv_splits: int | None = None,
    seed: int = 0,
) -> None:
    kv = PagedKV(lens, page_size, num_kv_heads, head_dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen) * 1.5).to(dtype)
    q = q.to(DEVICE)
    seq_lens = _i32(lens)
    scale = head_dim**-0.5
    out = _nan_like(q)
    got = decode_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.page_table,
        seq_lens,
        scale,
        out=out,
        num_kv_splits=num_kv_splits,
    )
    assert got is out
    assert not torch.isnan(got).any(), "decode_attention left elements unwritten"
    want = decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.page_table, seq_lens, scale)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def _run_extend(
    reqs: list[tuple[int, int]],
    page_size: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    num_kv_heads: int = 2,
    seed: int = 0,
) -> None:
    """``reqs``: ``(prefix_len, extend_len)`` per request."""
    lens = [p + e for p, e in reqs]
    kv = PagedKV(lens, page_size, num_kv_heads, head_dim, dtype, seed)
    num_tokens = sum(e for _, e in reqs)
    gen = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen) * 1.5).to(dtype)
    q = q.to(DEVICE)
    starts = [sum(e for _, e in reqs[:i]) for i in range(len(reqs))]
    prefix_lens, extend_lens, extend_starts = (
        _i32([p for p, _ in reqs]),
        _i32([e for _, e in reqs]),
        _i32(starts),
    )
    scale = head_dim**-0.5
    out = _nan_like(q)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, prefix_lens, extend_lens, extend_starts)
    got = extend_attention(*args, scale, out=out)
    assert got is out
    assert not torch.isnan(got).any(), "extend_attention left elements unwritten"
    want = extend_attention_ref(*args, scale)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


# ----------------------------------------------------------------------------- store_kvcache


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_writes_only_target_slots(page_size: int, dtype: torch.dtype) -> None:
    num_pages, hkv, d, num_tokens = 8, 3, 64, 37
    gen = torch.Generator().manual_seed(page_size)
    shape = (num_pages, page_size, hkv, d)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    num_tokens = min(num_tokens, num_pages * page_size)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens].to(DEVICE)
    k = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype).to(DEVICE)

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(k, v, ref_k, ref_v, slots)
    store_kvcache(k, v, k_cache, v_cache, slots)

    flat_k = k_cache.view(-1, hkv, d)
    flat_v = v_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[slots], k)
    assert torch.equal(flat_v[slots], v)
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)


def test_store_kvcache_int32_slots_and_empty() -> None:
    k_cache = torch.zeros(4, 16, 2, 128, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 128, device=DEVICE)
    v = torch.randn(3, 2, 128, device=DEVICE)
    slots = torch.tensor([63, 0, 17], dtype=torch.int32, device=DEVICE)
    store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[3, 15], k[0]) and torch.equal(v_cache[1, 1], v[2])
    empty = torch.empty(0, 2, 128, device=DEVICE)
    store_kvcache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))


# ----------------------------------------------------------------------------- oracles


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_oracles_match_naive_attention(page_size: int, group: int) -> None:
    """The oracles, reading through shuffled pages, equal SDPA over the contiguous K/V."""
    hkv, d = 2, 64
    reqs = [(0, 1), (0, 21), (16, 9), (35, 1), (7, 40)]
    kv = PagedKV([p + e for p, e in reqs], page_size, hkv, d, torch.float32, seed=3)
    scale = 0.7 * d**-0.5
    gen = torch.Generator().manual_seed(4)
    # extend: every request's new tokens attend causally to the prefix and to each other
    num_tokens = sum(e for _, e in reqs)
    q = torch.randn(num_tokens, hkv * group, d, generator=gen).to(DEVICE)
    starts = [sum(e for _, e in reqs[:i]) for i in range(len(reqs))]
    got = extend_attention_ref(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.page_table,
        _i32([p for p, _ in reqs]),
        _i32([e for _, e in reqs]),
        _i32(starts),
        scale,
    )
    for b, (_, e) in enumerate(reqs):
        rows = slice(starts[b], starts[b] + e)
        want = _naive_attention(q[rows].cpu(), kv.ks[b], kv.vs[b], scale)
        torch.testing.assert_close(got[rows].cpu(), want, atol=1e-5, rtol=1e-5)
    # decode: the one query is the last position
    qd = torch.randn(len(reqs), hkv * group, d, generator=gen).to(DEVICE)
    seq_lens = _i32([p + e for p, e in reqs])
    got_d = decode_attention_ref(qd, kv.k_cache, kv.v_cache, kv.page_table, seq_lens, scale)
    for b in range(len(reqs)):
        want = _naive_attention(qd[b : b + 1].cpu(), kv.ks[b], kv.vs[b], scale)[0]
        torch.testing.assert_close(got_d[b].cpu(), want, atol=1e-5, rtol=1e-5)


def test_store_kvcache_ref_matches_direct_indexing() -> None:
    k_cache = torch.zeros(5, 4, 1, 16)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    store_kvcache_ref(k, v, k_cache, v_cache, torch.tensor([19, 2, 8]))
    assert torch.equal(k_cache[4, 3], k[0]) and torch.equal(k_cache[0, 2], k[1])
    assert torch.equal(v_cache[2, 0], v[2]) and int((k_cache != 0).any(-1).sum()) == 3


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_fp32(page_size: int, group: int, head_dim: int) -> None:
    # lengths that are and are not page multiples, a one-token context, in one batch
    lens = [1, 2 * page_size, 77, 3 * page_size + 5]
    _run_decode(lens, page_size, group, head_dim, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("page_size", "group", "head_dim"), [(16, 3, 128), (1, 1, 64), (64, 3, 64)]
)
def test_decode_attention_half_dtypes(
    dtype: torch.dtype, page_size: int, group: int, head_dim: int
) -> None:
    _run_decode([3, 50, 129], page_size, group, head_dim, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_split_k_default_heuristic(dtype: torch.dtype) -> None:
    lens = [1000, 33, 700]
    assert choose_num_kv_splits(max(lens), len(lens), 1, DEVICE) > 1, "case must use split-K"
    _run_decode(lens, 16, group=4, head_dim=64, dtype=dtype, num_kv_heads=1)


@pytest.mark.parametrize("num_kv_splits", [2, 7])
def test_decode_attention_forced_splits_with_empty_splits(num_kv_splits: int) -> None:
    # 7 splits of a 5-token sequence leaves some splits with no keys at all
    _run_decode(
        [5, 1, 90], 16, group=3, head_dim=64, dtype=torch.float32, num_kv_splits=num_kv_splits
    )


def test_choose_num_kv_splits() -> None:
    assert choose_num_kv_splits(100, 1, 1, DEVICE) == 1
    assert choose_num_kv_splits(10_000, 1, 1, DEVICE) > 1
    # a batch that already fills the device gets no splits
    assert choose_num_kv_splits(10_000, 4096, 8, DEVICE) == 1
    assert choose_num_kv_splits(10**7, 1, 1, DEVICE) <= 32


# ----------------------------------------------------------------------------- extend


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_attention_fp32(page_size: int, group: int, head_dim: int) -> None:
    # no prefix / page-aligned prefix / unaligned prefix; new-token counts around tile edges
    reqs = [(0, 45), (page_size, 3), (19, 1), (2 * page_size, 33)]
    _run_extend(reqs, page_size, group, head_dim, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("page_size", "head_dim"), [(16, 128), (1, 64), (64, 64)])
def test_extend_attention_half_dtypes(dtype: torch.dtype, page_size: int, head_dim: int) -> None:
    _run_extend([(0, 20), (32, 40), (70, 5)], page_size, group=3, head_dim=head_dim, dtype=dtype)


def test_extend_attention_long_prefix_and_empty_request() -> None:
    """A request with no new tokens is skipped; a long prefix spans many key blocks."""
    _run_extend([(300, 70), (5, 0), (0, 2)], 16, group=2, head_dim=64, dtype=torch.float32)


def test_extend_with_one_new_token_equals_decode() -> None:
    lens = [9, 64, 130]
    kv = PagedKV(lens, 16, 2, 64, torch.float32, seed=5)
    q = torch.randn(len(lens), 6, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    seq_lens = _i32(lens)
    dec = decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table, seq_lens, 0.125)
    ext = extend_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.page_table,
        _i32([n - 1 for n in lens]),
        _i32([1] * len(lens)),
        _i32(list(range(len(lens)))),
        0.125,
    )
    torch.testing.assert_close(dec, ext, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- wrappers


def test_wrappers_reject_bad_inputs() -> None:
    kv = PagedKV([4], 16, 1, 64, torch.float32)
    q = torch.randn(1, 2, 64, device=DEVICE)
    seq_lens = _i32([4])
    with pytest.raises(AssertionError, match="at least 16"):
        bad = torch.zeros(2, 16, 1, 8, device=DEVICE)
        decode_attention(q[..., :8], bad, bad, kv.page_table, seq_lens, 1.0)
    with pytest.raises(AssertionError, match="dtype"):
        decode_attention(q.half(), kv.k_cache, kv.v_cache, kv.page_table, seq_lens, 1.0)
    with pytest.raises(AssertionError, match="multiple of Hkv"):
        cache3 = torch.zeros(2, 16, 3, 64, device=DEVICE)
        decode_attention(q, cache3, cache3, kv.page_table, seq_lens, 1.0)
