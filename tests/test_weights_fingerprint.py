"""The KV tiers' fingerprint covers every weight byte: two checkpoints of one name and config
that differ only deep in their last layer (two fine-tunes of one base) must never share disk or
remote pages; the same bytes in another folder must. (It sampled 4 tensors x 4,096 values: the
attack below shared pages.)"""

from __future__ import annotations

import torch
from architectures import tiny_model

from bench.tiny_model import byte_level_hf_tokenizer
from radixkv.model.weights_digest import file_digest


def _save(model, where):
    model.save_pretrained(where)
    byte_level_hf_tokenizer().save_pretrained(where)


def test_a_fine_tune_that_differs_deep_in_the_weights_gets_its_own_pages(tmp_path):
    from radixkv import Engine

    base = tiny_model("llama3")
    _save(base, tmp_path / "a" / "model")
    _save(base, tmp_path / "copy" / "model")
    tuned = tiny_model("llama3")
    with torch.no_grad():
        tuned.model.layers[-1].mlp.down_proj.weight[-1, -1] += 0.5
    _save(tuned, tmp_path / "b" / "model")

    def fingerprint(folder: str) -> bytes:
        engine = Engine(
            model=str(tmp_path / folder / "model"),
            dtype="float32",
            page_size=16,
            kv_cache_tokens=256,
            disk_cache_dir=str(tmp_path / "disk" / folder),
        )
        try:
            return engine.tiers.fingerprint
        finally:
            engine.close()

    a, b, copy = fingerprint("a"), fingerprint("b"), fingerprint("copy")
    assert a != b, "a fine-tune with other weights must not read the base's pages"
    assert a == copy, "the same weights elsewhere share their pages"


def test_file_digests_are_cached_by_path_size_and_mtime(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x" * 1000)
    cache = tmp_path / "digests"
    first = file_digest(f, cache)
    assert len(list(cache.iterdir())) == 1
    assert file_digest(f, cache) == first
    f.write_bytes(b"y" * 1001)  # a new size (and mtime): digested again
    assert file_digest(f, cache) != first and len(list(cache.iterdir())) == 2
