"""Every architecture through the server: a tiny random-weight model of each, saved as a Hugging
Face directory (safetensors, a byte-level tokenizer), served by ``Engine(model=DIR)`` behind the
real app; greedy tokens of ``/v1/completions`` (and ``/generate``'s ids) equal transformers'
``generate`` of the float64 model."""

from __future__ import annotations

import httpx
import pytest
import torch
from architectures import CONFIGS, tiny_model
from fake_engine import ServerThread

from bench.tiny_model import byte_level_hf_tokenizer
from radixkv.server.app import create_app

PROMPT = "radixkv serves every architecture; the window is shorter than this prompt."
NEW = 10


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_completions_greedy_tokens_equal_transformers_generate(name, tmp_path):
    from radixkv import Engine

    model = tiny_model(name)
    tok = byte_level_hf_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    ids = tok.encode(PROMPT, add_special_tokens=False)
    oracle = model.to(torch.float64)
    oracle.generation_config.eos_token_id = None
    oracle.generation_config.pad_token_id = 0
    with torch.inference_mode():
        out = oracle.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    want = out[0, len(ids) :].tolist()

    engine = Engine(model=str(tmp_path), dtype="float32", page_size=16, kv_cache_tokens=2048)
    with ServerThread(create_app(engine)) as server:
        body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert r.json()["usage"]["completion_tokens"] == NEW
        assert choice["text"] == tok.decode(want, skip_special_tokens=True), name
        native = {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        }
        r = httpx.post(f"{server.base_url}/generate", json=native, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want, name
