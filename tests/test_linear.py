"""Prepacked oneDNN linears: same results as ``F.linear``, same parameters, off when unsupported."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixkv.model import linear
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
