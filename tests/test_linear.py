"""Prepacked oneDNN linears: same results as ``F.linear``, same parameters, off when unsupported."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixkv.model import linear, native
from radixkv.model.linear import PackedLinear, packed_linear_supported, prepack_linears
from radixkv.model.llama import LlamaModel, ModelConfig

needs_onednn = pytest.mark.skipif(
    not packed_linear_supported(torch.float32, "cpu"),
    reason="this torch build has no oneDNN prepacked linear (torch.ops.mkldnn)",
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 1600, bias=bias).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1600, 96, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(1600, generator=g))
    x = torch.randn(rows, 96, generator=g)
    for min_rows in (1, 2, 16):
        packed = PackedLinear(lin, min_rows=min_rows)
        assert packed.weight is lin.weight and packed.bias is lin.bias
        y = packed(x)
        ref = F.linear(x, lin.weight, lin.bias)
        assert y.shape == ref.shape and y.dtype == torch.float32
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    # leading batch dims are rows too
    x3 = x.reshape(1, rows, 96)
    torch.testing.assert_close(PackedLinear(lin, 1)(x3), F.linear(x3, lin.weight, lin.bias))


def _tiny_config(tie: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=tie,
    )


def _state_dict(config: ModelConfig, tie: bool) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads,
            tie_word_embeddings=tie,
        )
    )
    return hf.state_dict()


@needs_onednn
@pytest.mark.parametrize("tie", [False, True])
def test_llama_packs_every_linear_and_keeps_ties(tie: bool) -> None:
    config = _tiny_config(tie)
    sd = _state_dict(config, tie)
    model = LlamaModel.from_hf_state_dict(config, sd)
    assert isinstance(model.lm_head, PackedLinear)
    assert not any(type(m) is nn.Linear for m in model.modules()), "a linear left unpacked"
    assert (model.lm_head.weight is model.embed_tokens.weight) is tie
    keys = set(model.state_dict())
    assert "lm_head.weight" in keys and not any("packed" in k for k in keys)
    x = torch.randn(5, config.hidden_size)
    # (the head's plain weight may be released: its packed copy is all the native GEMM reads)
    torch.testing.assert_close(model.lm_head(x), F.linear(x, sd["lm_head.weight"]))
    ids = torch.tensor([0, 7, 8, 511])
    assert torch.equal(model.embed_tokens(ids), sd["model.embed_tokens.weight"][ids])


def onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT:
    an AVX2-only host such as Zen 3 has neither, and there the packed branch cannot run)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return torch.backends.mkldnn.is_available()


def test_bf16_is_packed_only_with_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 linears are packed where the CPU has native bf16 (the packed path's products equal
    F.linear's up to bf16 rounding), and left plain where bf16 is emulated (each host kind is
    checked through the host probe, so both branches run on every host)."""
    config = _tiny_config(False)
    sd = _state_dict(config, False)
    for native_bf16 in (True, False) if onednn_packs_bf16() else (False,):
        monkeypatch.setattr(linear, "has_native_bf16", lambda v=native_bf16: v)
        bf16 = LlamaModel.from_hf_state_dict(config, sd, dtype=torch.bfloat16)
        packed = torch.backends.mkldnn.is_available() and native_bf16
        assert isinstance(bf16.lm_head, PackedLinear) is packed
        x = torch.randn(6, config.hidden_size).to(torch.bfloat16)
        ref = F.linear(x.double(), bf16.lm_head.weight.double())
        err = (bf16.lm_head(x).double() - ref).abs().max().item()
        assert err <= 2**-7 * ref.abs().max().item(), err  # bf16 output rounding, no more


def test_prepack_is_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _tiny_config(False)
    sd = _state_dict(config, False)
    monkeypatch.setenv("RADIXKV_PACKED_LINEAR", "0")
    assert not packed_linear_supported(torch.float32, "cpu")
    fp32 = LlamaModel.from_hf_state_dict(config, sd)
    assert type(fp32.lm_head) is nn.Linear
    assert prepack_linears(fp32) == 0


# -- radixkv's own bf16 GEMM (AVX512-BF16 builds) -----------------------------------------------


def _gemm_builds() -> list[tuple[str, torch.dtype]]:
    """(ISA build, dtype) pairs whose native GEMM this host can run."""
    out = []
    for isa in native.runnable_isas():
        module = native.load(isa)
        if module is not None:
            out += [(isa, torch.bfloat16)] if module.has_bf16_gemm() else []
            out += [(isa, torch.float32)] if module.has_f32_gemm() else []
    return out


GEMM_BUILDS = _gemm_builds()
needs_native_gemm = pytest.mark.skipif(
    not GEMM_BUILDS, reason=f"no native GEMM on this host ({native.host_isa()})"
)


def _gemm(isa: str, dtype: torch.dtype):
    """(pack, multiply, columns per block) of the ``isa`` build's GEMM for ``dtype``."""
    module = native.load(isa)
    if dtype == torch.bfloat16:
        return module.pack_bf16_weight, module.bf16_gemm, module.bf16_gemm_block()[0]
    return module.pack_f32_weight, module.f32_gemm, module.f32_gemm_cols()


def _gemm_bound(
    x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product and the error allowed: float32 accumulation over K terms, plus one
    rounding of the result to bf16 (2^-8 relative, round to nearest) for bf16 outputs."""
    ref = x.double() @ w.double().T
    k = x.shape[-1]
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23
    allowed = rounding * ref.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    return ref, allowed


@needs_native_gemm
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64, 130, 300])
@pytest.mark.parametrize("blocks", [1, 2, 3, 5, 60])
@pytest.mark.parametrize(("isa", "dtype"), GEMM_BUILDS or [("none", torch.float32)])
def test_native_gemm_is_the_product_within_its_rounding(
    isa: str, dtype: torch.dtype, blocks: int, rows: int
) -> None:
    """Every row-tile height (1-8 rows), every column-chunk width (1-3 blocks), every build and
    dtype the host runs, against a float64 product."""
    pack, gemm, cols = _gemm(isa, dtype)
    k = {1: 2, 2: 62, 3: 96, 5: 576, 60: 576}[blocks]
    g = torch.Generator().manual_seed(rows * 1000 + blocks + k)
    w = torch.randn(blocks * cols, k, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    y = gemm(x, pack(w))
    assert y.shape == (rows, blocks * cols) and y.dtype == dtype
    ref, allowed = _gemm_bound(x, w, dtype)
    excess = ((y.double() - ref).abs() - allowed).max().item()
    assert excess <= 0, excess


@needs_native_gemm
@pytest.mark.parametrize(("isa", "dtype"), GEMM_BUILDS or [("none", torch.float32)])
def test_native_gemm_does_not_depend_on_threads_or_strides(isa: str, dtype: torch.dtype) -> None:
    pack, gemm, _ = _gemm(isa, dtype)
    g = torch.Generator().manual_seed(7)
    packed = pack(torch.randn(3072, 576, generator=g).to(dtype))
    x = torch.randn(64, 1152, generator=g).to(dtype)[:, ::2]  # not contiguous
    y = gemm(x, packed)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = gemm(x.contiguous(), packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, y1)  # each output's sum order is fixed by K alone
    assert gemm(x[:0], packed).shape == (0, 3072)


@needs_native_gemm
@pytest.mark.parametrize(("isa", "dtype"), GEMM_BUILDS or [("none", torch.float32)])
def test_native_gemm_rejects_what_it_cannot_run(isa: str, dtype: torch.dtype) -> None:
    pack, gemm, cols = _gemm(isa, dtype)
    w = torch.randn(2 * cols, 64).to(dtype)
    packed = pack(w)
    with pytest.raises(RuntimeError, match="expects 64"):
        gemm(torch.randn(2, 62).to(dtype), packed)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match="rows, got"):
        gemm(torch.randn(2, 64).to(other), packed)
    with pytest.raises(RuntimeError, match="pack function"):
        gemm(torch.randn(2, 64).to(dtype), w)
    with pytest.raises(RuntimeError, match=f"out_features % {cols}"):
        pack(torch.randn(cols + cols // 2, 64).to(dtype))


def test_float32_linears_keep_onednn_on_avx512_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    if "avx512" not in native.runnable_isas() or not packed_linear_supported(torch.float32, "cpu"):
        pytest.skip("no AVX-512 build on this host")
    monkeypatch.setenv("RADIXKV_ISA", "avx512")
    assert PackedLinear(nn.Linear(96, 160).requires_grad_(False)).kernel == "onednn"


@pytest.mark.parametrize("isa", native.runnable_isas())
def test_each_build_has_the_gemms_its_isa_runs(isa: str) -> None:
    """bf16 only on the AVX512-BF16 build, float32 on the AVX2 and AVX-512 builds, neither on
    the portable one; a missing one raises naming the build it needs."""
    module = native.load(isa)
    if module is None:
        pytest.skip(f"native build failed: {native.build_error()}")
    assert module.has_bf16_gemm() is (isa == "avx512_bf16")
    assert module.has_f32_gemm() is (isa != "portable")
    assert module.f32_gemm_cols() == (8 if isa in ("avx2", "portable") else 16)
    assert module.bf16_gemm_block() == (16, 2)  # pack_bf16_weight's [N / 16, K / 2, 32]
    if isa != "avx512_bf16":
        with pytest.raises(RuntimeError, match="avx512_bf16"):
            module.bf16_gemm(torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 1, 32))
    if isa == "portable":
        with pytest.raises(RuntimeError, match="avx2 or avx512"):
            module.f32_gemm(torch.zeros(1, 1), torch.zeros(1, 1, 8))


@needs_native_gemm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_takes_the_native_gemm(
    dtype: torch.dtype, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linears use the host build's native GEMM at every row count (leading dims are rows);
    weights it cannot take (out_features not a multiple of its block) and
    ``RADIXKV_CPU_GEMM=onednn`` keep oneDNN; both give the product within its rounding."""
    # float32 linears take it on the AVX2 build (Zen 3 hosts), which every x86 host here runs
    isa = native.host_isa() if dtype == torch.bfloat16 else "avx2"
    if (isa, dtype) not in GEMM_BUILDS or not packed_linear_supported(dtype, "cpu"):
        pytest.skip(f"no {isa} build with a {dtype} GEMM on this host")
    monkeypatch.setenv("RADIXKV_ISA", isa)
    g = torch.Generator().manual_seed(3)

    def make(n: int) -> nn.Linear:
        lin = nn.Linear(96, n, bias=bias).requires_grad_(False).to(dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, 96, generator=g))
            if bias:
                lin.bias.copy_(torch.randn(n, generator=g))
        return lin

    for n, env, kernel in [(160, None, "native"), (100, None, "onednn"), (160, "onednn", "onednn")]:
        if env is None:
            monkeypatch.delenv("RADIXKV_CPU_GEMM", raising=False)
        else:
            monkeypatch.setenv("RADIXKV_CPU_GEMM", env)
        lin = make(n)
        packed = PackedLinear(lin)
        assert packed.kernel == kernel, (n, env)
        packed = copy.deepcopy(packed)  # packs the copied weights afresh
        assert packed.kernel == kernel and packed.weight is not lin.weight
        for rows in (1, 5, 64):
            x = torch.randn(2, rows, 96, generator=g).to(dtype)
            y = packed(x)
            assert y.shape == (2, rows, lin.out_features) and y.dtype == dtype
            ref, allowed = _gemm_bound(x, lin.weight, dtype)
            if bias:
                ref = ref + lin.bias.double()
                rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23
                allowed = allowed + rounding * ref.abs()  # the bias is added to rounded rows
            assert ((y.double() - ref).abs() - allowed).max().item() <= 0


class _Calls:
    """A native module whose GEMM calls are recorded by name (the row count of each)."""

    def __init__(self, module, calls: list[tuple[str, int]]) -> None:
        self._module, self._calls = module, calls

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)
        if not name.startswith("bf16_gemm"):
            return fn
        return lambda x, w: self._calls.append((name, x.shape[0])) or fn(x, w)


def _amx_tiles_here() -> bool:
    module = native.load("avx512_bf16") if "avx512_bf16" in native.runnable_isas() else None
    return module is not None and module.bf16_gemm_amx_available()


@pytest.mark.parametrize("in_features", [96, 80])
@pytest.mark.parametrize("amx", [False, True])
def test_bf16_linears_pick_their_gemm_by_rows_on_amx_hosts(
    amx: bool, in_features: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an AMX-BF16 host a native bf16 linear runs radixkv's vector GEMM below
    ``AMX_MIN_ROWS`` rows, its tile GEMM from there through ``AMX_MAX_ROWS`` (where the host
    grants the tiles and ``in_features % 32 == 0``) and oneDNN's AMX GEMM above; without the
    tile GEMM (in_features 80) oneDNN from ``ONEDNN_AMX_MIN_ROWS``. ``RADIXKV_CPU_GEMM=native``
    keeps radixkv's GEMMs everywhere. AMX is faked where the host lacks it (oneDNN runs bf16 on
    AVX512-BF16 too; the tile GEMM then reports itself unavailable), so the switch is tested on
    every host with the bf16 GEMM, and every product against float64."""
    if ("avx512_bf16", torch.bfloat16) not in GEMM_BUILDS or not packed_linear_supported(
        torch.bfloat16, "cpu"
    ):
        pytest.skip("no AVX512-BF16 build with the bf16 GEMM on this host")
    monkeypatch.setenv("RADIXKV_ISA", "avx512_bf16")
    monkeypatch.delenv("RADIXKV_CPU_GEMM", raising=False)
    monkeypatch.setattr(linear, "has_amx_bf16", lambda: amx)
    tiles = amx and in_features % 32 == 0 and _amx_tiles_here()
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(in_features, 160, bias=True).requires_grad_(False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(160, in_features, generator=g))
        lin.bias.copy_(torch.randn(160, generator=g))
    packed = PackedLinear(lin)
    assert packed.kernel == "native" and packed.amx_tiles is tiles
    assert (packed.amx_packed is not None) is amx
    onednn_from = linear.AMX_MAX_ROWS + 1 if tiles else linear.ONEDNN_AMX_MIN_ROWS
    assert packed.amx_min_rows == (onednn_from if amx else None)
    calls: list[tuple[str, int]] = []
    onednn = PackedLinear._onednn
    monkeypatch.setattr(
        PackedLinear,
        "_onednn",
        lambda self, x, w: calls.append(("onednn", x.shape[-2])) or onednn(self, x, w),
    )
    monkeypatch.setitem(
        linear._GEMM_MODULES, packed._gemm, _Calls(linear._GEMM_MODULES[packed._gemm], calls)
    )
    row_counts = (1, linear.AMX_MIN_ROWS - 1, linear.AMX_MIN_ROWS, 64, linear.AMX_MAX_ROWS)
    row_counts += (linear.AMX_MAX_ROWS + 1,)
    for rows in row_counts:
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        y = packed(x)
        ref, allowed = _gemm_bound(x, lin.weight, torch.bfloat16)
        ref = ref + lin.bias.double()
        allowed = allowed + 2.0**-8 * ref.abs()
        assert ((y.double() - ref).abs() - allowed).max().item() <= 0, rows

    def expected(rows: int) -> str:
        if amx and rows >= onednn_from:
            return "onednn"
        return "bf16_gemm_amx" if tiles and rows >= linear.AMX_MIN_ROWS else "bf16_gemm"

    assert calls == [(expected(r), r) for r in row_counts]
    assert ("AMX" in repr(packed)) is amx
    monkeypatch.setenv("RADIXKV_CPU_GEMM", "native")
    native_only = PackedLinear(lin)
    assert native_only.amx_packed is None and native_only.amx_tiles is tiles
    monkeypatch.setenv("RADIXKV_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="auto, native or onednn"):
        PackedLinear(lin)


needs_amx_tiles = pytest.mark.skipif(
    not _amx_tiles_here(), reason="this host has no AMX-BF16 (or no tile state for this process)"
)


@needs_amx_tiles
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 48, 49, 64, 100, 300])
@pytest.mark.parametrize(("blocks", "k"), [(1, 32), (2, 96), (3, 576), (5, 1536), (60, 576)])
def test_amx_gemm_is_the_product_within_its_rounding(rows: int, blocks: int, k: int) -> None:
    """radixkv's tile GEMM over the vector GEMM's packed weight: partial row tiles (padded to 16
    rows), one or two row tiles per pair, an odd last column block, row blocks past 256 rows,
    33-64 rows one column block at a time, against a float64 product with the vector GEMM's
    bound."""
    module = native.load("avx512_bf16")
    g = torch.Generator().manual_seed(rows * 1000 + blocks + k)
    w = torch.randn(blocks * 16, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    y = module.bf16_gemm_amx(x, module.pack_bf16_weight(w))
    assert y.shape == (rows, blocks * 16) and y.dtype == torch.bfloat16
    ref, allowed = _gemm_bound(x, w, torch.bfloat16)
    excess = ((y.double() - ref).abs() - allowed).max().item()
    assert excess <= 0, excess


@needs_amx_tiles
def test_amx_gemm_does_not_depend_on_threads_and_refuses_what_it_cannot_run() -> None:
    module = native.load("avx512_bf16")
    g = torch.Generator().manual_seed(9)
    packed = module.pack_bf16_weight(torch.randn(3072, 576, generator=g).bfloat16())
    x = torch.randn(70, 1152, generator=g).bfloat16()[:, ::2]  # not contiguous
    y = module.bf16_gemm_amx(x, packed)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = module.bf16_gemm_amx(x.contiguous(), packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, y1)  # an output's tiles and their k order do not depend on threads
    assert module.bf16_gemm_amx(x[:0], packed).shape == (0, 3072)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        module.bf16_gemm_amx(
            torch.randn(2, 80).bfloat16(),
            module.pack_bf16_weight(w80 := torch.randn(16, 80).bfloat16()),
        )
    with pytest.raises(RuntimeError, match="pack function"):
        module.bf16_gemm_amx(torch.randn(2, 80).bfloat16(), w80)


@needs_amx_tiles
def test_atens_own_amx_kernels_are_unharmed_by_the_tile_gemm() -> None:
    """The tile GEMM loads its tile configuration on torch's worker threads and hands the tile
    state back through ATen's release: ATen's bf16 SDPA (brgemm on AMX hosts) and oneDNN's bf16
    linear give the same bits before and after it ran on the same threads."""
    module = native.load("avx512_bf16")
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 9, 200, 64, generator=g).bfloat16() for _ in range(3))
    x = torch.randn(77, 576, generator=g).bfloat16()
    w = torch.randn(1536, 576, generator=g).bfloat16()
    onednn_w = torch.ops.mkldnn._reorder_linear_weight(w, None)

    def aten_ops():
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        dnn = torch.ops.mkldnn._linear_pointwise(x, onednn_w, None, "none", [], "")
        return sdpa, F.linear(x, w), dnn

    before = aten_ops()
    packed = module.pack_bf16_weight(w)
    for _ in range(3):
        module.bf16_gemm_amx(x, packed)
        for a, b in zip(before, aten_ops(), strict=True):
            assert torch.equal(a, b)


def test_bf16_gemm_amx_is_refused_without_the_tiles() -> None:
    """Builds or hosts without AMX tiles say so and refuse the tile GEMM with a message."""
    for isa in native.runnable_isas():
        module = native.load(isa)
        if module is None or module.bf16_gemm_amx_available():
            continue
        with pytest.raises(RuntimeError, match="AMX|avx512_bf16"):
            module.bf16_gemm_amx(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 16, 32))


def test_has_amx_bf16_follows_the_cpu_flags() -> None:
    from radixkv.model.host_cpu import cpu_flags, has_amx_bf16

    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        assert has_amx_bf16() is False
    else:  # Linux >= 5.16 grants the tile state; torch asks for it
        assert has_amx_bf16() is True
