"""The native kernels over quantized KV pages (int8 / fp8 e4m3 codes with a bfloat16 scale per
token and KV head, radixkv/model/kv_quant.py), dequantized in registers.

Each kernel runs at every ISA level this host can run (levels it lacks are not collected): the
float32-math kernel (cpu_attention_f32.cpp) and the bf16 kernel (cpu_attention.cpp: its
AVX512-BF16 path on an avx512_bf16 build with head dim 64 / 128, its portable path otherwise).
Their output over quantized pages is judged against a float64 attention over
``kv_quant.dequantize`` of the same pages, with a bound relative to the same kernel's own error
over unquantized pages (float32 / bfloat16) against their own float64 oracle; the decode of every
code is checked exactly; and a tiny model's greedy tokens over an int8 pool equal the torch
cascade backend's over the same format.
"""

from __future__ import annotations

import pytest
import torch
from native_pages import Case, oracle
from test_native import rope64, rope_tables

from bench.tiny_model import tiny_loaded_model
from radixkv import Engine, SamplingParams
from radixkv.model import native
from radixkv.model.attention.cascade_backend import CascadeTorchBackend
from radixkv.model.attention.native_backend import (
    NativeAttentionBackend,
    NativeCascadeBackend,
    native_paged_attention,
    native_paged_attention_f32,
)
from radixkv.model.kv_quant import dequantize, quantize

ISAS = native.runnable_isas()
KINDS = {"int8": torch.int8, "fp8": torch.uint8}

# fresh prompts, decodes, extends after a cached prefix; lengths on and off page boundaries
MIXED = [(0, 37), (100, 1), (63, 5), (16, 1), (0, 1), (200, 70), (5, 130), (64, 64)]


@pytest.fixture(params=ISAS)
def module(request):
    m = native.load(request.param)
    # every level the host runs is built here: a build failure is a defect to see
    assert m is not None, f"the {request.param} build failed: {native.build_error()}"
    assert m.kernel_isa() == request.param
    return m


def quantized(case: Case, storage: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``case``'s pages quantized, and those pages dequantized (float32)."""
    kq, vq = quantize(case.k_cache, storage), quantize(case.v_cache, storage)
    return kq, vq, dequantize(kq), dequantize(vq)


def run_f32(module, case, k, v, groups=None):
    args = (case.q, k, v, case.table, case.prefix, case.ext, case.starts, case.scale)
    return native_paged_attention_f32(
        *args, case.groups if groups is None else groups, module=module
    )


def run_bf16(module, case, k, v, groups=None):
    args = (case.q, k, v, case.table, case.prefix, case.ext, case.starts, case.scale)
    return native_paged_attention(*args, module, case.groups if groups is None else groups)


def err(out, case, k, v):
    """Max and mean |out - float64 attention over the pages k, v|."""
    ref = oracle(case.q, k, v, case.table, case.prefix, case.ext, case.starts, case.scale)
    e = (out.double() - ref).abs()
    return e.max().item(), e.mean().item()


def cases():
    shared = 130  # mid-page for 16, not a multiple of the kernels' 64-key block
    burst = [(shared + 7 * b % 23, 1 + (b % 3) * 4) for b in range(20)]
    return {
        "mixed": dict(reqs=MIXED, groups=()),
        "groups": dict(reqs=burst, groups=[(range(20), shared)]),
        "two-groups": dict(
            reqs=[(96, 1), (96, 4), (50, 1), (200, 1), (210, 12), (0, 9), (33, 2)],
            groups=[([0, 1], 96), ([3, 4, 6], 33)],
        ),
    }


@pytest.mark.parametrize("shape", list(cases()))
@pytest.mark.parametrize("d", [64, 128, 80])  # 80: the f32 kernel's generic path
@pytest.mark.parametrize("kind", list(KINDS))
def test_f32_kernel_over_quantized_pages(module, kind, d, shape):
    spec = cases()[shape]
    case = Case(16, 9, 3, d, spec["reqs"], groups=spec["groups"], seed=d + len(shape))
    kq, vq, kd, vd = quantized(case, KINDS[kind])
    assert kq.shape[-1] == d + 2
    out = run_f32(module, case, kq, vq)
    assert out.dtype == torch.float32 and out.shape == case.q.shape
    q_max, q_mean = err(out, case, kd, vd)
    # the kernel's own error over float32 pages (the dequantized values) against its oracle
    ref = run_f32(module, case, kd, vd)
    r_max, r_mean = err(ref, case, kd, vd)
    assert q_max <= 2 * r_max + 1e-6 and q_mean <= 2 * r_mean + 1e-7, (q_max, r_max)
    assert q_max < 2e-5, q_max
    if case.groups:  # the shared-prefix groups change nothing but the order of the work
        plain = run_f32(module, case, kq, vq, groups=[])
        assert (plain - out).abs().max().item() <= 2 * r_max + 1e-6


@pytest.mark.parametrize("shape", list(cases()))
@pytest.mark.parametrize("d", [64, 128, 80])  # 80: the bf16 kernel's portable path
@pytest.mark.parametrize("kind", list(KINDS))
def test_bf16_kernel_over_quantized_pages(module, kind, d, shape):
    spec = cases()[shape]
    case = Case(16, 9, 3, d, spec["reqs"], groups=spec["groups"], seed=d + len(shape))
    case.q = case.q.to(torch.bfloat16)
    kq, vq, kd, vd = quantized(case, KINDS[kind])
    out = run_bf16(module, case, kq, vq)
    assert out.dtype == torch.bfloat16 and out.shape == case.q.shape
    q_max, q_mean = err(out, case, kd, vd)
    # the kernel's own error over bf16 pages against its oracle (over the same bf16 values)
    kb, vb = kd.to(torch.bfloat16), vd.to(torch.bfloat16)
    r_max, r_mean = err(run_bf16(module, case, kb, vb), case, kb, vb)
    assert q_max <= 1.5 * r_max + 1e-3 and q_mean <= 1.5 * r_mean + 1e-4, (q_max, r_max)
    assert q_max < 2.5e-2 and q_mean < 2e-3, (q_max, q_mean)
    if case.groups:
        plain = run_bf16(module, case, kq, vq, groups=[])
        assert (plain.float() - out.float()).abs().max().item() <= 2 * r_max + 1e-3


def every_code_row(kind: str, d: int) -> torch.Tensor:
    """Rows [n, d + 2] of ``kind`` holding every code (fp8: every non-NaN pattern; the quantizer
    never writes NaN), each row with its own scale, subnormal e4m3 codes included."""
    codes = torch.arange(256, dtype=torch.int32)
    if kind == "fp8":
        codes = codes[(codes & 0x7F) != 0x7F]
    n = -(-len(codes) // d)
    flat = torch.zeros(n * d, dtype=torch.int32)
    flat[: len(codes)] = codes
    rows = torch.empty(n, d + 2, dtype=KINDS[kind])
    rows[:, :d] = flat.view(n, d).to(torch.uint8).view(KINDS[kind])
    scales = torch.tensor([0.375 * 2.0**-k for k in range(n)], dtype=torch.bfloat16)
    rows[:, d:] = scales.view(n, 1).view(KINDS[kind])
    return rows


@pytest.mark.parametrize("d", [64, 128, 28])  # 28: vector bodies and a scalar tail
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_code_decodes_exactly(module, kind, d):
    """One key: the output is its V row, exactly dequantize(row) (float32: code * scale is exact;
    bf16 kernel: that value rounded to bf16, as dequantize(rows, bfloat16) rounds it)."""
    rows = every_code_row(kind, d)
    hkv = rows.shape[0]
    v = rows.view(1, 1, hkv, d + 2)
    k = torch.zeros_like(v)
    q = torch.randn(1, hkv, d)
    table = torch.zeros(1, 1, dtype=torch.int32)
    args = (table, [0], [1], [0], d**-0.5)
    out = native_paged_attention_f32(q, k, v, *args, module=module)
    assert torch.equal(out[0], dequantize(rows)), (out[0] - dequantize(rows)).abs().max()
    out = native_paged_attention(q.to(torch.bfloat16), k, v, *args, module)
    assert torch.equal(out[0], dequantize(rows, torch.bfloat16))


def test_bad_quantized_caches_raise_clear_errors(module):
    case = Case(16, 4, 2, 64, [(40, 1)], seed=2)
    kq, vq, _, _ = quantized(case, torch.int8)
    args = (case.table, case.prefix, case.ext, case.starts, 0.1)
    with pytest.raises(RuntimeError, match="head shapes disagree"):
        native_paged_attention_f32(
            case.q, kq[..., :-2].contiguous(), vq[..., :-2].contiguous(), *args, module=module
        )
    with pytest.raises(RuntimeError, match="head shapes disagree"):
        native_paged_attention(
            case.q, kq[..., :-2].contiguous(), vq[..., :-2].contiguous(), *args, module
        )
    with pytest.raises(RuntimeError, match="dtypes differ"):
        native_paged_attention_f32(case.q, kq, vq.view(torch.uint8), *args, module=module)
    with pytest.raises(RuntimeError, match="both of one dtype"):
        native_paged_attention(case.q, kq, vq.view(torch.uint8), *args, module)


# -- the engine ------------------------------------------------------------------------------------

SYSTEM = "You are a helpful assistant. Answer briefly and precisely, in English. " * 2


def greedy(engine) -> list:
    """A prompt, then four that share its 140-byte prefix (cached pages: the decodes run with a
    shared-prefix group); greedy, with each step's top-2 logprobs."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = engine.generate([SYSTEM + "Hi."], params)
    outs += engine.generate(
        [SYSTEM + q for q in ("Why?", "How so", "2+2=", "Name a fruit")], params
    )
    return [o.outputs[0] for o in outs]


def assert_same_greedy(got: list, ref: list, tie: float) -> int:
    """Greedy tokens of ``got`` equal ``ref``'s, step by step. A step may differ only where
    ``ref``'s top-2 logprob margin is within ``tie`` and ``got`` took its runner-up (a tie the
    dtype cannot resolve); that sequence is compared no further (its contexts differ). Returns
    the number of steps compared."""
    compared = 0
    for g, r in zip(got, ref, strict=True):
        for i, (tg, tr) in enumerate(zip(g.token_ids, r.token_ids, strict=True)):
            if tg != tr:
                top = r.logprobs[i]
                assert tg in top and top[tr].logprob - top[tg].logprob <= tie, (
                    f"step {i}: token {tg}, the torch cascade's {tr} ({top})"
                )
                break
            compared += 1
    return compared


# (model dtype, hidden size, tie): head dim hidden / 4, 16 (the float32-math kernel) or 64 (with
# bf16, the bf16 kernel's AVX512-BF16 path where the build has it). float32: the same values
# in float32, summed in another order, so every token is equal. bf16: both engines' activations
# are bf16, rounded at different points (the torch cascade attends in bf16, the native kernels
# in float32), so logits may differ by a bf16 ulp (2^-8 at the tiny model's logits) and a tie
# within a few ulps may break either way.
ENGINES = [
    ("float32", 64, 0.0),
    ("float32", 256, 0.0),
    ("bfloat16", 64, 2**-5),
    ("bfloat16", 256, 2**-5),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,hidden,tie", ENGINES)
@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_engine_greedy_matches_torch_cascade(monkeypatch, isa, dtype, hidden, tie, kv):
    """A tiny model over a quantized pool: the native backend's greedy tokens equal the torch
    cascade backend's (which dequantizes the rows it gathers) over the same pool format."""
    knobs = dict(dtype=dtype, kv_cache_dtype=kv, page_size=16, kv_cache_tokens=4096)
    monkeypatch.setenv("RADIXKV_ISA", isa)
    fast = dtype == "bfloat16" and bool(native.load(isa).has_fast_path(hidden // 4))
    native_engine = Engine(tiny_loaded_model(hidden_size=hidden), **knobs)
    backend = native_engine.runner.backend
    backend = getattr(backend, "inner", backend)  # int8: inside the rotation
    assert type(backend) is (NativeAttentionBackend if fast else NativeCascadeBackend)
    assert backend.isa == isa
    got = greedy(native_engine)
    monkeypatch.setenv("RADIXKV_NATIVE", "0")
    torch_engine = Engine(tiny_loaded_model(hidden_size=hidden), **knobs)
    assert (
        type(getattr(torch_engine.runner.backend, "inner", None) or torch_engine.runner.backend)
        is CascadeTorchBackend
    )
    ref = greedy(torch_engine)
    compared = assert_same_greedy(got, ref, tie)
    assert compared >= sum(len(r.token_ids) for r in ref) // 2, compared


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_fused_rope_rotation_is_the_two_pass_path(monkeypatch, isa, kv):
    """The bf16 engine over rotated pages runs RoPE and the q/k/v rotation as one pass
    (``RotatedKVBackend.forward_qkv``: ``rope_hadamard_``, the output rotated back in place);
    its greedy tokens and logprobs are bit for bit those of the two passes it replaced (the
    interface's ``forward_qkv``: ``rope_``, then ``forward`` rotating copies)."""
    from radixkv.model.attention.base import AttentionBackend
    from radixkv.model.attention.rotated_kv import RotatedKVBackend

    monkeypatch.setenv("RADIXKV_ISA", isa)
    knobs = dict(dtype="bfloat16", kv_cache_dtype=kv, page_size=16, kv_cache_tokens=4096)
    calls = []
    fused = RotatedKVBackend.forward_qkv

    def counted(self, *args, **kw):
        calls.append(1)
        return fused(self, *args, **kw)

    monkeypatch.setattr(RotatedKVBackend, "forward_qkv", counted)
    got = greedy(Engine(tiny_loaded_model(hidden_size=256), **knobs))
    assert calls, "the fused path did not run"
    monkeypatch.setattr(RotatedKVBackend, "forward_qkv", AttentionBackend.forward_qkv)
    ref = greedy(Engine(tiny_loaded_model(hidden_size=256), **knobs))
    for g, r in zip(got, ref, strict=True):
        assert g.token_ids == r.token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in g.logprobs] == [
            {t: lp.logprob for t, lp in step.items()} for step in r.logprobs
        ]


# ------------------------------------------------------------------------- the write side
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [64, 24, 80])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv-slices"])
def test_native_store_writes_quantizes_bytes(module, kind, dtype, d, strided) -> None:
    """``store_kv_quant_`` writes exactly ``kv_quant.quantize``'s bytes (codes and scale) to the
    given slots and nothing elsewhere: rows of every magnitude, a zero row, a row at the top of
    the range, a code exactly half-way (rounded to even); head dims of whole vectors and with a
    scalar tail; k, v contiguous or column slices of one fused QKV buffer (tokens strided)."""
    storage = KINDS[kind]
    g = torch.Generator().manual_seed(5)
    t, hkv = 150, 3
    k = (torch.randn(t, hkv, d, generator=g) * torch.rand(t, hkv, 1, generator=g) * 30).to(dtype)
    k[4, 2] = 0.0
    k[7, 0, :2] = torch.tensor([127.0, 63.5])  # codes at and near the top of the range
    # amax 448 gives an e4m3 scale of exactly 1: ties between e4m3 values (normal and
    # subnormal, both signs), a signed zero
    k[9, 1, :8] = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2**-10, 3 * 2**-10, -0.0, 2**-10])
    k[9, 1, 7] = -(3 * 2**-10)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    if strided:  # [T, (Hq + 2 Hkv) D] with Hq = 9: k and v are column slices
        qkv = torch.randn(t, (9 + 2 * hkv) * d, generator=g).to(dtype)
        qkv[:, 9 * d : (9 + hkv) * d] = k.reshape(t, -1)
        qkv[:, (9 + hkv) * d :] = v.reshape(t, -1)
        k = qkv[:, 9 * d : (9 + hkv) * d].view(t, hkv, d)
        v = qkv[:, (9 + hkv) * d :].view(t, hkv, d)
        assert not k.is_contiguous()
    kc = torch.full((20, 16, hkv, d + 2), 7, dtype=storage)
    vc = kc.clone()
    slots = torch.randperm(320, generator=g)[:t]
    module.store_kv_quant_(k, v, kc, vc, slots)
    for cache, x in ((kc, k), (vc, v)):
        flat = cache.view(-1, hkv, d + 2)
        assert torch.equal(flat[slots], quantize(x, storage))
        untouched = torch.ones(320, dtype=torch.bool)
        untouched[slots] = False
        assert bool((flat[untouched] == 7).all())
    with pytest.raises(RuntimeError, match="heads contiguous"):
        module.store_kv_quant_(k.transpose(0, 1), v.transpose(0, 1), kc, vc, slots[:hkv])
    with pytest.raises(RuntimeError, match="D \\+ 2"):
        module.store_kv_quant_(k, v, kc[..., :-1].contiguous(), vc[..., :-1].contiguous(), slots)
    with pytest.raises(RuntimeError, match="outside the pool"):
        module.store_kv_quant_(k[:1], v[:1], kc, vc, torch.tensor([320]))


@pytest.mark.parametrize("d", [24, 64, 80, 128])
def test_native_rotation_is_the_hadamard_product(module, d) -> None:
    """``hadamard_rows(x, s)`` is ``x @ hadamard(d) * s`` (float64 oracle; one float32 rounding
    per element for float32, one bf16 rounding for bf16): blocks of 8 (scalar under AVX-512,
    one vector under AVX2), 16, 64 and 128."""
    from radixkv.model.kv_quant import hadamard

    g = torch.Generator().manual_seed(d)
    x = torch.randn(40, 9, d, generator=g)
    want = x.double() @ hadamard(d).double() * 0.25
    got = module.hadamard_rows(x, 0.25)
    assert got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) <= 1e-6 * float(want.abs().max())
    got16 = module.hadamard_rows(x.bfloat16(), 0.25).double()
    want16 = x.bfloat16().double() @ hadamard(d).double() * 0.25
    assert float(((got16 - want16).abs() / want16.abs().clamp_min(1e-3)).max()) <= 2**-8


@pytest.mark.parametrize("d", [24, 64, 80])
def test_native_rotation_of_bf16_rounds_the_float32_result_once(module, d) -> None:
    """For bfloat16 rows the butterflies run in float32 and the result is rounded once, to
    nearest even as torch's ``.to(bfloat16)`` rounds: bit for bit the float32 path's output
    rounded by torch (vector lanes and scalar tails alike). A NaN row reads back as NaN (the
    quiet NaN c10::BFloat16 writes; torch's own vectorized cast keeps other NaN bits)."""
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(70, 5, d, generator=g) * 40).bfloat16()
    x[3, 1] = float("nan")
    finite = torch.ones(70, 5, dtype=torch.bool)
    finite[3, 1] = False
    for scale in (1.0, 0.125, 1 / 3):
        got = module.hadamard_rows(x, scale)
        want = module.hadamard_rows(x.float(), scale).bfloat16()
        assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
        assert bool((got[3, 1].view(torch.int16) == 0x7FC0).all())


@pytest.mark.parametrize("d", [16, 24, 32, 64, 128])
def test_native_rope_hadamard_is_rope_then_rotation(module, d) -> None:
    """``rope_hadamard_(qkv, cos, sin, r, n, d)`` leaves each of the first ``n`` heads of a row
    as ``rope(x) @ hadamard(d)`` (rope on the first ``r`` heads only): within a bf16 rounding
    of each step against a float64 oracle, and bit for bit what ``rope_`` then
    ``hadamard_rows`` write (the two-pass path it replaces in the engine). Heads after ``n``
    and columns outside the view are untouched. Head dims cover the register paths of both
    vector widths (2, 4, 8 vectors) and the buffered one (24; 128 under AVX2)."""
    from radixkv.model.kv_quant import hadamard

    t, hq, hkv = 33, 6, 2
    n = hq + 2 * hkv
    g = torch.Generator().manual_seed(d)
    wide = (torch.randn(t, (n + 1) * d + 7, generator=g) * 3).bfloat16()
    qkv = wide[:, : (n + 1) * d]  # rows at a stride wider than the view
    wide[5, d + 3] = float("nan")  # a NaN in a q head: NaN in its blocks, both ways alike
    before = wide.clone()
    cos, sin = rope_tables(
        torch.randint(0, 4000, (t,), generator=torch.Generator().manual_seed(d)), d
    )
    module.rope_hadamard_(qkv, cos, sin, hq + hkv, n, d)
    x = before[:, : n * d].double().view(t, n, d)
    roped = x.clone()
    roped[:, : hq + hkv] = rope64(x, cos, sin)[:, : hq + hkv]
    want = roped @ hadamard(d).double()
    got = wide[:, : n * d].double().view(t, n, d)
    # two bf16 roundings: RoPE's (2^-9 of each input to the sum) and the result's (2^-9 of it)
    bound = 2**-8 * (want.abs() + roped.abs().sum(dim=-1, keepdim=True))
    finite = torch.ones(t, n, dtype=torch.bool)
    finite[5, 1] = False
    assert bool(((got - want).abs() <= bound)[finite].all())
    assert bool(got[5, 1, : d & -d].isnan().all())  # the NaN's own Hadamard block
    assert torch.equal(wide[:, n * d :], before[:, n * d :])
    two_pass = before[:, : n * d].clone()
    module.rope_(two_pass, cos, sin, hq + hkv, d)
    two_pass = module.hadamard_rows(two_pass.view(t, n, d), 1.0)
    assert torch.equal(qkv[:, : n * d].view(t, n, d).view(torch.int16), two_pass.view(torch.int16))


def test_native_rotation_in_place_is_the_rotation(module) -> None:
    """``hadamard_rows_`` writes over its input the bits ``hadamard_rows`` returns."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(50, 9, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
        want = module.hadamard_rows(x, 1 / 64)
        module.hadamard_rows_(x, 1 / 64)
        assert torch.equal(x, want)


def test_native_rope_hadamard_rejects_bad_shapes(module) -> None:
    qkv = torch.zeros(4, 5 * 64, dtype=torch.bfloat16)
    cos = sin = torch.zeros(4, 64)
    with pytest.raises(RuntimeError, match="rope_heads <= heads"):
        module.rope_hadamard_(qkv, cos, sin, 6, 5, 64)
    with pytest.raises(RuntimeError, match="within the row"):
        module.rope_hadamard_(qkv, cos, sin, 3, 6, 64)
    with pytest.raises(RuntimeError, match="bf16 CPU"):
        module.rope_hadamard_(qkv.float(), cos, sin, 3, 5, 64)
    with pytest.raises(RuntimeError, match="cos and sin"):
        module.rope_hadamard_(qkv, cos[:3], sin[:3], 3, 5, 64)
