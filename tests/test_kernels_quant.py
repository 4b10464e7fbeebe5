"""The Triton kernels over quantized KV pages (int8 codes, or float8 e4m3 bits in uint8, with a
bfloat16 scale per token and KV head: ``radixkv.model.kv_quant``).

Without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` and the kernels run on the CPU
under Triton's interpreter; shapes are small for it. With CUDA the same tests run on the GPU.

- store: the bytes ``kv_quant.quantize`` gives (scales exactly; codes exactly, but one step off
  allowed where ``quantize`` met a rounding tie, and a test of tie rows that holds the kernel to
  torch's ties to even);
- decode / extend: the output is as close to a float64 attention over ``kv_quant.dequantize`` of
  the same pages as the unquantized kernel's is when run over those dequantized values (the
  bound is that kernel's own error, so no host-specific number is written down).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels import _i32, _naive_attention

from radixkv.kernels import decode_attention, extend_attention, store_kvcache, store_kvcache_ref
from radixkv.kernels.reference import (
    KV_QMAX,
    KV_SCALE_BYTES,
    dequantize_rows_ref,
    quantize_rows_ref,
)
from radixkv.model import kv_quant
from radixkv.model.kv_quant import dequantize, quantize

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STORAGE = {"int8": torch.int8, "fp8": torch.uint8}
# The quantized kernel reads the same values as the unquantized one over dequantized pages (a
# code times a bf16 scale is exact in float32, and both round it once to the query's dtype, to
# nearest even), so its error should be that kernel's; 2x leaves room for a backend whose cast
# rounds otherwise. Ignoring the scale, a wrong code or a wrong row is far outside it.
ERROR_RATIO = 2.0


def _random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Garbage rows (random codes and scale bytes, NaN and inf scales included)."""
    return (
        torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8).view(dtype)
    )


def _rows(n: int, hkv: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """K/V rows with magnitudes spread over rows (scales far apart) and an outlier channel."""
    x = torch.randn(n, hkv, d, generator=gen) * torch.exp(torch.randn(n, hkv, 1, generator=gen))
    x[..., 3] *= 8.0
    return x


class QuantPagedKV:
    """Quantized caches holding some requests' tokens (written by ``kv_quant.quantize``, not by
    the store kernel) under shuffled page ids, garbage everywhere else."""

    def __init__(
        self,
        lens: list[int],
        page_size: int,
        hkv: int,
        d: int,
        storage: torch.dtype,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        pages_per_req = [math.ceil(n / page_size) for n in lens]
        num_pages = sum(pages_per_req) + 3
        shape = (num_pages, page_size, hkv, d + KV_SCALE_BYTES)
        self.k_cache = _random_bytes(shape, storage, gen)
        self.v_cache = _random_bytes(shape, storage, gen)
        perm = torch.randperm(num_pages, generator=gen)
        self.page_table = torch.zeros(len(lens), max(pages_per_req) + 1, dtype=torch.int32)
        self.slots: list[torch.Tensor] = []
        flat_k = self.k_cache.view(-1, hkv, d + KV_SCALE_BYTES)
        flat_v = self.v_cache.view(-1, hkv, d + KV_SCALE_BYTES)
        used = 0
        for b, (n, n_pages) in enumerate(zip(lens, pages_per_req, strict=True)):
            pages = perm[used : used + n_pages]
            used += n_pages
            self.page_table[b, :n_pages] = pages.to(torch.int32)
            pos = torch.arange(n)
            slots = pages[pos // page_size] * page_size + pos % page_size
            flat_k[slots] = quantize(_rows(n, hkv, d, gen).to(dtype), storage)
            flat_v[slots] = quantize(_rows(n, hkv, d, gen).to(dtype), storage)
            self.slots.append(slots)
        self.k_cache = self.k_cache.to(DEVICE)
        self.v_cache = self.v_cache.to(DEVICE)
        self.page_table = self.page_table.to(DEVICE)

    def values(self, b: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``b``'s K, V ``[len, Hkv, D]`` dequantized (``kv_quant.dequantize``)."""
        hkv, row = self.k_cache.shape[2], self.k_cache.shape[3]
        k = self.k_cache.cpu().view(-1, hkv, row)[self.slots[b]]
        v = self.v_cache.cpu().view(-1, hkv, row)[self.slots[b]]
        return dequantize(k, dtype), dequantize(v, dtype)

    def dequantized_caches(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole caches as values of ``dtype`` (garbage rows included): what the unquantized
        kernel reads."""
        return dequantize(self.k_cache.cpu(), dtype).to(DEVICE), dequantize(
            self.v_cache.cpu(), dtype
        ).to(DEVICE)


def _attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of the last ``Lq`` positions of ``k, v [L, Hkv, D]``."""
    return _naive_attention(q, k, v, scale, torch.float64)


def _assert_error_within(got: torch.Tensor, base: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` (quantized kernel) is as close to ``want`` (float64) as ``base`` (the unquantized
    kernel over the dequantized pages) is, within ``ERROR_RATIO``."""
    assert not torch.isnan(got).any()
    err = (got.cpu().double() - want).abs().max().item()
    base_err = (base.cpu().double() - want).abs().max().item()
    assert base_err > 0.0, "the unquantized kernel matched float64 exactly: no bound to judge by"
    assert err <= ERROR_RATIO * base_err, (
        f"quantized kernel's error {err:.3g} > {ERROR_RATIO} x the unquantized kernel's "
        f"{base_err:.3g} (output scale {want.abs().max().item():.3g})"
    )


# ----------------------------------------------------------------------------- format


def test_reference_restates_kv_quant() -> None:
    """The kernels' package cannot import ``radixkv.model``: its statement of the format (the
    oracles' quantize / dequantize) gives ``kv_quant``'s bytes and values."""
    assert KV_SCALE_BYTES == kv_quant.SCALE_BYTES
    assert KV_QMAX == kv_quant._QMAX
    gen = torch.Generator().manual_seed(7)
    x = _rows(40, 3, 32, gen)
    x[0, 0] = 0.0
    for storage in STORAGE.values():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            rows = quantize_rows_ref(x.to(dtype), storage)
            assert torch.equal(rows, quantize(x.to(dtype), storage))
            assert torch.equal(dequantize_rows_ref(rows), dequantize(rows))


# ----------------------------------------------------------------------------- store


def _store_rows(dtype: torch.dtype, n: int, hkv: int, d: int) -> torch.Tensor:
    """Rows for the store: spread magnitudes, an all-zero row, a -0.0 row, tiny values (fp8
    subnormals), one huge outlier beside small values."""
    gen = torch.Generator().manual_seed(11)
    x = _rows(n, hkv, d, gen)
    x[0, 0] = 0.0
    x[1, 0] = -0.0
    x[2, -1] *= 1e-3
    x[3, 0, 5] = 1e3
    return x.to(dtype)


def _ties(x: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where ``quantize`` met a rounding tie: ``x * (1 / scale)`` exactly halfway between two
    codes (int8: a fraction of 1/2; e4m3: the midpoint of two neighbouring values)."""
    d = x.shape[-1]
    sf = want[..., d:].contiguous().view(torch.bfloat16).float()
    inv = torch.where(sf > 0, 1.0 / sf.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    y = (x.float() * inv).abs()
    if want.dtype == torch.int8:
        return y - y.floor() == 0.5
    values = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # by bits
    y = y.clamp(max=448.0)
    below = torch.searchsorted(values[:127], y.contiguous(), right=True) - 1  # values[below] <= y
    above = (below + 1).clamp(max=126)
    return (above != below) & ((y - values[below]) == (values[above] - y))


def _assert_codes_match(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    """``got`` rows are ``want``'s (``quantize(x)``): scales exact, codes exact but where a
    rounding tie may have gone the other way (one step; fp8 by magnitude, same sign)."""
    d = want.shape[-1] - KV_SCALE_BYTES
    assert torch.equal(got[..., d:], want[..., d:]), "scales differ"
    g, w = got[..., :d].to(torch.int32), want[..., :d].to(torch.int32)
    if want.dtype == torch.uint8:
        assert torch.equal(g & 0x80, w & 0x80), "fp8 signs differ"
        g, w = g & 0x7F, w & 0x7F
    diff = (g - w).abs()
    ties = _ties(x, want)
    assert int(diff[~ties].max()) == 0, f"{int((diff[~ties] > 0).sum())} codes differ off ties"
    assert int(diff.max()) <= 1, f"codes differ by up to {int(diff.max())} steps"


@pytest.mark.parametrize("storage", list(STORAGE.values()), ids=list(STORAGE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("page_size", "hkv", "d"), [(16, 3, 64), (1, 1, 128)])
def test_store_quantizes_as_kv_quant(
    storage: torch.dtype, dtype: torch.dtype, page_size: int, hkv: int, d: int
) -> None:
    num_pages, num_tokens = 48 // page_size + 2, 29
    gen = torch.Generator().manual_seed(page_size + d)
    shape = (num_pages, page_size, hkv, d + KV_SCALE_BYTES)
    k_cache = _random_bytes(shape, storage, gen).to(DEVICE)
    v_cache = _random_bytes(shape, storage, gen).to(DEVICE)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens].to(DEVICE)
    k = _store_rows(dtype, num_tokens, hkv, d).to(DEVICE)
    v = (-_store_rows(dtype, num_tokens, hkv, d) * 0.01).to(DEVICE)

    store_kvcache(k, v, k_cache, v_cache, slots)

    row = d + KV_SCALE_BYTES
    flat_k, flat_v = k_cache.view(-1, hkv, row), v_cache.view(-1, hkv, row)
    k, v = k.cpu(), v.cpu()
    _assert_codes_match(flat_k[slots].cpu(), quantize(k, storage), k)
    _assert_codes_match(flat_v[slots].cpu(), quantize(v, storage), v)
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, hkv, row)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, hkv, row)[untouched])
    # the oracle store writes quantize's rows to the same slots
    ref_k, ref_v = before_k.cpu().clone(), before_v.cpu().clone()
    store_kvcache_ref(k, v, ref_k, ref_v, slots.cpu())
    assert torch.equal(ref_k.view(-1, hkv, row)[slots.cpu()], quantize(k, storage))
    assert torch.equal(ref_v.view(-1, hkv, row)[slots.cpu()], quantize(v, storage))
    assert torch.equal(ref_k.view(-1, hkv, row)[untouched.cpu()], flat_k[untouched].cpu())


@pytest.mark.parametrize("storage", list(STORAGE.values()), ids=list(STORAGE))
def test_store_rounds_ties_to_even_as_torch(storage: torch.dtype) -> None:
    """Rows whose scale is exactly 2^-3 and whose other values sit exactly halfway between two
    codes (int8: k + 1/2; e4m3: midpoints of neighbouring values, subnormals included): the
    kernel's codes are ``quantize``'s exactly, ties to even as torch rounds them."""
    d, qmax = 64, KV_QMAX[storage]
    if storage == torch.int8:
        halves = torch.arange(-(d // 2), d // 2 - 1, dtype=torch.float32) + 0.5
    else:
        values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mids = (values[1:] + values[:-1]) / 2
        halves = mids[torch.linspace(0, mids.numel() - 1, d - 1).long()]
        halves[::2] *= -1
    # absmax * (1 + 2^-8) / qmax rounds to the bfloat16 0.125 (a power of two: 1 / scale exact)
    top = torch.tensor([0.125 * qmax / (1.0 + 2.0**-8)])
    x = torch.cat([top, halves * 0.125]).view(1, 1, d)
    want = quantize(x, storage)
    assert want[0, 0, d:].view(torch.bfloat16).item() == 0.125, "test rows must have scale 2^-3"
    k_cache = torch.zeros(1, 4, 1, d + KV_SCALE_BYTES, dtype=storage, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slot = torch.tensor([2], device=DEVICE)
    store_kvcache(x.to(DEVICE), x.to(DEVICE), k_cache, v_cache, slot)
    assert torch.equal(k_cache[0, 2].cpu(), want[0]) and torch.equal(v_cache[0, 2].cpu(), want[0])


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("storage", list(STORAGE.values()), ids=list(STORAGE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("page_size", "group", "head_dim", "splits"),
    [(16, 3, 64, None), (1, 1, 128, None), (16, 2, 64, 3)],
)
def test_decode_over_quantized_pages(
    storage: torch.dtype,
    dtype: torch.dtype,
    page_size: int,
    group: int,
    head_dim: int,
    splits: int | None,
) -> None:
    hkv, lens = 2, [1, 37, 2 * page_size + 70]
    kv = QuantPagedKV(lens, page_size, hkv, head_dim, storage, dtype, seed=page_size + group)
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(len(lens), hkv * group, head_dim, generator=gen) * 1.5).to(dtype).to(DEVICE)
    seq_lens, scale = _i32(lens), head_dim**-0.5
    got = decode_attention(
        q, kv.k_cache, kv.v_cache, kv.page_table, seq_lens, scale, num_kv_splits=splits
    )
    assert got.dtype == dtype
    k_deq, v_deq = kv.dequantized_caches(dtype)
    base = decode_attention(q, k_deq, v_deq, kv.page_table, seq_lens, scale, num_kv_splits=splits)
    want = torch.stack(
        [
            _attention64(q[b : b + 1].cpu(), *kv.values(b, torch.float64), scale)[0]
            for b in range(len(lens))
        ]
    )
    _assert_error_within(got, base, want)


# ----------------------------------------------------------------------------- extend


@pytest.mark.parametrize("storage", list(STORAGE.values()), ids=list(STORAGE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("page_size", "group", "head_dim"), [(16, 3, 64), (1, 1, 128)])
def test_extend_over_quantized_pages(
    storage: torch.dtype, dtype: torch.dtype, page_size: int, group: int, head_dim: int
) -> None:
    hkv = 2
    reqs = [(0, 21), (page_size, 3), (19, 1), (40, 35)]  # (prefix, new tokens)
    lens = [p + e for p, e in reqs]
    kv = QuantPagedKV(lens, page_size, hkv, head_dim, storage, dtype, seed=page_size + group)
    num_tokens = sum(e for _, e in reqs)
    gen = torch.Generator().manual_seed(4)
    q = (torch.randn(num_tokens, hkv * group, head_dim, generator=gen) * 1.5).to(dtype)
    q = q.to(DEVICE)
    starts = [sum(e for _, e in reqs[:i]) for i in range(len(reqs))]
    index = (_i32([p for p, _ in reqs]), _i32([e for _, e in reqs]), _i32(starts))
    scale = head_dim**-0.5
    got = extend_attention(q, kv.k_cache, kv.v_cache, kv.page_table, *index, scale)
    assert got.dtype == dtype
    k_deq, v_deq = kv.dequantized_caches(dtype)
    base = extend_attention(q, k_deq, v_deq, kv.page_table, *index, scale)
    want = torch.cat(
        [
            _attention64(q[s : s + e].cpu(), *kv.values(b, torch.float64), scale)
            for b, ((_, e), s) in enumerate(zip(reqs, starts, strict=True))
        ]
    )
    _assert_error_within(got, base, want)


def test_store_then_decode_and_extend_read_what_was_stored() -> None:
    """The store kernel's pages, read back by decode and by extend (a prefix then new tokens),
    give the attention over ``dequantize`` of those pages."""
    hkv, d, page_size, storage = 2, 64, 16, torch.uint8
    gen = torch.Generator().manual_seed(9)
    k_cache = torch.zeros(5, page_size, hkv, d + KV_SCALE_BYTES, dtype=storage, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    pages = torch.tensor([3, 0, 4], dtype=torch.int32)
    n = 40
    pos = torch.arange(n)
    slots = (pages.long()[pos // page_size] * page_size + pos % page_size).to(DEVICE)
    k, v = _rows(n, hkv, d, gen).to(DEVICE), _rows(n, hkv, d, gen).to(DEVICE)
    store_kvcache(k, v, k_cache, v_cache, slots)
    page_table = pages.view(1, -1).to(DEVICE)
    k_deq = dequantize(quantize(k.cpu(), storage), torch.float64)
    v_deq = dequantize(quantize(v.cpu(), storage), torch.float64)
    q = torch.randn(n, 2 * hkv, d, generator=gen).to(DEVICE)
    scale = d**-0.5
    dec = decode_attention(q[-1:], k_cache, v_cache, page_table, _i32([n]), scale)
    ext = extend_attention(
        q[10:], k_cache, v_cache, page_table, _i32([10]), _i32([30]), _i32([0]), scale
    )
    want = _attention64(q[10:].cpu(), k_deq, v_deq, scale)
    torch.testing.assert_close(ext.cpu().double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dec.cpu().double(), want[-1:], atol=1e-5, rtol=1e-5)


def test_wrappers_check_quantized_caches() -> None:
    q = torch.randn(1, 2, 64, device=DEVICE)
    page_table, seq_lens = _i32([[0]]), _i32([4])
    cache = torch.zeros(1, 16, 1, 66, dtype=torch.int8, device=DEVICE)
    with pytest.raises(AssertionError, match="cache head_dim 62"):  # a D + 2 = 64 row: D = 62
        bad = torch.zeros(1, 16, 1, 64, dtype=torch.int8, device=DEVICE)
        decode_attention(q, bad, bad, page_table, seq_lens, 1.0)
    with pytest.raises(AssertionError, match="q dtype"):
        decode_attention(q.double(), cache, cache, page_table, seq_lens, 1.0)
    with pytest.raises(AssertionError, match="dtypes differ"):
        decode_attention(q, cache, cache.view(torch.uint8), page_table, seq_lens, 1.0)
    with pytest.raises(AssertionError, match="float"):
        k = torch.zeros(1, 1, 64, dtype=torch.int8, device=DEVICE)
        store_kvcache(k, k, cache, cache, torch.zeros(1, dtype=torch.long, device=DEVICE))


# ----------------------------------------------------------------------------- backend


@pytest.mark.parametrize("storage", list(STORAGE.values()), ids=list(STORAGE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_torch_backend_over_quantized_pages(
    storage: torch.dtype, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The factory's backends over a quantized pool, Triton and the torch cascade (the native
    kernels off: they have their own tests), given the same step (requests with a cached prefix:
    every key is read back from the pages in both): the same bytes stored, the same attention
    within the compute dtype's noise."""
    monkeypatch.setenv("RADIXKV_NATIVE", "0")
    from radixkv.model.attention.factory import make_attention_backend
    from radixkv.model.attention.triton_backend import TritonAttentionBackend
    from radixkv.model.runner import RequestSlice, build_forward_batch

    page_size, hkv, group, d = 16, 2, 2, 64
    reqs = [RequestSlice([1] * 5, 20, [4, 1]), RequestSlice([1], 37, [0, 5, 3])]
    batch = build_forward_batch(reqs, page_size, DEVICE)
    batch.page_size = page_size
    gen = torch.Generator().manual_seed(21)
    # zeros, as the pool starts (the torch paths read whole pages, masked tails included)
    caches = [torch.zeros(7, page_size, hkv, d + KV_SCALE_BYTES, dtype=storage) for _ in "kv"]
    for cache in caches:  # the prefixes, as quantize writes them
        flat = cache.view(-1, hkv, d + KV_SCALE_BYTES)
        for r in reqs:
            pos = torch.arange(r.prefix_len)
            pages = torch.tensor(r.pages)
            flat[pages[pos // page_size] * page_size + pos % page_size] = quantize(
                _rows(r.prefix_len, hkv, d, gen).to(dtype), storage
            )
    t = batch.num_tokens
    q = torch.randn(t, hkv * group, d, generator=gen).to(dtype).to(DEVICE)
    k, v = _rows(t, hkv, d, gen).to(dtype).to(DEVICE), _rows(t, hkv, d, gen).to(dtype).to(DEVICE)
    outs, stored = {}, {}
    for name in ("triton", "torch"):
        backend = make_attention_backend(name, DEVICE, dtype, d, kv_dtype=storage)
        assert isinstance(backend, TritonAttentionBackend) == (name == "triton")
        k_cache, v_cache = (c.clone().to(DEVICE) for c in caches)
        meta = backend.prepare(batch, dtype)
        outs[name] = backend.forward(q, k, v, k_cache, v_cache, meta, d**-0.5)
        stored[name] = (k_cache.cpu(), v_cache.cpu())
    for a, b in zip(stored["triton"], stored["torch"], strict=True):
        assert torch.equal(a, b)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(outs["triton"].cpu().float(), outs["torch"].cpu().float(), **tol)


def test_row_alignment_is_what_every_quantized_row_address_shares() -> None:
    """The alignment promised to Triton (``KV_ALIGN``) divides every row's byte address: the
    pool's ``D + 2``-byte rows give 2; rows padded to 132 / 136 / 144 bytes give 4 / 8 / 16; an
    unquantized cache gets no promise (Triton's own analysis stands)."""
    from radixkv.kernels.store_kv import kv_read_config, row_alignment

    for width, expected in ((66, 2), (130, 2), (132, 4), (136, 8), (144, 16)):
        buf = torch.zeros(3, 16, 3, width, dtype=torch.int8)
        cache = buf[..., :130] if width >= 130 else buf
        assert row_alignment(cache) == expected
        idx = torch.cartesian_prod(torch.arange(3), torch.arange(16), torch.arange(3))
        every_row = cache.data_ptr() + idx @ torch.tensor(cache.stride()[:3])
        assert bool((every_row % expected == 0).all())
        assert kv_read_config(cache, torch.bfloat16, cache)["KV_ALIGN"] == expected
    odd = torch.zeros(2 * 16 * 2 * 66 + 2, dtype=torch.int8)[2:].view(2, 16, 2, 66)
    assert row_alignment(odd) == 2  # a base 2 bytes off a 16-byte boundary
    bf16 = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    assert kv_read_config(bf16, torch.bfloat16)["KV_ALIGN"] == 1
