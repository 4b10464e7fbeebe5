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
    model = LlamaModel.from_hf_state_dict(config, _state_dict(config, tie))
    assert isinstance(model.lm_head, PackedLinear)
    assert not any(type(m) is nn.Linear for m in model.modules()), "a linear left unpacked"
    assert (model.lm_head.weight is model.embed_tokens.weight) is tie
    keys = set(model.state_dict())
    assert "lm_head.weight" in keys and not any("packed" in k for k in keys)
    x = torch.randn(5, config.hidden_size)
    torch.testing.assert_close(model.lm_head(x), F.linear(x, model.lm_head.weight))


def test_bf16_is_packed_only_with_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 linears are packed where the CPU has native bf16 (the packed path's products equal
    F.linear's up to bf16 rounding), and left plain where bf16 is emulated (each host kind is
    checked through the host probe, so both branches run on every host)."""
    config = _tiny_config(False)
    sd = _state_dict(config, False)
    for native_bf16 in (True, False):
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

_GEMM = native.load()
needs_bf16_gemm = pytest.mark.skipif(
    _GEMM is None or not _GEMM.has_bf16_gemm(),
    reason=f"the host's native build ({native.host_isa()}) has no AVX512-BF16 GEMM",
)


def _gemm_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product and the error allowed: one bf16 rounding of the result (2^-8
    relative, round to nearest) plus float32 accumulation over K terms."""
    ref = x.double() @ w.double().T
    k = x.shape[-1]
    allowed = 2.0**-8 * ref.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    return ref, allowed


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64, 130])
@pytest.mark.parametrize(("n", "k"), [(16, 2), (32, 62), (48, 96), (80, 576), (960, 576)])
def test_bf16_gemm_is_the_product_within_one_rounding(rows: int, n: int, k: int) -> None:
    """Every row-tile size (1-8 rows), every column-chunk size (1-3 blocks of 16), against a
    float64 product: each output is within one bf16 rounding plus float32 accumulation."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    y = _GEMM.bf16_gemm(x, _GEMM.pack_bf16_weight(w))
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    ref, allowed = _gemm_bound(x, w)
    excess = ((y.double() - ref).abs() - allowed).max().item()
    assert excess <= 0, excess


@needs_bf16_gemm
def test_bf16_gemm_does_not_depend_on_threads_or_strides() -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3072, 576, generator=g).to(torch.bfloat16)
    packed = _GEMM.pack_bf16_weight(w)
    wide = torch.randn(64, 1152, generator=g).to(torch.bfloat16)
    x = wide[:, ::2]  # not contiguous
    y = _GEMM.bf16_gemm(x, packed)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = _GEMM.bf16_gemm(x.contiguous(), packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, y1)  # each output's sum order is fixed by K alone
    assert _GEMM.bf16_gemm(x[:0], packed).shape == (0, 3072)


@needs_bf16_gemm
def test_bf16_gemm_rejects_what_it_cannot_run() -> None:
    w = torch.randn(32, 64).to(torch.bfloat16)
    packed = _GEMM.pack_bf16_weight(w)
    with pytest.raises(RuntimeError, match="expects 64"):
        _GEMM.bf16_gemm(torch.randn(2, 62).to(torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bfloat16"):
        _GEMM.bf16_gemm(torch.randn(2, 64), packed)
    with pytest.raises(RuntimeError, match="pack_bf16_weight"):
        _GEMM.bf16_gemm(torch.randn(2, 64).to(torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="out_features % 16"):
        _GEMM.pack_bf16_weight(torch.randn(24, 64).to(torch.bfloat16))


@pytest.mark.parametrize("isa", native.runnable_isas())
def test_only_the_avx512_bf16_build_has_the_gemm(isa: str) -> None:
    module = native.load(isa)
    if module is None:
        pytest.skip(f"native build failed: {native.build_error()}")
    assert module.has_bf16_gemm() is (isa == "avx512_bf16")
    if isa != "avx512_bf16":
        with pytest.raises(RuntimeError, match="avx512_bf16"):
            module.bf16_gemm(torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 1, 16, 2))


@needs_bf16_gemm
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_takes_the_native_gemm_for_bf16(
    bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 linears use the native GEMM at every row count (leading dims are rows); weights it
    cannot take (out_features % 16) and ``RADIXKV_BF16_GEMM=onednn`` keep oneDNN; both give
    the product within one bf16 rounding."""
    g = torch.Generator().manual_seed(3)

    def make(n: int) -> nn.Linear:
        lin = nn.Linear(96, n, bias=bias).requires_grad_(False).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, 96, generator=g))
            if bias:
                lin.bias.copy_(torch.randn(n, generator=g))
        return lin

    for n, env, kernel in [(160, None, "native"), (100, None, "onednn"), (160, "onednn", "onednn")]:
        if env is None:
            monkeypatch.delenv("RADIXKV_BF16_GEMM", raising=False)
        else:
            monkeypatch.setenv("RADIXKV_BF16_GEMM", env)
        lin = make(n)
        packed = PackedLinear(lin)
        assert packed.kernel == kernel, (n, env)
        if kernel == "native":  # copies like any module (oneDNN's opaque tensor does not)
            packed = copy.deepcopy(packed)
        for rows in (1, 5, 64):
            x = torch.randn(2, rows, 96, generator=g).to(torch.bfloat16)
            y = packed(x)
            assert y.shape == (2, rows, lin.out_features) and y.dtype == torch.bfloat16
            ref, allowed = _gemm_bound(x, lin.weight)
            if bias:
                ref = ref + lin.bias.double()
                allowed = allowed + 2.0**-8 * ref.abs()  # the bias is added to rounded rows
            assert ((y.double() - ref).abs() - allowed).max().item() <= 0
