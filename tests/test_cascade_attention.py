"""The CPU cascade backend against the plain paged-attention oracle.

Batches mix fresh prefills, extends after a cached prefix and decodes; several requests share
their leading pages (as requests admitted from the radix tree do), so the shared-prefix path and
the log-sum-exp merge are exercised, and a poisoned output proves every row is written.
"""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels.reference import extend_attention_ref
from radixkv.model.attention.cascade_backend import (
    MIN_SHARED_TOKENS,
    CascadeTorchBackend,
    build_cascade_meta,
)
from radixkv.model.runner import RequestSlice, build_forward_batch


def run_case(page_size: int, hq: int, hkv: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    d, num_pages = 64, 1200
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    free = torch.randperm(num_pages, generator=g).tolist()

    def take(n: int) -> list[int]:
        return [free.pop() for _ in range(n)]

    shared_len = 4 * MIN_SHARED_TOKENS // page_size * page_size or page_size
    shared_pages = take(shared_len // page_size)
    reqs: list[RequestSlice] = []
    # (prefix beyond the shared part, new tokens): decodes, extends, one fresh prefill
    for extra, new in [(0, 1), (5, 1), (37, 1), (0, 9), (21, 17), (3, 1)]:
        prefix = shared_len + extra
        pages = shared_pages + take(-(-(prefix + new) // page_size) - len(shared_pages))
        reqs.append(RequestSlice([1] * new, prefix, pages))
    reqs.append(RequestSlice([1] * 13, 0, take(-(-13 // page_size))))  # fresh prompt
    other = take(-(-(90 + 1) // page_size))  # a decode with its own, unshared prefix
    reqs.append(RequestSlice([1], 90, other))
    batch = build_forward_batch(reqs, page_size)
    t = batch.num_tokens
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)

    backend = CascadeTorchBackend()
    meta = backend.prepare(batch, dtype)
    assert meta.groups, "the shared-prefix path was meant to be used"
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out = backend.forward(q, k, v, k_cache, v_cache, meta, d**-0.5)
    # the oracle reads the same caches after the same store
    from radixkv.kernels.reference import store_kvcache_ref

    store_kvcache_ref(k, v, ref_k, ref_v, batch.out_slots)
    assert torch.equal(ref_k, k_cache) and torch.equal(ref_v, v_cache)
    ref = extend_attention_ref(
        q,
        ref_k,
        ref_v,
        batch.page_table,
        torch.tensor(batch.prefix_lens, dtype=torch.int32),
        torch.tensor(batch.extend_lens, dtype=torch.int32),
        torch.tensor(batch.extend_starts, dtype=torch.int32),
        d**-0.5,
    )
    assert not torch.isnan(out).any()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_matches_reference(page_size, hq, hkv, dtype):
    run_case(page_size, hq, hkv, dtype, seed=page_size + hq)


def test_short_shared_prefix_is_not_grouped():
    reqs = [RequestSlice([1], 8, [3]), RequestSlice([1], 8, [3])]
    meta = build_cascade_meta(build_forward_batch(reqs, 16), torch.float32)
    assert meta.groups == []
