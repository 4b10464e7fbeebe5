"""The decoder layers as one native call (radixkv/model/decoder_stack.py, csrc/cpu_decoder.cpp):
the same native ops in the same order as the Python loop over ``DecoderLayer.forward_fused``, so
every logit row equals the loop's bit for bit (prefill, a mixed step with a shared prefix,
decodes), for float32 weights on radixkv's GEMM and GGUF blocks (float and int8 activations);
the call is counted, so a test cannot pass on the loop alone; GGUF blocks' decodes run as a team
of threads in one parallel region (counted too, int8 and float activations, at 1-3 threads, a
shared-prefix group among them); layers it does not compute (q/k norm, windows, biases) keep the loop and their
own oracle checks (tests/test_architectures.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from architectures import VOCAB, tiny_model
from kernel_paths import fp32_paths, use_path
from oracle import FP32, Oracle
from test_gguf_quantized import tiny_gguf
from test_model import MixedScenario

from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner


def counted_runs(
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    teams: list[tuple[int, bool]] | None = None,
) -> list[int]:
    """A counter of ``decoder_layers_f32`` calls through ``runner``'s native build; ``teams``
    gets (rows, whether the step has shared-prefix groups) of each call run as a team."""
    module = getattr(runner.backend, "module", None)
    if module is None:
        pytest.skip("no native build here: the stack needs one")
    op = module.decoder_layers_f32
    calls = [0]

    def counted(*args):
        calls[0] += 1
        *_, group_shared, team, _terms = args
        if team and teams is not None:
            teams.append((args[0].shape[0], bool(group_shared)))
        return op(*args)

    monkeypatch.setattr(module, "decoder_layers_f32", counted)
    return calls


def stack_and_loop(
    runner: ModelRunner,
    scenario: MixedScenario,
    monkeypatch,
    teams: list[tuple[int, bool]] | None = None,
) -> int:
    """Run ``scenario`` with the stack and with the loop; every row equal; the stack's calls."""
    calls = counted_runs(runner, monkeypatch, teams)
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


def gguf_runner(tmp_path, quant: str = "Q4_1") -> tuple[ModelRunner, MixedScenario]:
    path, oracle = tiny_gguf("llama3", quant, tmp_path)
    scenario = MixedScenario.build(oracle, VOCAB, decode_steps=4)
    loaded = load_model(path, hf_model=False, quantization="gguf")
    runner = ModelRunner(
        loaded, num_pages=64, page_size=16, dtype=torch.float32, quantization="gguf"
    )
    return runner, scenario


def team_decode_rows(runner: ModelRunner, activations: str) -> int:
    """The rows a team step takes with ``activations`` in this native build (int8: its int8
    GEMV's 8; int8x2: half that; float: its decode path's, 0 on the portable build)."""
    module = runner.backend.module
    if activations in ("int8", "int8x2"):
        return int(module.quant_dot_max_rows()) // (2 if activations == "int8x2" else 1)
    return int(module.quant_decode_rows())


@pytest.mark.parametrize("activations", ["float", "int8", "int8x2"])
def test_gguf_blocks_in_one_call_equal_the_loop_bit_for_bit(
    activations,
    tmp_path,
    weight_cache,
    monkeypatch,
):
    monkeypatch.setenv("RADIXKV_QUANT_ACTIVATIONS", activations)
    runner, scenario = gguf_runner(tmp_path)
    teams: list[tuple[int, bool]] = []
    assert stack_and_loop(runner, scenario, monkeypatch, teams) == 1 + scenario.decode_steps
    # the all-decode steps (3 rows) run as a team where the build has a decode path for them
    expected = scenario.decode_steps - 1 if team_decode_rows(runner, activations) >= 3 else 0
    assert len(teams) == expected


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("quant", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("activations", ["int8", "int8x2", "float"])
def test_a_team_of_threads_equals_the_loop_bit_for_bit(
    activations, quant, threads, tmp_path, weight_cache, monkeypatch
):
    """The decodes as a team (one parallel region) at 1, 2 and 3 threads, each block type, int8
    and float activations: every logit row equal to the loop's, a shared-prefix group (the
    attention's two phases) among the team's steps."""
    monkeypatch.setenv("RADIXKV_QUANT_ACTIVATIONS", activations)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner, scenario = gguf_runner(tmp_path, quant)
        if team_decode_rows(runner, activations) < 3:
            pytest.skip(f"this build has no {activations}-activation decode path")
        teams: list[tuple[int, bool]] = []
        stack_and_loop(runner, scenario, monkeypatch, teams)
    finally:
        torch.set_num_threads(before)
    assert len(teams) == scenario.decode_steps - 1
    assert all(rows == 3 for rows, _ in teams)
    assert any(groups for _, groups in teams)


def test_team_refuses_linears_it_does_not_run(monkeypatch):
    """Asked to run radixkv's float32 GEMM linears as a team, the native stack says why instead
    of computing something else."""
    model = tiny_model("llama3")
    runner = ModelRunner(model, num_pages=64, page_size=16, dtype=torch.float32)
    counted_runs(runner, monkeypatch)  # skips without a native build
    scenario = MixedScenario.build(Oracle(model), VOCAB, decode_steps=4)
    scenario.run(runner)  # gathers the stack
    cache = runner.model.stack_cache
    if cache.stack is None:
        pytest.skip("no float32 stack in this build (the portable one runs torch's GEMM)")
    assert cache.stack.team_rows == 0
    cache.stack = dataclasses.replace(cache.stack, team_rows=8)
    with pytest.raises(RuntimeError, match="not raw GGML rows"):
        scenario.run(runner)


def test_an_error_inside_the_team_is_raised_not_fatal(tmp_path, weight_cache, monkeypatch):
    """A check failing in the team's serial part (here RoPE's, on tables of the wrong shape) is
    raised as the native error once every thread has left the parallel region (an exception
    escaping an OpenMP region would end the process); x is left as it was and the model keeps
    serving."""
    monkeypatch.setenv("RADIXKV_QUANT_ACTIVATIONS", "int8")
    runner, scenario = gguf_runner(tmp_path)
    before = scenario.run(runner)
    stack = runner.model.stack_cache.stack
    assert stack is not None and stack.team_rows >= 1
    hq, _, d = stack.heads
    hidden = stack.norms[0].numel()
    x = torch.randn(1, hidden)
    kept = x.clone()
    bad = torch.zeros(1, d + 2)
    page_table = torch.arange(4, dtype=torch.int32).reshape(1, 4)
    with pytest.raises(RuntimeError, match="rope_: cos and sin"):
        runner.backend.module.decoder_layers_f32(
            x, None, stack.norms, stack.eps, stack.linears, stack.kinds, stack.int8_rows,
            stack.heads, bad, bad, runner.pool.k, runner.pool.v, torch.tensor([40]),
            page_table, [40], [1], [0], stack.sm_scale, [], [], [], True,
        )  # fmt: skip
    assert torch.equal(x, kept)
    after = scenario.run(runner)
    for name in before:
        assert torch.equal(before[name], after[name]), name


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


def test_the_stack_is_gathered_again_only_when_the_layers_change(monkeypatch):
    """Steps reuse the gathered stack (no walk over the layers' parts); setting an attribute of a
    layer, or putting another layer object in the model, gathers it again from what is there now."""
    model = tiny_model("llama3")
    runner = ModelRunner(model, num_pages=64, page_size=16, dtype=torch.float32)
    counted_runs(runner, monkeypatch)  # skips without a native build
    scenario = MixedScenario.build(Oracle(model), VOCAB, decode_steps=2)
    scenario.run(runner)
    cache = runner.model.stack_cache
    first = cache.stack
    if first is None:
        pytest.skip("no float32 stack in this build")
    scenario.run(runner)
    assert cache.stack is first
    layers = runner.model.layers
    layers[1].o_proj = layers[1].o_proj  # any attribute set: the layer's parts are made afresh
    scenario.run(runner)
    assert cache.stack is not first and cache.stack is not None
    second = cache.stack
    old = layers[0]
    twin = type(old).__new__(type(old))
    twin.__dict__.update(old.__dict__)  # another object with the same parts
    layers[0] = twin
    scenario.run(runner)
    assert cache.stack is not second and cache.key is not None and cache.key.layers[0] is twin
