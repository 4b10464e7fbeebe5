"""The decoder layers as one native call (radixkv/model/decoder_stack.py, csrc/cpu_decoder.cpp):
the same native ops in the same order as the Python loop over ``DecoderLayer.forward_fused``, so
every logit row equals the loop's bit for bit (prefill, a mixed step with a shared prefix,
decodes), for float32 weights on radixkv's GEMM and GGUF blocks (float and int8 activations);
the call is counted, so a test cannot pass on the loop alone; layers it does not compute (q/k
norm, windows, biases) keep the loop and their own oracle checks (tests/test_architectures.py)."""

from __future__ import annotations

import pytest
import torch
from architectures import VOCAB, tiny_model
from kernel_paths import fp32_paths, use_path
from oracle import FP32, Oracle
from test_gguf_quantized import tiny_gguf
from test_model import MixedScenario

from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner


def counted_runs(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of ``decoder_layers_f32`` calls through ``runner``'s native build."""
    module = getattr(runner.backend, "module", None)
    if module is None:
        pytest.skip("no native build here: the stack needs one")
    op = module.decoder_layers_f32
    calls = [0]

    def counted(*args):
        calls[0] += 1
        return op(*args)

    monkeypatch.setattr(module, "decoder_layers_f32", counted)
    return calls


def stack_and_loop(runner: ModelRunner, scenario: MixedScenario, monkeypatch) -> int:
    """Run ``scenario`` with the stack and with the loop; every row equal; the stack's calls."""
    calls = counted_runs(runner, monkeypatch)
    runner.model.use_decoder_stack = True
    stacked = scenario.run(runner)
    used = calls[0]
    runner.model.use_decoder_stack = False
    looped = scenario.run(runner)
    assert calls[0] == used  # the switch keeps the loop
    for name in stacked:
        assert torch.equal(stacked[name], looped[name]), name
    return used


@pytest.mark.parametrize("path", [p for p in fp32_paths() if p.isa is not None], ids=str)
def test_float32_layers_in_one_call_equal_the_loop_bit_for_bit(path, monkeypatch):
    use_path(path, monkeypatch)
    model = tiny_model("llama3")
    oracle = Oracle(model)
    scenario = MixedScenario.build(oracle, VOCAB, decode_steps=4)
    runner = ModelRunner(model, num_pages=64, page_size=16, dtype=torch.float32)
    used = stack_and_loop(runner, scenario, monkeypatch)
    if not runner.backend.module.has_f32_gemm():  # the portable build: torch's GEMM, the loop
        assert used == 0
        return
    assert used == 1 + scenario.decode_steps  # every forward
    runner.model.use_decoder_stack = True
    assert scenario.judge(scenario.run(runner), oracle, FP32, f"decoder stack {path}") > 0


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_gguf_blocks_in_one_call_equal_the_loop_bit_for_bit(
    activations,
    tmp_path,
    weight_cache,
    monkeypatch,
):
    monkeypatch.setenv("RADIXKV_QUANT_ACTIVATIONS", activations)
    path, oracle = tiny_gguf("llama3", "Q4_1", tmp_path)
    scenario = MixedScenario.build(oracle, VOCAB, decode_steps=4)
    loaded = load_model(path, hf_model=False, quantization="gguf")
    runner = ModelRunner(
        loaded, num_pages=64, page_size=16, dtype=torch.float32, quantization="gguf"
    )
    assert stack_and_loop(runner, scenario, monkeypatch) == 1 + scenario.decode_steps


@pytest.mark.parametrize("name", ["qwen3", "mistral", "qwen2", "granite"])
def test_layers_it_does_not_compute_keep_the_loop(name, monkeypatch):
    """q/k norm (qwen3), sliding windows (mistral), biases (qwen2), a residual multiplier
    (granite): never the stack."""
    model = tiny_model(name)
    runner = ModelRunner(model, num_pages=64, page_size=16, dtype=torch.float32)
    calls = counted_runs(runner, monkeypatch)
    oracle = Oracle(model)
    MixedScenario.build(oracle, VOCAB, decode_steps=2).run(runner)
    assert calls[0] == 0
