"""The engine's load streams a safetensors checkpoint into radixkv's layout: no transformers
model is built, a sharded checkpoint reads through its index, tied weights saved once resolve,
and the result computes the same logits as the runner built from the transformers model."""

from __future__ import annotations

import pytest
import torch
from architectures import tiny_model

from bench.tiny_model import byte_level_hf_tokenizer
from radixkv.model.checkpoint import SafetensorsCheckpoint
from radixkv.model.linear import PackedEmbedding
from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner, RequestSlice


@pytest.mark.parametrize(
    "name, shard",
    [("qwen3", None), ("gemma3", "200KB"), ("qwen3_moe", "300KB"), ("mixtral", None)],
)
def test_streamed_load_equals_the_transformers_model(name, shard, tmp_path):
    """The MoE models' experts are saved one by one (``mlp.experts.{e}.gate_proj``,
    Mixtral's ``block_sparse_moe.experts.{e}.w1``) and held fused by transformers 5.x's
    modules (``mlp.experts.gate_up_proj``): both readings build the same model."""
    model = tiny_model(name)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    byte_level_hf_tokenizer().save_pretrained(tmp_path)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    streamed = load_model(str(tmp_path), hf_model=False)
    assert streamed.hf_model is None and isinstance(streamed.weights, SafetensorsCheckpoint)
    assert streamed.num_parameters() == sum(p.numel() for p in model.parameters())
    ids = list(range(3, 60))
    logits = []
    for loaded in (streamed, model):
        runner = ModelRunner(loaded, num_pages=8, page_size=16, dtype=torch.float32)
        batch = runner.build_batch([RequestSlice(ids, 0, [1, 2, 3, 4])])
        logits.append(runner.forward(batch))
    diff = (logits[0] - logits[1]).abs().max().item()
    assert diff <= 1e-5 * logits[1].abs().max().item(), diff  # the same model, summed alike


def test_the_packaged_model_streams_from_the_weight_cache():
    """SmolLM2's weight cache holds its tied head once (as lm_head.weight); the streamed load
    takes the embedding from it, and the decoder layers keep only their packed copies where the
    native GEMM is all that reads them. There the tied head is held once too: packed, the
    embedding's rows gathered from it."""
    loaded = load_model("smollm2", hf_model=False)
    assert loaded.hf_model is None and "model.embed_tokens.weight" not in loaded.weights
    runner = ModelRunner(loaded, num_pages=4, page_size=16, dtype=torch.float32)
    m = runner.model
    assert m.lm_head.weight is m.embed_tokens.weight
    proj = m.layers[0].qkv_proj
    if getattr(proj, "kernel", None) == "native":
        assert proj.weight.is_meta and proj.weight.shape == (960, 576)
        assert isinstance(m.embed_tokens, PackedEmbedding) and m.lm_head.weight.is_meta
        assert m.embed_tokens.packed is m.lm_head.packed
    else:
        assert not m.embed_tokens.weight.is_meta
