"""The pure-PyTorch paged attention backend (``"torch"``; the CPU's float32 accuracy mode).

Decodes of a step are batched into one padded computation: the pages of every decoding request
are gathered with one ``index_select`` per layer into a reusable workspace, scores are one
``baddbmm`` against a block-diagonal query (all KV heads at once, no transposes of the gathered
cache) and the weighted sum one ``bmm``. Extends (prefill of new tokens after a cached prefix) run
per request through ``F.scaled_dot_product_attention``; a request with no cached prefix attends to
its fresh K/V directly (causal), without reading the cache back. Its arithmetic follows
transformers' fp32 attention step for step.

All index tensors a step needs are built once per forward (``prepare``), not per layer. The
standalone :func:`torch_decode_attention` / :func:`torch_extend_attention` have the kernels'
signatures (see docs/design.md) so the kernel benchmark can compare against them.
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
from radixkv.model.kv_quant import is_quantized

_EYE_CACHE: dict[tuple[int, int, torch.dtype, torch.device, float], torch.Tensor] = {}


def _group_eye(
    hq: int, hkv: int, dtype: torch.dtype, device: torch.device, scale: float
) -> torch.Tensor:
    """``[1, Hq, Hkv, 1]`` with ``scale`` where query head ``h`` reads KV head ``h // G``."""
    key = (hq, hkv, dtype, device, float(scale))
    eye = _EYE_CACHE.get(key)
    if eye is None:
        group = hq // hkv
        eye = torch.zeros(hq, hkv, dtype=torch.float32)
        eye[torch.arange(hq), torch.arange(hq) // group] = scale
        eye = eye.to(device=device, dtype=dtype).view(1, hq, hkv, 1)
        _EYE_CACHE[key] = eye
    return eye


@dataclass
class _DecodeGroup:
    """Decoding requests of a step (one query row each), padded to a common length."""

    rows: slice | torch.Tensor  # their rows in q
    batch: int
    padded_len: int  # max_pages * page_size
    page_idx: torch.Tensor  # [batch * max_pages] int64 flat page ids
    mask: torch.Tensor  # [batch, 1, padded_len] additive (0 / -inf), in the cache dtype


@dataclass
class _Extend:
    """One request that adds ``n`` tokens after ``prefix`` cached ones."""

    req: int
    start: int
    n: int
    prefix: int
    page_idx: torch.Tensor | None  # pages to gather (None when prefix == 0)
    mask: torch.Tensor | None  # [n, prefix + n] bool, None when prefix == 0 (plain causal)


@dataclass
class TorchAttnMeta:
    """Per-forward metadata of the torch backend (built once, used by every layer)."""

    out_slots: torch.Tensor
    num_tokens: int
    decode: _DecodeGroup | None
    extends: list[_Extend]


def _rows_of(indices: list[int], device: torch.device) -> slice | torch.Tensor:
    if indices and indices == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[0] + len(indices))
    return torch.tensor(indices, dtype=torch.long, device=device)


def _build_torch_meta(
    out_slots: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    extend_starts: list[int],
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    decode_as_group: bool = True,
) -> TorchAttnMeta:
    decode_reqs: list[int] = []
    extends: list[_Extend] = []
    pt_long = page_table.long()
    for i, (p, n, s) in enumerate(zip(prefix_lens, extend_lens, extend_starts)):
        if n == 0:
            continue
        if decode_as_group and n == 1 and p > 0:
            decode_reqs.append(i)
            continue
        if p == 0:
            extends.append(_Extend(i, s, n, 0, None, None))
            continue
        total = p + n
        num_pages = -(-total // page_size)
        q_pos = torch.arange(p, total, device=device).unsqueeze(1)
        mask = torch.arange(total, device=device).unsqueeze(0) <= q_pos
        extends.append(_Extend(i, s, n, p, pt_long[i, :num_pages].contiguous(), mask))
    decode = None
    if decode_reqs:
        seq = [prefix_lens[i] + extend_lens[i] for i in decode_reqs]
        max_pages = -(-max(seq) // page_size)
        padded = max_pages * page_size
        idx = torch.tensor(decode_reqs, dtype=torch.long, device=page_table.device)
        page_idx = pt_long.index_select(0, idx)[:, :max_pages].reshape(-1).contiguous()
        seq_t = torch.tensor(seq, device=device).unsqueeze(1)
        valid = torch.arange(padded, device=device).unsqueeze(0) < seq_t
        mask = torch.zeros(len(seq), padded, dtype=dtype, device=device)
        mask.masked_fill_(~valid, float("-inf"))
        rows = _rows_of([extend_starts[i] for i in decode_reqs], device)
        decode = _DecodeGroup(rows, len(seq), padded, page_idx, mask.unsqueeze(1))
    slots = out_slots if out_slots.dtype == torch.long else out_slots.long()
    return TorchAttnMeta(slots, int(out_slots.shape[0]), decode, extends)


class _Workspace:
    """Grow-only scratch buffers (avoids page-faulting fresh allocations every layer)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:numel]


def _decode_group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _DecodeGroup,
    sm_scale: float,
    workspace: _Workspace | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` (one row per request) over the gathered pages."""
    b, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    dtype = compute_dtype(k_cache, q.dtype)
    n_pages = group.page_idx.numel()
    numel = n_pages * page_size * hkv * d
    if is_quantized(k_cache):
        kbuf = read_rows(k_cache, group.page_idx, dtype)
        vbuf = read_rows(v_cache, group.page_idx, dtype)
    elif workspace is not None:
        kbuf = workspace.get("k", numel, dtype, k_cache.device).view(n_pages, page_size, hkv, d)
        vbuf = workspace.get("v", numel, dtype, k_cache.device).view(n_pages, page_size, hkv, d)
        torch.index_select(k_cache, 0, group.page_idx, out=kbuf)
        torch.index_select(v_cache, 0, group.page_idx, out=vbuf)
    else:
        kbuf = k_cache.index_select(0, group.page_idx)
        vbuf = v_cache.index_select(0, group.page_idx)
    keys = kbuf.view(b, group.padded_len, hkv * d)
    values = vbuf.view(b, group.padded_len, hkv * d)
    return blockdiag_decode(q.to(dtype), keys, values, group.mask, sm_scale)[0]


def blockdiag_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sm_scale: float,
    with_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention of ``q [B, Hq, D]`` (one row per request) over gathered cache rows
    ``keys, values [B, L, Hkv*D]`` with an additive ``mask [B, 1, L]``.

    Block-diagonal query: row ``h`` holds ``q[h]`` (pre-scaled) in the columns of KV head
    ``h // G``, so one batched matmul against the ``[L, Hkv*D]`` rows scores every head at once,
    with no transpose copies. The softmax runs in float32; ``with_lse`` also returns the
    log-sum-exp ``[B, Hq]`` (for merging partial attentions), else ``None``.
    """
    b, hq, d = q.shape
    hkv = keys.shape[2] // d
    dtype = keys.dtype
    eye = _group_eye(hq, hkv, dtype, q.device, sm_scale)
    qbd = (q.unsqueeze(2) * eye).view(b, hq, hkv * d)
    scores = torch.baddbmm(mask, qbd, keys.transpose(1, 2))
    lse = None
    if with_lse:
        scores = scores.float()
        lse = torch.logsumexp(scores, dim=-1)
        probs = scores.sub_(lse.unsqueeze(-1)).exp_().to(dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    out = torch.bmm(probs, values).view(b, hq, hkv, d)
    heads = torch.arange(hq, device=q.device)
    return out[:, heads, heads // (hq // hkv)], lse


def _extend_attention_one(
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ext: _Extend,
    sm_scale: float,
) -> torch.Tensor:
    """Attention of one request's new rows ``q [n, Hq, D]``; returns ``[n, Hq, D]``."""
    hkv, d = k_cache.shape[2], q.shape[2]
    hq = q.shape[1]
    if ext.prefix == 0 and k_new is not None and v_new is not None:
        keys, values, mask, causal = k_new, v_new, None, True
    else:
        total = ext.prefix + ext.n
        assert ext.page_idx is not None
        dtype = compute_dtype(k_cache, q.dtype)
        keys = read_rows(k_cache, ext.page_idx, dtype).view(-1, hkv, d)[:total]
        values = read_rows(v_cache, ext.page_idx, dtype).view(-1, hkv, d)[:total]
        mask, causal = ext.mask, False
    dtype = keys.dtype
    qt = q.to(dtype).transpose(0, 1).unsqueeze(0)
    kt = keys.transpose(0, 1).unsqueeze(0)
    vt = values.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=mask, is_causal=causal, scale=sm_scale, enable_gqa=hq != hkv
    )
    return out.squeeze(0).transpose(0, 1)


def _run_torch_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TorchAttnMeta,
    sm_scale: float,
    workspace: _Workspace | None = None,
) -> torch.Tensor:
    """Attention for every row of ``q [T, Hq, D]`` (K/V already stored). Returns ``[T, Hq, D]``."""
    t = q.shape[0]
    dec = meta.decode
    if dec is not None and not meta.extends and dec.batch == t:
        return _decode_group_attention(q, k_cache, v_cache, dec, sm_scale, workspace)
    if dec is None and len(meta.extends) == 1 and meta.extends[0].n == t:
        return _extend_attention_one(q, k, v, k_cache, v_cache, meta.extends[0], sm_scale)
    out = torch.zeros(q.shape, dtype=compute_dtype(k_cache, q.dtype), device=q.device)
    if dec is not None:
        out[dec.rows] = _decode_group_attention(
            q[dec.rows], k_cache, v_cache, dec, sm_scale, workspace
        )
    for ext in meta.extends:
        rows = slice(ext.start, ext.start + ext.n)
        out[rows] = _extend_attention_one(
            q[rows],
            None if k is None else k[rows],
            None if v is None else v[rows],
            k_cache,
            v_cache,
            ext,
            sm_scale,
        )
    return out


def torch_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Paged decode attention, one query row per request: ``q [B, Hq, D] -> o [B, Hq, D]``."""
    lens = [int(x) for x in seq_lens.tolist()]
    b = len(lens)
    prefix = [n - 1 for n in lens]
    ones = [1] * b
    meta = _build_torch_meta(
        torch.zeros(b, dtype=torch.long, device=q.device),
        page_table,
        prefix,
        ones,
        list(range(b)),
        k_cache.shape[1],
        compute_dtype(k_cache, q.dtype),
        q.device,
    )
    # Requests with seq_len 1 have no prefix and land in `extends`: read from the cache anyway.
    for ext in meta.extends:
        ext.page_idx = page_table[ext.req, :1].long()
        ext.mask = torch.ones(1, 1, dtype=torch.bool, device=q.device)
    return _run_torch_attention(q, None, None, k_cache, v_cache, meta, sm_scale).to(q.dtype)


def torch_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Paged extend attention (new tokens' K/V already stored): ``q [T, Hq, D] -> [T, Hq, D]``.

    Causal over each request's new tokens and full over its cached prefix.
    """
    prefix = [int(x) for x in prefix_lens.tolist()]
    ext = [int(x) for x in extend_lens.tolist()]
    starts = [int(x) for x in extend_starts.tolist()]
    page_size = k_cache.shape[1]
    meta = _build_torch_meta(
        torch.zeros(q.shape[0], dtype=torch.long, device=q.device),
        page_table,
        prefix,
        ext,
        starts,
        page_size,
        compute_dtype(k_cache, q.dtype),
        q.device,
        decode_as_group=False,
    )
    # Without fresh K/V at hand every request reads its keys back from the cache.
    pt_long = page_table.long()
    for e in meta.extends:
        if e.page_idx is None:
            num_pages = -(-(e.prefix + e.n) // page_size)
            e.page_idx = pt_long[e.req, :num_pages].contiguous()
            e.mask = torch.ones(e.n, e.n, dtype=torch.bool, device=q.device).tril()
    out = _run_torch_attention(q, None, None, k_cache, v_cache, meta, sm_scale)
    return out.to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    """Pure PyTorch paged attention (CPU default)."""

    name = "torch"

    def __init__(self) -> None:
        self.workspace = _Workspace()

    def prepare(self, batch: ForwardBatch, dtype: torch.dtype) -> TorchAttnMeta:
        page_size = batch.page_size
        if page_size <= 0:
            raise ValueError("ForwardBatch.page_size must be set for the torch backend")
        return _build_torch_meta(
            batch.out_slots,
            batch.page_table,
            batch.prefix_lens,
            batch.extend_lens,
            batch.extend_starts,
            page_size,
            dtype,
            batch.input_ids.device,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchAttnMeta,
        sm_scale: float,
    ) -> torch.Tensor:
        torch_store_kvcache(k, v, k_cache, v_cache, meta.out_slots)
        k, v = stored_kv(k, v, k_cache, v_cache, meta.out_slots)
        return _run_torch_attention(q, k, v, k_cache, v_cache, meta, sm_scale, self.workspace)
