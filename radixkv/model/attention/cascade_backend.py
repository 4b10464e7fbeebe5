"""Shared-prefix (cascade) paged attention for the CPU: read a shared prefix once per batch.

Requests admitted from the radix tree share the *same page ids* for their common prefix (a system
prompt, few-shot block or earlier chat turns). Attention over a sequence splits exactly into
attention over a prefix part and over the rest, merged by their log-sum-exp:

    o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b})

So for each group of requests with common leading pages, the queries of *all* members attend to
the shared pages in one call (the KV is gathered once, not once per request), and each request
attends to its own remainder (its unshared cached tokens plus its new tokens, causal). Both parts
use ATen's fused CPU flash-attention kernel, which also returns the log-sum-exp. GQA is folded
into the query length: the ``G`` query heads of a KV head become ``G`` query rows.

Invariants the metadata relies on: pages shared by ids hold identical KV (the tree owns them and
they are never written while locked), and a shared part lies entirely inside every member's
cached prefix, so all of a member's new tokens see all of it (no mask is needed there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixkv.model.attention.base import (
    AttentionBackend,
    ForwardBatch,
    compute_dtype,
    read_rows,
    stored_kv,
    torch_store_kvcache,
)
from radixkv.model.attention.prefix_groups import shared_prefix_groups
from radixkv.model.attention.torch_backend import blockdiag_decode

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float,
    causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention ``[B, H, Lq, D]`` with its log-sum-exp ``[B, H, Lq]`` (float32).

    Low-precision dtypes use ATen's fused CPU flash kernel (fast, approximate ``exp``); float32
    is the accuracy mode and computes with float32 matmuls and an exact log-sum-exp, as
    transformers' eager fp32 attention does (one GEMM for all of a group's query rows).
    """
    if q.dtype != torch.float32:
        return _flash_cpu(q, k, v, dropout, causal, attn_mask=attn_mask, scale=scale)
    if causal:
        raise ValueError("float32 cascade parts take an explicit mask, not causal=True")
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if attn_mask is not None:
        scores = scores + attn_mask
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.matmul(scores.sub_(lse).exp_(), v)
    return out, lse.squeeze(-1)


# A shared prefix shorter than this is attended per request (the split costs more than it saves).
MIN_SHARED_TOKENS = 64


@dataclass
class _Shared:
    """Groups with shared prefixes of one length, attended in one call (one batch row each)."""

    rows: torch.Tensor  # [groups, m_max] query rows of every member (padded with the last one)
    valid: torch.Tensor  # positions in rows.flatten() that are real rows
    real_rows: torch.Tensor  # the query rows they are
    pages: torch.Tensor  # [groups * s] the shared pages, group after group
    num_tokens: int  # s * page_size


@dataclass
class _Own:
    """Requests attending to their own (unshared) keys in one padded call.

    Query row ``r`` of request ``b`` (absolute position ``prefix_b + r``) sees key ``j`` of its run
    (absolute position ``start_b + j``) iff ``start_b + j <= prefix_b + r``; padded query rows see
    key 0 only (their output is dropped).
    """

    rows: torch.Tensor  # [B, n_max] query rows (padded with each request's last row)
    valid: torch.Tensor  # [sum n] positions in rows.flatten() that are real rows
    real_rows: torch.Tensor  # [sum n] the query rows they are
    pages: torch.Tensor  # [B * max_pages] own pages, padded
    length: int  # max_pages * page_size
    allowed: torch.Tensor  # [B, n_max, length] bool
    mask: torch.Tensor | None = None  # additive, GQA-folded, built on first use


@dataclass
class _Fresh:
    rows: slice  # a prompt with nothing cached: causal over its own new K/V


@dataclass
class CascadeMeta:
    out_slots: torch.Tensor
    num_tokens: int
    groups: list[_Shared]
    own: list[_Own]  # decodes in one call, extends after a cached prefix in another
    fresh: list[_Fresh]


def build_cascade_meta(batch: ForwardBatch, dtype: torch.dtype) -> CascadeMeta:
    """Per-forward metadata: shared groups, the batched decodes and the per-request extends."""
    P = batch.page_size
    table = batch.page_table.tolist()
    prefix, ext = batch.prefix_lens, batch.extend_lens
    starts = batch.extend_starts
    n_req = len(ext)
    pages = [table[i][: -(-(prefix[i] + ext[i]) // P)] for i in range(n_req)]
    # -- groups of requests whose cached prefixes start with the same pages -----------------
    shared = [0] * n_req  # tokens of request i attended through its group
    by_length: dict[int, list[tuple[list[int], list[int]]]] = {}
    for group in shared_prefix_groups(pages, prefix, ext, P, MIN_SHARED_TOKENS):
        rows: list[int] = []
        for i in group.members:
            shared[i] = group.shared
            rows.extend(range(starts[i], starts[i] + ext[i]))
        s = group.shared // P
        by_length.setdefault(s, []).append((rows, pages[group.members[0]][:s]))
    groups = []
    for s, items in by_length.items():
        padded, valid, real = _pad_rows([rows for rows, _ in items])
        flat = [p for _, run in items for p in run]
        groups.append(_Shared(padded, valid, real, torch.tensor(flat, dtype=torch.long), s * P))
    # -- own parts ---------------------------------------------------------------------------
    fresh = [
        _Fresh(slice(starts[i], starts[i] + ext[i]))
        for i in range(n_req)
        if ext[i] and not prefix[i]
    ]
    dec = [i for i in range(n_req) if ext[i] == 1 and prefix[i] > 0]
    extend = [i for i in range(n_req) if ext[i] > 1 and prefix[i] > 0]
    buckets = ([dec] if dec else []) + _buckets(
        extend, [ext[i] for i in extend], [prefix[i] + ext[i] - shared[i] for i in extend]
    )
    own = [_own_part(ids, P, pages, prefix, ext, starts, shared) for ids in buckets]
    slots = batch.out_slots if batch.out_slots.dtype == torch.long else batch.out_slots.long()
    return CascadeMeta(slots, batch.num_tokens, groups, own, fresh)


# Extends are padded to a common (new tokens x keys) shape; a bucket grows while its padded work
# stays within this factor of the real work, so one long chunk does not inflate the others.
MAX_PADDING_WASTE = 1.5


def _buckets(ids: list[int], n: list[int], keys: list[int]) -> list[list[int]]:
    """Split requests into padding-friendly groups (sorted by size)."""
    order = sorted(range(len(ids)), key=lambda j: (n[j], keys[j]))
    out: list[list[int]] = []
    cur: list[int] = []
    real = n_max = k_max = 0
    for j in order:
        r, nm, km = real + n[j] * keys[j], max(n_max, n[j]), max(k_max, keys[j])
        if cur and nm * km * (len(cur) + 1) > MAX_PADDING_WASTE * r:
            out.append([ids[x] for x in cur])
            cur, r, nm, km = [], n[j] * keys[j], n[j], keys[j]
        cur.append(j)
        real, n_max, k_max = r, nm, km
    if cur:
        out.append([ids[x] for x in cur])
    return out


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a fresh prompt: ``q [n, Hq, D]``, ``k, v [n, Hkv, D]``.

    ATen's fused SDPA in every dtype (4-D inputs: 3-D ones miss the fused kernel); in float32 it
    is what transformers' default ``sdpa`` attention and the plain backend run for a fresh prompt.
    """
    hq, hkv = q.shape[1], k.shape[1]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=hq != hkv,
    )
    return o.squeeze(0).transpose(0, 1)


def _pad_rows(row_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad per-item query rows to a ``[items, max]`` tensor (repeating each item's last row);
    also returns which flattened positions are real and the real rows themselves."""
    width = max(len(r) for r in row_lists)
    padded, valid, real = [], [], []
    for b, rows in enumerate(row_lists):
        padded.extend(rows + [rows[-1]] * (width - len(rows)))
        valid.extend(range(b * width, b * width + len(rows)))
        real.extend(rows)
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return as_long(padded).view(len(row_lists), width), as_long(valid), as_long(real)


def _own_part(
    ids: list[int],
    P: int,
    pages: list[list[int]],
    prefix: list[int],
    ext: list[int],
    starts: list[int],
    shared: list[int],
) -> _Own:
    n_max = max(ext[i] for i in ids)
    runs = [pages[i][shared[i] // P :] for i in ids]
    max_pages = max(len(r) for r in runs)
    length = max_pages * P
    flat: list[int] = []
    for run in runs:
        flat.extend(run + [run[-1]] * (max_pages - len(run)))
    rows, valid, real = _pad_rows([list(range(starts[i], starts[i] + ext[i])) for i in ids])
    q_pos = torch.tensor([[prefix[i] + r for r in range(n_max)] for i in ids])  # [B, n_max]
    k_pos = torch.tensor([shared[i] for i in ids]).unsqueeze(1) + torch.arange(length)
    allowed = k_pos.unsqueeze(1) <= q_pos.unsqueeze(2)  # [B, n_max, length]
    pad = torch.arange(n_max).unsqueeze(0) >= torch.tensor([ext[i] for i in ids]).unsqueeze(1)
    allowed[pad] = False
    allowed[..., 0] |= pad
    return _Own(rows, valid, real, torch.tensor(flat, dtype=torch.long), length, allowed)


def _fold_rows(q: torch.Tensor, rows: torch.Tensor, hkv: int) -> torch.Tensor:
    """Query rows ``[B, n]`` of ``q [T, Hq, D]`` as ``[B, Hkv, n * G, D]`` (GQA folded)."""
    b, n = rows.shape
    hq, d = q.shape[1], q.shape[2]
    g = hq // hkv
    x = q.index_select(0, rows.view(-1)).view(b, n, hkv, g, d)
    return x.permute(0, 2, 1, 3, 4).reshape(b, hkv, n * g, d)


def _unfold_rows(
    o: torch.Tensor, lse: torch.Tensor, n: int, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_fold_rows` keeping the ``valid`` rows: ``[R, Hq, D]``, ``[R, Hq]``."""
    b, hkv, ng, d = o.shape
    g = ng // n
    o = o.view(b, hkv, n, g, d).permute(0, 2, 1, 3, 4).reshape(b * n, hkv * g, d)
    lse = lse.view(b, hkv, n, g).permute(0, 2, 1, 3).reshape(b * n, hkv * g)
    return o.index_select(0, valid), lse.index_select(0, valid)


def _decode_blockdiag(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, part: _Own, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode own-parts (one query row per request) through :func:`blockdiag_decode`, which
    beats the fused kernel here: at one row its query tiles are mostly empty."""
    b = part.rows.shape[0]
    width = k_cache.shape[2] * q.shape[2]
    keys = read_rows(k_cache, part.pages, q.dtype).view(b, part.length, width)
    vals = read_rows(v_cache, part.pages, q.dtype).view(b, part.length, width)
    if part.mask is None:
        part.mask = torch.zeros(b, 1, part.length, dtype=q.dtype).masked_fill_(
            ~part.allowed, float("-inf")
        )
    o, lse = blockdiag_decode(
        q.index_select(0, part.rows.view(-1)), keys, vals, part.mask, scale, True
    )
    return o, lse  # type: ignore[return-value]


def _gather(cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[num_pages, P, Hkv, D]`` -> the pages' tokens as ``[Hkv, len * P, D]`` in ``dtype``
    (dequantized from a quantized pool)."""
    run = read_rows(cache, pages, dtype)
    return run.view(-1, cache.shape[2], run.shape[-1]).transpose(0, 1)


def cascade_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: CascadeMeta,
    sm_scale: float,
) -> torch.Tensor:
    """Attention of ``q [T, Hq, D]`` over the paged caches (new K/V already stored)."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    dtype = compute_dtype(k_cache, q.dtype)
    q = q.to(dtype)
    out = torch.empty(t, hq, d, dtype=dtype)
    lse = torch.empty(t, hq, dtype=torch.float32) if meta.groups else None
    for part in meta.own:
        b, n_max = part.rows.shape
        if n_max == 1 and dtype != torch.float32:
            o, l_ = _decode_blockdiag(q, k_cache, v_cache, part, sm_scale)
            out.index_copy_(0, part.real_rows, o)
            if lse is not None:
                lse.index_copy_(0, part.real_rows, l_)
            continue
        if part.mask is None:
            allowed = part.allowed.repeat_interleave(g, dim=1).unsqueeze(1)
            part.mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(
                ~allowed, float("-inf")
            )
        keys = _gather(k_cache, part.pages, dtype).view(hkv, b, part.length, d).transpose(0, 1)
        vals = _gather(v_cache, part.pages, dtype).view(hkv, b, part.length, d).transpose(0, 1)
        qp = _fold_rows(q, part.rows, hkv)
        o, l_ = _flash(qp, keys, vals, 0.0, False, attn_mask=part.mask, scale=sm_scale)
        o, l_ = _unfold_rows(o, l_, n_max, part.valid)
        out.index_copy_(0, part.real_rows, o)
        if lse is not None:
            lse.index_copy_(0, part.real_rows, l_)
    for f in meta.fresh:  # never in a shared group (nothing cached), so no lse is needed
        out[f.rows] = _causal(q[f.rows], k[f.rows].to(dtype), v[f.rows].to(dtype), sm_scale)
    for grp in meta.groups:
        b, m_max = grp.rows.shape
        keys = _gather(k_cache, grp.pages, dtype).view(hkv, b, grp.num_tokens, d).transpose(0, 1)
        vals = _gather(v_cache, grp.pages, dtype).view(hkv, b, grp.num_tokens, d).transpose(0, 1)
        o, l_ = _flash(_fold_rows(q, grp.rows, hkv), keys, vals, 0.0, False, scale=sm_scale)
        o_a, lse_a = _unfold_rows(o, l_, m_max, grp.valid)
        o_b = out.index_select(0, grp.real_rows).float()
        lse_b = lse.index_select(0, grp.real_rows)  # type: ignore[union-attr]
        top = torch.maximum(lse_a, lse_b)
        w_a = (lse_a - top).exp_().unsqueeze(-1)
        w_b = (lse_b - top).exp_().unsqueeze(-1)
        merged = (o_a.float() * w_a + o_b * w_b) / (w_a + w_b)
        out.index_copy_(0, grp.real_rows, merged.to(dtype))
    return out


class CascadeTorchBackend(AttentionBackend):
    """The CPU backend: paged attention in torch with shared-prefix (cascade) grouping."""

    name = "torch"

    def prepare(self, batch: ForwardBatch, dtype: torch.dtype) -> CascadeMeta:
        if batch.page_size <= 0:
            raise ValueError("ForwardBatch.page_size must be set for the torch backend")
        return build_cascade_meta(batch, dtype)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: CascadeMeta,
        sm_scale: float,
    ) -> torch.Tensor:
        torch_store_kvcache(k, v, k_cache, v_cache, meta.out_slots)
        k, v = stored_kv(k, v, k_cache, v_cache, meta.out_slots)
        return cascade_attention(q, k, v, k_cache, v_cache, meta, sm_scale)
