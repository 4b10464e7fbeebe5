"""What the load holds at its peak: the decoder's plain weights are freed as their packed copies
are made, not at the end of the load, and each layer is packed before the next is read; a tied
head is held once, the embedding gathering its rows from the packed copy; a weight the loader
owns is packed without both layouts held whole."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
from architectures import tiny_model
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from bench.tiny_model import byte_level_hf_tokenizer
from radixkv.model import linear, native, placement, repack
from radixkv.model.linear import (
    PackedEmbedding,
    native_gemm_module,
    packed_linear_supported,
    prepack_linears,
)
from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner, RequestSlice

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

needs_native_f32 = pytest.mark.skipif(
    not packed_linear_supported(torch.float32, "cpu")
    or native_gemm_module(torch.zeros(8, 8)) is None,
    reason="no native float32 GEMM here: every linear keeps its plain weight",
)


@needs_native_f32
def test_prepack_frees_each_released_weight_before_packing_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RADIXKV_KEEP_PLAIN_WEIGHTS", raising=False)
    layer = nn.Module()
    for name in PROJECTIONS:
        setattr(layer, name, nn.Linear(16, 32, bias=False).requires_grad_(False))
    plain = [weakref.ref(getattr(layer, name).weight) for name in PROJECTIONS]
    alive: list[int] = []

    class Spy(linear.PackedLinear):
        def __init__(self, lin: nn.Linear, *args: object, **kwargs: object) -> None:
            alive.append(sum(ref() is not None for ref in plain))
            super().__init__(lin, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(linear, "PackedLinear", Spy)
    assert prepack_linears(layer, release=PROJECTIONS) == 4
    assert alive == [4, 3, 2, 1]  # each released plain weight died with its nn.Linear
    assert all(ref() is None for ref in plain)
    assert all(getattr(layer, name).weight.is_meta for name in PROJECTIONS)


@pytest.mark.skipif(
    not packed_linear_supported(torch.float32, "cpu"), reason="no packed linears here"
)
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_each_layer_is_packed_before_the_next_layers_weights_are_read(
    name: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(qwen3_moe: a sparse layer's experts are packed with it, their plain weights released
    where the native GEMM reads only its own layout.)"""
    monkeypatch.delenv("RADIXKV_KEEP_PLAIN_WEIGHTS", raising=False)
    tiny_model(name).save_pretrained(tmp_path)
    byte_level_hf_tokenizer().save_pretrained(tmp_path)
    place = placement.WeightPlacer.__call__
    unpacked_before: list[int] = []

    def spy(self: placement.WeightPlacer, name: str, tensor: torch.Tensor) -> None:
        if name.startswith("layers.") and name.endswith(".qkv_proj.weight"):
            i = int(name.split(".")[1])  # layer i's first weight: every earlier layer packed?
            layers = self.model.layers[:i]
            unpacked_before.append(sum(type(m) is nn.Linear for m in layers.modules()))
        place(self, name, tensor)

    monkeypatch.setattr(placement.WeightPlacer, "__call__", spy)
    runner = ModelRunner(load_model(str(tmp_path), hf_model=False), num_pages=2, page_size=16)
    assert unpacked_before == [0] * runner.config.num_layers
    moe = runner.model.layers[0].moe
    if moe is not None:
        down = moe.experts[0].down_proj
        assert type(down) is linear.PackedLinear
        assert down.weight.is_meta == (down.kernel == "native")


def _weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).to(dtype)


def _native_packs() -> list[tuple[torch.dtype, object, int]]:
    """(dtype, pack, columns per block) of the native packings this host's build has."""
    module = native.load()
    if module is None:
        return []
    return [
        (torch.float32, module.pack_f32_weight, module.f32_gemm_cols()),
        (torch.bfloat16, module.pack_bf16_weight, module.bf16_gemm_block()[0]),
    ]


PACKS = _native_packs()
needs_native = pytest.mark.skipif(not PACKS, reason="no native kernels here")


@needs_native
@pytest.mark.parametrize("which", range(2))
def test_packing_in_place_and_from_a_file_match_the_native_packing(
    which: int, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dtype, pack, cols = PACKS[which]
    n, k = 41 * cols, 1024  # several steps, a short last one, pages dropped in between
    monkeypatch.setattr(repack, "STEP_ELEMENTS", 5 * cols * k)
    monkeypatch.setattr(repack, "DROP_BYTES", 3 * 4096)
    w = _weight(n, k, dtype)
    want = pack(w)
    heap = w.clone()
    assert repack.memory_kind(heap) == "anon"
    got = repack.pack_in_place(heap, cols)
    assert got.data_ptr() == heap.data_ptr() and torch.equal(got, want)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        mapped = f.get_tensor("w")
    assert repack.memory_kind(mapped) == "file"
    assert torch.equal(repack.pack_dropping_source(mapped, cols), want)
    assert torch.equal(mapped, w)  # its dropped pages read back from the file


@needs_native
@pytest.mark.parametrize("which", range(2))
def test_packed_embedding_gathers_the_rows_exactly(which: int) -> None:
    dtype, pack, cols = PACKS[which]
    w = _weight(8 * cols, 64, dtype)
    head = SimpleNamespace(  # a PackedLinear holding only its native copy, as far as it reads
        in_features=64,
        out_features=8 * cols,
        kernel="native",
        weight=nn.Parameter(torch.empty(w.shape, dtype=dtype, device="meta")),
        packed=pack(w),
    )
    embed = PackedEmbedding(head)  # type: ignore[arg-type]
    ids = torch.tensor([[0, 5, 8 * cols - 1], [cols, cols + 1, 3]])
    got = embed(ids)
    assert got.shape == (2, 3, 64) and got.dtype == dtype
    assert torch.equal(got, w[ids])


def _tied_checkpoint(path) -> nn.Module:
    """A tiny tied Llama whose vocabulary the native GEMM takes (a multiple of 16), saved."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=272,
        hidden_size=96,
        intermediate_size=136,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    byte_level_hf_tokenizer().save_pretrained(path)
    return model


def test_a_streamed_tied_head_is_held_once_and_computes_the_same_logits(tmp_path) -> None:
    hf = _tied_checkpoint(tmp_path)
    streamed = load_model(str(tmp_path), hf_model=False)
    runners = [
        ModelRunner(m, num_pages=8, page_size=16, dtype=torch.float32) for m in (streamed, hf)
    ]
    for runner in runners:
        m = runner.model
        assert m.lm_head.weight is m.embed_tokens.weight
        if getattr(m.lm_head, "kernel", None) == "native":
            assert isinstance(m.embed_tokens, PackedEmbedding) and m.lm_head.weight.is_meta
    ids = list(range(3, 60))
    logits = [r.forward(r.build_batch([RequestSlice(ids, 0, [1, 2, 3, 4])])) for r in runners]
    assert torch.equal(logits[0], logits[1])  # the same packed weights, the same kernels
    ref = hf(torch.tensor([ids])).logits[0, -1].double()
    assert (logits[0][0].double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_only_a_weight_the_placer_alone_holds_is_repacked_in_its_memory() -> None:
    with torch.device("meta"):
        model = nn.Module()
        model.a = nn.Linear(64, 64, bias=False)
        model.b = nn.Linear(64, 64, bias=False)
        model.c = nn.Linear(64, 64, bias=False)
    shared, alone = torch.randn(64, 64), torch.randn(64, 64)
    placer = placement.WeightPlacer(model, "test", owned=True)
    for name, t in (("a.weight", shared), ("b.weight", shared), ("c.weight", alone)):
        placer(name, t)
    assert placer.owned_kind(model.c.weight) == "anon"
    assert placer.owned_kind(model.a.weight) is None  # b's memory too
    assert (
        placement.WeightPlacer(model, "test").owned_kind(model.c.weight) is None
    )  # not owned at all
