"""GGUF files of every architecture both radixkv and transformers' GGUF reader serve: each tiny
random model of tests/architectures.py written as llama.cpp writes it (tests/gguf_files.py), F32
and Q8_0, loaded by ``Engine(model=FILE.gguf)`` and judged against transformers' float64
forward of the weights the file holds (tests/test_model.py's MixedScenario, the FP32 contract);
its config reads as the original's, feature by feature. An architecture transformers cannot
read from GGUF is refused at load, by its GGUF name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from architectures import VOCAB, tiny_model
from gguf_files import GGUF_ARCH, stored_model, write_gguf
from oracle import FP32, Oracle
from test_model import MixedScenario

from radixkv.model.arch import UnsupportedModelError, read_config
from radixkv.model.gguf_config import gguf_config, llama3_rope

#: the tiny models whose GGUF architecture transformers' reader maps (Mistral is written as Llama)
EXACT = ["gemma3", "llama3", "mistral", "phi3", "qwen2", "qwen3"]
#: the ones it does not: radixkv serves their safetensors checkpoints, and refuses their GGUFs
REFUSED = ["granite", "olmo2", "smollm3"]
#: what a GGUF cannot state: Gemma 3's softmax scale is llama.cpp's 1/sqrt(head dim) (no key
#: holds query_pre_attn_scalar); every other feature of the tiny models is written and read back
GGUF_OVERRIDES = {"gemma3": {"query_pre_attn_scalar": 256}}
PROMPT = "GGUF: <|user|>héllo\n"


def _model(name: str):
    return tiny_model(name, **GGUF_OVERRIDES.get(name, {}))


@pytest.fixture
def weight_cache(tmp_path, monkeypatch):
    """A weight cache of the test's own; the native kernels are loaded first, since they are
    built (once per process) under the cache dir too."""
    from radixkv.model import native

    native.load()
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RADIXKV_NO_WEIGHT_CACHE", raising=False)
    return tmp_path / "cache"


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("name", EXACT)
def test_gguf_matches_the_float64_oracle(name, qtype, tmp_path, weight_cache):
    from radixkv import Engine

    model = _model(name)
    path = tmp_path / f"tiny-{name}.{qtype}.gguf"
    write_gguf(model, path, qtype)
    oracle = Oracle(model if qtype == "F32" else stored_model(model, qtype))
    scenario = MixedScenario.build(oracle, VOCAB, decode_steps=4)
    engine = Engine(model=str(path), dtype="float32", page_size=16, kv_cache_tokens=2048)
    try:
        assert scenario.judge(scenario.run(engine.runner), oracle, FP32, f"gguf-{qtype}") > 0
        want = dataclasses.asdict(read_config(model.config))
        got = dataclasses.asdict(engine.runner.config)
        assert got.pop("rms_norm_eps") == pytest.approx(want.pop("rms_norm_eps"), rel=1e-6)
        for field in ("eos_token_id", "notes", "model_type"):  # Mistral's GGUF is a Llama's
            got.pop(field), want.pop(field)
        assert got == want
        ids = [b + 3 for b in PROMPT.encode()]  # the byte-level test vocabulary
        assert engine.tokenizer.encode(PROMPT, add_special_tokens=False) == ids
        assert engine.tokenizer.decode(ids) == PROMPT
    finally:
        engine.close()


@pytest.mark.parametrize("name", REFUSED)
def test_a_gguf_transformers_cannot_read_is_refused_by_its_architecture(
    name, tmp_path, capsys, weight_cache
):
    from radixkv import Engine
    from radixkv.cli import main

    path = tmp_path / f"tiny-{name}.gguf"
    write_gguf(tiny_model(name), path)
    arch = GGUF_ARCH[tiny_model(name).config.model_type]
    with pytest.raises(UnsupportedModelError, match=f"GGUF architecture '{arch}'.*transformers"):
        Engine(model=str(path), dtype="float32", page_size=16, kv_cache_tokens=256)
    assert main(["info", str(path)]) == 2
    assert f"GGUF architecture '{arch}'" in capsys.readouterr().err


def test_a_gguf_architecture_radixkv_does_not_serve_is_refused_by_name(tmp_path):
    """transformers reads Falcon GGUFs; radixkv has no Falcon module, and says so by the file's
    architecture before dequantising anything."""
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"GGUF architecture 'falcon'.*it serves"):
        gguf_config(path)


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_a_mixture_of_experts_gguf_is_refused_by_name(arch, tmp_path):
    """Mixtral's GGUF is a ``llama`` file with ``llama.expert_count``, Qwen3-MoE's a
    ``qwen3moe`` one: both are refused naming the key, before transformers reads anything
    (radixkv serves those models from safetensors only)."""
    import gguf

    path = tmp_path / f"{arch}-moe.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=rf"mixture of experts \('{arch}.expert_count'"):
        gguf_config(path)


def test_a_llama_gguf_named_mistral_reads_as_llama_with_its_window(tmp_path):
    """transformers reads a ``llama`` file whose name is "mistral" as a Mistral (default window
    4096) it then cannot load; radixkv reads it as the Llama it is, with the file's window."""
    path = tmp_path / "m.gguf"
    write_gguf(_model("mistral"), path, name="mistral")
    config = gguf_config(path)
    assert config.model_type == "llama" and config.sliding_window == 20
    assert read_config(config).layer_windows == [20, 20, 20]


def test_a_gguf_tensor_nothing_reads_is_refused_by_name(tmp_path):
    """Phi-3's longrope factors (which transformers' reader drops) refuse the file, not serve it
    without them."""
    path = tmp_path / "tiny-phi3.gguf"
    model = _model("phi3")
    write_gguf(model, path, extra={"rope_factors_long.weight": np.ones(30, np.float32)})
    with pytest.raises(UnsupportedModelError, match="rope_factors_long.weight"):
        gguf_config(path)


@pytest.mark.parametrize(
    "rope",
    [  # Llama 3.1 8B and 3.2 1B, as their config.json state them
        dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original=8192),
        dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original=8192),
    ],
)
def test_llama3_rope_is_recovered_from_rope_freqs(rope):
    """llama.cpp stores Llama 3's RoPE scaling only as the divisors of each frequency: the
    parameters are solved back from them, exactly."""
    from gguf_files import llama3_rope_factors

    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": rope["factor"],
        "low_freq_factor": rope["low_freq_factor"],
        "high_freq_factor": rope["high_freq_factor"],
        "original_max_position_embeddings": rope["original"],
    }
    factors = llama3_rope_factors(params, 128)
    assert llama3_rope(factors, 500000.0, 128) == params
    assert llama3_rope(np.ones(64, np.float32), 500000.0, 128) is None
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        llama3_rope(np.linspace(1, 3, 64)[::-1].copy(), 500000.0, 128)


def test_the_weight_cache_is_remade_after_an_older_format(tmp_path, monkeypatch, weight_cache):
    """A GGUF's weight cache is keyed by the cache format, so the caches made before the config
    was completed (Llama 3 GGUFs lost their RoPE scaling there) are not read again."""
    from radixkv.model import loader

    path = tmp_path / "tiny.gguf"
    write_gguf(_model("llama3"), path)
    now = loader._gguf_cache_target(path)
    monkeypatch.setattr(loader, "_CACHE_FORMAT_VERSION", 1)
    assert loader._gguf_cache_target(path) != now
    loaded = loader.load_model(str(path), hf_model=False)
    assert loaded.config.rope_parameters["rope_type"] == "llama3"
    assert torch.equal(
        loaded.weights["model.layers.0.self_attn.q_proj.weight"],
        _model("llama3").state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )


def test_info_reads_a_gguf_without_dequantising_it(tmp_path, capsys, weight_cache):
    """``radixkv info FILE.gguf`` reads the metadata (Llama 3's RoPE recovered from
    ``rope_freqs``) and makes no weight cache."""
    import json

    from radixkv.cli import main

    path = tmp_path / "tiny-llama3.gguf"
    write_gguf(_model("llama3"), path)
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "llama" and info["head dim"] == 32
    assert info["rope"] == "theta 50000, llama3 scaling"
    assert not weight_cache.exists()


@pytest.mark.parametrize("cold", [True, False], ids=["cold-cache", "warm-cache"])
def test_a_gguf_loaded_as_a_transformers_model_serves_cold_or_warm(tmp_path, weight_cache, cold):
    """``load_model(FILE.gguf)`` (the transformers-model path) then ``Engine``: the model the
    first load dequantises serves as its cached copy does (its config said GGUF-quantized and
    the engine refused it on a cold cache)."""
    from radixkv import Engine
    from radixkv.model import loader

    path = tmp_path / "tiny.gguf"
    write_gguf(_model("llama3"), path)
    if not cold:
        loader.load_model(str(path))  # makes the cache
    loaded = loader.load_model(str(path), dtype=torch.float32)
    assert getattr(loaded.config, "quantization_config", None) is None
    engine = Engine(model=loaded, dtype="float32", page_size=16, kv_cache_tokens=256)
    try:
        (out,) = engine.generate([[5, 6, 7, 8]], None)
        assert out.finish_reason is not None
        engine.check_integrity()
    finally:
        engine.close()
