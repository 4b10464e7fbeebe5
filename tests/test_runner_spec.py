"""The runner's resolved spec (issue 60 item 4): the engine's assembly reads the config once and
hands :class:`~radixkv.model.runner.ModelRunner` a :class:`RunnerSpec` (the pool's storage dtype
derived once, the context clamped to the model's); direct users build one from knobs."""

from __future__ import annotations

import pytest
import torch

from radixkv import Engine
from radixkv.config import EngineConfig
from radixkv.model.runner import ModelRunner, RunnerSpec


def test_the_engine_hands_the_runner_the_values_it_resolved(tiny_model) -> None:
    # asks for more context than the model has (512 positions): clamped, for the runner too
    engine = Engine(
        tiny_model, page_size=16, kv_cache_tokens=256, dtype="float32", max_model_len=10**6,
        kv_cache_dtype="int8",
    )  # fmt: skip
    spec = engine.runner.spec
    assert engine.max_model_len == spec.max_model_len == 512
    assert (spec.kv_cache_dtype, spec.kv_dtype, spec.dtype) == ("int8", torch.int8, torch.float32)
    assert spec.num_pages * spec.page_size == engine.kv_capacity_tokens == 256
    assert engine.runner.pool.k[0].dtype == spec.kv_dtype


def test_knobs_make_a_spec(tiny_llama) -> None:
    runner = ModelRunner(tiny_llama, kv_cache_tokens=40, page_size=16, dtype=torch.float32)
    assert runner.spec == RunnerSpec(3, 16, torch.float32, torch.float32)  # 40 tokens: 3 pages
    assert runner.num_pages == 3
    with pytest.raises(TypeError, match="num_pages or kv_cache_tokens"):
        RunnerSpec.of(page_size=16)
    with pytest.raises(TypeError, match="not both"):
        ModelRunner(tiny_llama, spec=runner.spec, num_pages=2)


def test_one_rule_refuses_quantized_pages_in_the_virtual_layout() -> None:
    with pytest.raises(ValueError, match="quantized pages need kv_layout='paged'") as spec_err:
        RunnerSpec.of(num_pages=4, kv_cache_dtype="int8", kv_layout="virtual")
    with pytest.raises(ValueError, match="quantized pages need kv_layout='paged'") as cfg_err:
        EngineConfig(kv_cache_dtype="int8", kv_layout="virtual").validate()
    assert str(spec_err.value) == str(cfg_err.value)
    with pytest.raises(ValueError, match="unknown kv_layout 'contiguous'"):
        RunnerSpec.of(num_pages=4, kv_layout="contiguous")
