"""Shared fixtures. Triton runs under its interpreter when there is no GPU."""

from __future__ import annotations

import os

# Must be set before triton is imported anywhere.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FORCE_GPU"):
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        _has_cuda = False
    if not _has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")


# No test downloads: a Hugging Face id missing from the cache is an error, not a Hub request
# (radixkv.model.loader.downloads_allowed; the servers tests start inherit it).
os.environ.setdefault("RADIXKV_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama():
    """A tiny random Llama (transformers, float32, fixed seed) and its config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    # Larger-than-init weights so attention patterns are not nearly uniform.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(3.0)
    return model


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct loaded once per session through radixkv's loader (float32)."""
    import torch

    from radixkv.model.loader import load_model

    return load_model("smollm2", dtype=torch.float32)


class ByteTokenizer:
    """A stand-in tokenizer for the tiny random model: token id = byte value (vocab 256)."""

    eos_token_id = 2
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True, **_: object) -> str:
        data = bytes(i for i in ids if not (skip_special_tokens and i == self.eos_token_id))
        return data.decode("utf-8", errors="replace")


@pytest.fixture(scope="session")
def tiny_model(tiny_llama):
    """The tiny random Llama as a LoadedModel (what ``Engine(model=...)`` accepts)."""
    from radixkv.model.loader import LoadedModel

    return LoadedModel(tiny_llama, ByteTokenizer(), tiny_llama.config, "tiny-llama")


@pytest.fixture(scope="session")
def real_oracle(real_model):
    """The float64 oracle of SmolLM2 (see tests/oracle.py)."""
    from oracle import Oracle

    return Oracle(real_model.hf_model)


@pytest.fixture(scope="session")
def tiny_oracle(tiny_llama):
    """The float64 oracle of the tiny random Llama."""
    from oracle import Oracle

    return Oracle(tiny_llama)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the precision contract's worst ratio per kernel path (tests/oracle.py)."""
    try:
        from oracle import RATIOS
    except ImportError:  # pragma: no cover
        return
    if not RATIOS:
        return
    from radixkv.model import native

    terminalreporter.section("precision contract: worst radixkv error / transformers error")
    terminalreporter.write_line(f"host ISA: {native.host_isa()}")
    for path, ratio in sorted(RATIOS.items()):
        terminalreporter.write_line(f"{path:32s} {ratio:8.3f}")


@pytest.fixture
def weight_cache(tmp_path, monkeypatch):
    """A weight cache of the test's own (RADIXKV_CACHE_DIR), the native build loaded first."""
    from radixkv.model import native

    native.load()  # built under the session's cache dir, before the test's own
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
