"""The native CPU paged-attention kernel (radixkv/model/csrc/cpu_attention.cpp) against torch oracles."""

from __future__ import annotations

import pytest
import torch
from fake_host import HOST_IDS, HOSTS, clear_caches, use_host
from oracle import BF16, Oracle, check_greedy_tokens, check_rows

from radixkv.model import native
from radixkv.model.attention.cascade_backend import CascadeTorchBackend
from radixkv.model.attention.factory import make_attention_backend
from radixkv.model.attention.native_backend import (
    NativeAttentionBackend,
    NativeCascadeBackend,
    native_attention_supported,
    native_paged_attention,
)
from radixkv.model.attention.torch_backend import TorchAttentionBackend, torch_extend_attention
from radixkv.model.host_cpu import cpu_flags
from radixkv.model.runner import ModelRunner, RequestSlice

# The kernel's fast path is AVX512-BF16 (vdpbf16ps); elsewhere the build has only the portable
# path, which the kernel tests below still check against the oracle, and the model keeps the
# cascade backend.
_FAST_PATH_FLAGS = {"avx512f", "avx512bw", "avx512_bf16"}
MISSING_FAST_PATH = sorted(_FAST_PATH_FLAGS - cpu_flags())
needs_fast_path = pytest.mark.skipif(
    bool(MISSING_FAST_PATH),
    reason=f"this CPU lacks {', '.join(MISSING_FAST_PATH)}: the native bf16 fast path cannot run",
)


@pytest.fixture(scope="module")
def module():
    m = native.load()
    # gcc and the Python headers are part of every supported machine: a build failure here is a
    # defect to see, not a reason to skip.
    assert m is not None, f"native kernels failed to build: {native.build_error()}"
    return m


def make_case(page, hq, hkv, d, reqs, seed=0):
    """Random bf16 pool + shuffled page tables for ``reqs = [(prefix, new), ...]``."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // page) for p, n in reqs]
    num_pages = sum(need) + 3
    k_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.zeros(len(reqs), max(need), dtype=torch.int32)
    off = 0
    for i, k in enumerate(need):
        table[i, :k] = torch.tensor(perm[off : off + k])
        off += k
    q = (2 * torch.randn(sum(n for _, n in reqs), hq, d, generator=g)).to(torch.bfloat16)
    starts, acc = [], 0
    for _, n in reqs:
        starts.append(acc)
        acc += n
    return q, k_cache, v_cache, table, [p for p, _ in reqs], [n for _, n in reqs], starts


# fresh prompts, decodes, extends after a cached prefix; lengths on and off page boundaries
MIXED = [(0, 37), (100, 1), (63, 5), (16, 1), (0, 1), (200, 70), (5, 130), (64, 64)]


def reference(q, k_cache, v_cache, table, prefix, ext, starts, scale):
    return torch_extend_attention(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        table,
        torch.tensor(prefix),
        torch.tensor(ext),
        torch.tensor(starts),
        scale,
    )


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3)])
@pytest.mark.parametrize("d", [64, 128, 80, 96, 256])  # 80: the portable path everywhere
def test_matches_reference(module, page, hq, hkv, d):
    case = make_case(page, hq, hkv, d, MIXED, seed=page + hq + d)
    q, k_cache, v_cache, table, prefix, ext, starts = case
    scale = d**-0.5
    out = native_paged_attention(q, k_cache, v_cache, table, prefix, ext, starts, scale)
    ref = reference(*case, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs()
    # bf16 output rounding is ~4e-3 at |o| ~ 1; P is rounded to bf16 as in flash kernels
    assert err.max().item() < 2.5e-2, err.max().item()
    assert err.mean().item() < 2e-3, err.mean().item()
    assert module.has_fast_path(d) == (d in (64, 96, 128, 256)) or not module.has_fast_path(64)


def test_long_prefill_and_long_decode(module):
    """Many key blocks (online softmax rescaling), a 1,000-token causal prompt and decodes."""
    case = make_case(16, 9, 3, 64, [(0, 1000), (1500, 1), (900, 3)], seed=7)
    out = native_paged_attention(*case, 0.125)
    ref = reference(*case, 0.125)
    assert (out.float() - ref).abs().max().item() < 2.5e-2


def test_peaked_scores_stay_finite(module):
    """Large logits (a query aligned with one key) must not overflow exp."""
    q, k_cache, v_cache, table, prefix, ext, starts = make_case(16, 4, 4, 64, [(40, 2)], seed=1)
    q = (q.float() * 40).to(torch.bfloat16)
    out = native_paged_attention(q, k_cache, v_cache, table, prefix, ext, starts, 0.125)
    ref = reference(q, k_cache, v_cache, table, prefix, ext, starts, 0.125)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() < 3e-2


def test_bad_inputs_raise_clear_errors(module):
    q, k_cache, v_cache, table, prefix, ext, starts = make_case(16, 4, 4, 64, [(10, 2)])
    with pytest.raises(RuntimeError, match="bfloat16"):
        native_paged_attention(q, k_cache.float(), v_cache.float(), table, prefix, ext, starts, 0.1)
    with pytest.raises(RuntimeError, match="page table"):
        native_paged_attention(q, k_cache, v_cache, table, [100], ext, starts, 0.1)
    with pytest.raises(RuntimeError, match="one prefix_len"):
        native_paged_attention(q, k_cache, v_cache, table, prefix + [0], ext, starts, 0.1)


def test_backend_selection(module, monkeypatch):
    """The factory picks by what this host can run (every other host: the fake hosts of
    test_backend_selection_on_each_host): the bf16 kernel where its AVX512-BF16 fast path
    exists; the float32-math kernel with in-kernel shared-prefix groups for float32, for fp16,
    and for bf16 elsewhere; ``RADIXKV_FP32_ATTENTION`` can ask for the torch backends."""
    fast = not MISSING_FAST_PATH
    assert native_attention_supported(torch.bfloat16, 64) == fast
    assert not native_attention_supported(torch.float32, 64)
    expected = NativeAttentionBackend if fast else NativeCascadeBackend
    # exact types: NativeCascadeBackend subclasses NativeAttentionBackend
    assert type(make_attention_backend("torch", "cpu", torch.bfloat16, 64)) is expected
    for dtype in (torch.float32, torch.float16):
        assert isinstance(make_attention_backend("torch", "cpu", dtype, 64), NativeCascadeBackend)
    # a head dim without a bf16 fast path takes the float32-math kernel (any head dim)
    assert isinstance(
        make_attention_backend("torch", "cpu", torch.bfloat16, 80), NativeCascadeBackend
    )
    monkeypatch.setenv("RADIXKV_FP32_ATTENTION", "cascade")
    assert isinstance(
        make_attention_backend("torch", "cpu", torch.float32, 64), CascadeTorchBackend
    )
    monkeypatch.setenv("RADIXKV_FP32_ATTENTION", "plain")
    assert isinstance(
        make_attention_backend("torch", "cpu", torch.float32, 64), TorchAttentionBackend
    )
    monkeypatch.setenv("RADIXKV_FP32_ATTENTION", "fast")
    with pytest.raises(ValueError, match="RADIXKV_FP32_ATTENTION"):
        make_attention_backend("torch", "cpu", torch.float32, 64)


class BuildFor:
    """What the native build for ``isa`` reports, over this host's real build: the bf16 fast
    path (``vdpbf16ps``, head dims 64, 96, 128 and 256) exists only in the ``avx512_bf16``
    build."""

    def __init__(self, real, isa: str) -> None:
        self._real, self._isa = real, isa

    def has_fast_path(self, head_dim: int) -> bool:
        return self._isa == "avx512_bf16" and head_dim in (64, 96, 128, 256)

    def kernel_isa(self) -> str:
        return self._isa

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def test_build_stand_in_agrees_with_this_hosts_build(module):
    """The stand-in below is what this host's real build reports for its own level."""
    isa = native.kernel_isa()
    assert isa == native.host_isa()  # built for the host's level (RADIXKV_ISA unset here)
    for d in (16, 64, 80, 96, 128, 256):
        assert module.has_fast_path(d) == BuildFor(module, isa).has_fast_path(d), d


@pytest.mark.parametrize("host", HOSTS, ids=HOST_IDS)
def test_backend_selection_on_each_host(module, monkeypatch, tmp_path, host):
    """On each fake host (its cpuinfo and machine; the build for its level stood in): bf16
    with a fast head dim takes the bf16 kernel only on an AVX512-BF16 host; every other dtype,
    head dim and host takes the float32-math kernel; no build at all, the torch cascade."""
    monkeypatch.delenv("RADIXKV_FP32_ATTENTION", raising=False)
    try:
        use_host(monkeypatch, tmp_path, host)
        isa = native.host_isa()
        assert isa == host.isa
        monkeypatch.setattr(native, "load", lambda isa_=None: BuildFor(module, isa))
        fast = host.isa == "avx512_bf16"
        for d in (64, 96, 128, 256):
            assert native_attention_supported(torch.bfloat16, d) is fast
            made = make_attention_backend("torch", "cpu", torch.bfloat16, d)
            assert type(made) is (NativeAttentionBackend if fast else NativeCascadeBackend)
        assert not native_attention_supported(torch.bfloat16, 80)
        assert type(make_attention_backend("torch", "cpu", torch.bfloat16, 80)) is (
            NativeCascadeBackend
        )
        for dtype in (torch.float32, torch.float16):
            assert not native_attention_supported(dtype, 64)
            made = make_attention_backend("torch", "cpu", dtype, 64)
            assert type(made) is NativeCascadeBackend
        monkeypatch.setattr(native, "load", lambda isa_=None: None)  # the build failed
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            made = make_attention_backend("torch", "cpu", dtype, 64)
            assert type(made) is CascadeTorchBackend
    finally:
        monkeypatch.undo()
        clear_caches()


def test_disabled_by_env_falls_back(monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("RADIXKV_NATIVE", "0")
    assert native.load() is None
    assert "RADIXKV_NATIVE" in (native.build_error() or "")
    assert isinstance(
        make_attention_backend("torch", "cpu", torch.bfloat16, 64), CascadeTorchBackend
    )


@pytest.fixture(scope="module")
def llama_d64():
    """A small random Llama with head_dim 64 (the kernel's fast path) and GQA 3."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=384,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(99)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(
    "backend",
    [pytest.param("native", marks=needs_fast_path), "cascade"],
)
def test_model_bf16_backends_within_contract(module, llama_d64, backend):
    """Whole-model bf16 logits of a mixed batch (a prompt, then a cache-hit extend after 80
    cached tokens, a decode and a fresh prompt) within the bf16 contract of the float64 oracle
    (tests/oracle.py), greedy tokens the oracle's where decisive; the native bf16 kernel here
    and the torch cascade it falls back to are held to the same bound."""
    runner = ModelRunner(llama_d64, num_pages=32, page_size=16, dtype=torch.bfloat16)
    if backend == "native":
        assert type(runner.backend) is NativeAttentionBackend
    else:
        runner.backend = CascadeTorchBackend()
    oracle = Oracle(llama_d64)
    prompt = list(range(5, 90))
    seqs = [prompt, prompt[:80] + list(range(200, 230)), prompt + [17], list(range(30, 50))]
    steps = [
        [RequestSlice(prompt, 0, [1, 2, 3, 4, 5, 6])],
        [
            RequestSlice(seqs[1][80:], 80, [1, 2, 3, 4, 5, 7, 8]),
            RequestSlice([17], 85, [1, 2, 3, 4, 5, 6]),
            RequestSlice(seqs[3], 0, [9, 10]),
        ],
    ]
    got = torch.cat([runner.forward(runner.build_batch(reqs)) for reqs in steps])
    truth, refs = oracle.last_rows(seqs, BF16.dtype)
    bound = check_rows(got, truth, refs, BF16, f"{backend}-d64", "logits")
    check_greedy_tokens(got.argmax(-1).tolist(), truth, bound, f"{backend}-d64")


# -- fused elementwise ops (radixkv/model/csrc/cpu_fused.cpp) ------------------------------------------


@pytest.fixture(params=native.runnable_isas())
def level_module(request):
    """The native build of every ISA level this host runs (the fused ops are vectorised at the
    build's width: 16 floats with AVX-512, 8 otherwise)."""
    m = native.load(request.param)
    assert m is not None, f"the {request.param} build failed: {native.build_error()}"
    return m


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("h", [576, 45])
def test_fused_rms_norm_and_residual_add(level_module, h):
    x, w = bf16(37, h, seed=1), bf16(h, seed=2)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    torch.testing.assert_close(level_module.rms_norm(x, w, 1e-5).float(), ref, atol=2e-2, rtol=1e-2)
    residual, delta = bf16(37, h, seed=3), bf16(37, h, seed=4)
    expect = residual + delta  # the residual stream is rounded to bf16 as in torch
    res = residual.clone()
    y = level_module.add_rms_norm(res, delta, w, 1e-5)
    assert torch.equal(res, expect)
    ref = expect.float() * torch.rsqrt(expect.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(y.float(), ref * w.float(), atol=2e-2, rtol=1e-2)


def test_fused_residual_add_of_subnormals(level_module):
    """The bf16 residual stream's add rounds as torch does on every build, except float32
    subnormal sums (|x| < 2^-126), which AVX512-BF16 builds store as a zero of the same sign
    (vcvtneps2bf16 flushes them; cpu_fused.cpp's store_bf says so)."""
    tiny = torch.tensor([1e-39, -1e-39, 3e-40, -2e-39] * 8).view(1, 32).to(torch.bfloat16)
    assert bool((tiny != 0).all()), "the inputs must be bf16 subnormals"
    res = tiny.clone()
    level_module.add_rms_norm(
        res, torch.zeros_like(res), torch.ones(32, dtype=torch.bfloat16), 1e-5
    )
    if level_module.kernel_isa() == "avx512_bf16":
        assert bool((res == 0).all()) and torch.equal(torch.signbit(res), torch.signbit(tiny))
    else:
        assert torch.equal(res, tiny)


@pytest.mark.parametrize("n, scale", [(1536, 1.0), (1536, 30.0), (45, 4.0)])
def test_fused_silu_mul(level_module, n, scale):
    """Against float64: gates far into both tails (the sigmoid from exp(-|g|) never overflows)
    and a width that is not a whole number of vectors (the scalar tail)."""
    gu = (bf16(9, 2 * n, seed=5).double() * scale).to(torch.bfloat16)
    g, u = gu[:, :n].double(), gu[:, n:].double()
    ref = g * torch.sigmoid(g) * u
    got = level_module.silu_mul(gu).double()
    # one bf16 rounding of the result (2^-8 relative) and float32 arithmetic before it
    assert ((got - ref).abs() <= ref.abs() * 1.01 * 2**-8 + 1e-30).all()
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        level_module.silu_mul(bf16(2, 8).half())


# float32 rows (the fused layers of float32 models over a native attention backend): float32
# arithmetic throughout, judged against float64 with a bound of a few float32 roundings per
# accumulated term; a weight of another dtype is refused.
F32_EPS = 2.0**-24


@pytest.mark.parametrize("h", [576, 45])
def test_fused_rms_norm_float32(level_module, h):
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(37, h, generator=g), torch.randn(h, generator=g)
    x64, w64 = x.double(), w.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    bound = (x64.abs() * w64.abs() * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)) * (
        (h + 8) * F32_EPS
    )
    assert ((level_module.rms_norm(x, w, 1e-5).double() - ref).abs() <= bound).all()
    residual, delta = torch.randn(37, h, generator=g), torch.randn(37, h, generator=g)
    res = residual.clone()
    y = level_module.add_rms_norm(res, delta, w, 1e-5)
    assert torch.equal(res, residual + delta)  # the float32 residual add, one rounding
    s64 = res.double()
    ref = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    bound = (s64.abs() * w64.abs() * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5)) * (
        (h + 8) * F32_EPS
    )
    assert ((y.double() - ref).abs() <= bound).all()
    with pytest.raises(RuntimeError, match="rows' dtype"):
        level_module.rms_norm(x, w.to(torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="one dtype"):
        level_module.add_rms_norm(res, delta.to(torch.bfloat16), w, 1e-5)


@pytest.mark.parametrize("n, scale", [(1536, 1.0), (1536, 30.0), (45, 4.0)])
def test_fused_silu_mul_float32(level_module, n, scale):
    gu = torch.randn(9, 2 * n, generator=torch.Generator().manual_seed(12)) * scale
    g, u = gu[:, :n].double(), gu[:, n:].double()
    ref = g * torch.sigmoid(g) * u
    got = level_module.silu_mul(gu).double()
    # exp2 by a polynomial (~2e-8 relative), a division and two products in float32; the
    # exponent g log2(e) is rounded to float32 first, which exp amplifies by |g| (its condition);
    # exp(-|g|) below float32's smallest normal (g < -87.3) is flushed to 0, as torch's float32
    # silu flushes from -88.7
    bound = ref.abs() * (1.5 * g.abs() + 16) * F32_EPS + g.abs() * u.abs() * 2.0**-126
    assert ((got - ref).abs() <= bound).all()


def test_fused_rope_float32(level_module):
    pos = torch.tensor([0, 7, 300, 2000, 8191])
    cos, sin = rope_tables(pos, 64)
    g = torch.Generator().manual_seed(13)
    qkv = torch.randn(5, 15 * 64, generator=g)
    out = qkv.clone()
    level_module.rope_(out, cos, sin, 12, 64)
    x = qkv[:, : 12 * 64].double().view(5, 12, 64)
    ref = rope64(x, cos, sin)
    # two products and a sum of float32 operands, each term within a rounding of the float64 one
    bound = (x.abs() + x.abs().roll(32, -1)) * 4 * F32_EPS
    assert ((out[:, : 12 * 64].double().view(5, 12, 64) - ref).abs() <= bound).all()
    assert torch.equal(out[:, 12 * 64 :], qkv[:, 12 * 64 :]), "V columns must be left alone"


def test_fused_rope_in_place_matches_apply_rope(level_module):
    from radixkv.model.llama import ModelConfig, apply_rope
    from radixkv.model.rope import rotary_for

    cfg = ModelConfig(
        vocab_size=8,
        hidden_size=576,
        intermediate_size=8,
        num_layers=1,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
    )
    cos, sin = rotary_for(cfg).lookup(torch.tensor([0, 7, 300, 2000]), torch.float32)
    qkv = bf16(4, 960, seed=6)
    ref = apply_rope(qkv[:, :768].float().view(4, 12, 64), cos, sin)
    out = qkv.clone()
    level_module.rope_(out, cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous(), 12, 64)
    torch.testing.assert_close(out[:, :768].float().view(4, 12, 64), ref, atol=2e-2, rtol=1e-2)
    assert torch.equal(out[:, 768:], qkv[:, 768:]), "V columns must be left alone"


def rope_tables(pos: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sign-folded sin ``[len(pos), d]`` float32 at positions ``pos``, as
    radixkv.model.llama builds them."""
    ang = pos.double()[:, None] * (1.0 / 10000.0 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.cat([ang, ang], dim=-1)
    sin = ang.sin()
    sin[:, : d // 2] = -sin[:, : d // 2]
    return ang.cos().float(), sin.float()


def rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [t, heads, d]`` in float64 with the float32 tables of
    :func:`rope_tables` (the oracle of the native ``rope_``)."""
    x = x.double()
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos.double()[:, None] + swapped * sin.double()[:, None]


@pytest.mark.parametrize("d", [24, 40, 64, 128])
def test_fused_rope_rounds_the_float64_rope_once(level_module, d):
    """``rope_`` on head dims with and without a scalar tail (half = 12, 20 lanes: tails of
    both vector widths; 32, 64: none) against RoPE in float64 of the same bf16 inputs and
    float32 tables: within one bf16 rounding of the result plus float32's of the products."""
    t, heads = 9, 5
    cos, sin = rope_tables(torch.tensor([0, 1, 7, 30, 300, 999, 2000, 4095, 12]), d)
    qkv = bf16(t, (heads + 1) * d, seed=d)
    out = qkv.clone()
    level_module.rope_(out, cos, sin, heads, d)
    x = qkv[:, : heads * d].double().view(t, heads, d)
    swapped = torch.cat([x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    want = rope64(x, cos, sin)
    got = out[:, : heads * d].double().view(t, heads, d)
    bound = 2**-8 * want.abs() + 2**-20 * (x.abs() + swapped.abs())
    assert bool(((got - want).abs() <= bound).all())
    assert torch.equal(out[:, heads * d :], qkv[:, heads * d :])


def test_model_fused_ops_vs_torch_ops(module, llama_d64):
    """bf16 logits with the fused norm/RoPE/SiLU ops agree with the plain torch ops."""
    runner = ModelRunner(llama_d64, num_pages=16, page_size=16, dtype=torch.bfloat16)
    batch = runner.build_batch([RequestSlice(list(range(3, 70)), 0, [4, 2, 9, 1, 5])])
    fused = runner.forward(batch)
    runner.model.use_fused_ops = False
    plain = runner.forward(batch)
    assert (fused - plain).abs().max().item() < 0.05 * plain.abs().max().item()


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_start(module) -> None:
    """torch's build lock file outlives a builder killed mid-build (Ctrl-C on first start, a
    crashed replica); the next process must remove it and load, not wait on it forever."""
    import subprocess
    import sys

    from radixkv.model.loader import cache_dir

    isa = native.host_isa()
    lock = cache_dir() / "torch_extensions" / native._build_name(isa) / "lock"
    lock.write_text("")  # what a killed builder leaves
    code = "from radixkv.model import native; import sys; sys.exit(native.load() is None)"
    done = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not lock.exists()
    assert "removing a build lock left by a killed process" in done.stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_store_kv_matches_index_copy_for_strided_rows(level_module, dtype):
    """The native store writes what index_copy_ writes, from K/V column slices of a fused QKV
    output (tokens at the QKV row's stride), and refuses a slot outside the pool."""
    from radixkv.model.attention.base import torch_store_kvcache

    g = torch.Generator().manual_seed(7)
    t, hq, hkv, d = 13, 4, 2, 8
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    assert not k.is_contiguous()
    caches = [torch.randn(6, 4, hkv, d, generator=g).to(dtype) for _ in range(2)]
    slots = torch.randperm(24, generator=g)[:t]
    expect = [c.clone() for c in caches]
    expect[0].view(-1, hkv, d).index_copy_(0, slots, k)
    expect[1].view(-1, hkv, d).index_copy_(0, slots, v)
    got = [c.clone() for c in caches]
    level_module.store_kv_(k, v, got[0], got[1], slots)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
    routed = [c.clone() for c in caches]  # the path every backend's forward takes
    torch_store_kvcache(k, v, routed[0], routed[1], slots.to(torch.int32))
    assert torch.equal(routed[0], expect[0]) and torch.equal(routed[1], expect[1])
    # a backend passes the build it holds: the store runs on that build, not the default one
    calls = []

    class Held:
        def store_kv_(self, *args):
            calls.append(len(args))
            return level_module.store_kv_(*args)

    held = [c.clone() for c in caches]
    torch_store_kvcache(k, v, held[0], held[1], slots, Held())
    assert torch.equal(held[0], expect[0]) and torch.equal(held[1], expect[1])
    assert calls == ([5] if dtype != torch.float16 else []), "float16 rows take index_copy_"
    with pytest.raises(RuntimeError, match="outside the pool"):
        level_module.store_kv_(k, v, got[0], got[1], torch.full((t,), 24, dtype=torch.long))
