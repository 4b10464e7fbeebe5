"""A digest of every byte of a model's weights: what tells two checkpoints apart in the KV tiers'
fingerprint (two fine-tunes of one base under one name share a config and, often, the tensors a
sample would read, yet their KV pages differ).

A streamed checkpoint (:class:`~radixkv.model.checkpoint.SafetensorsCheckpoint`) is digested file
by file, and each file's digest is cached under radixkv's cache directory, keyed by the file's
resolved path, size and modification time: the read costs once per model file, not once per
start. A model held in memory (a transformers model, the tests' tiny ones) is digested tensor by
tensor, once per model object in a process.
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path
from typing import Any

import torch

__all__ = ["file_digest", "weights_digest"]

_CHUNK = 16 << 20
_IN_MEMORY: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()


def file_digest(path: Path, cache: Path | None = None) -> bytes:
    """sha256 of the file's bytes, cached in ``cache`` (a folder) by path, size and mtime."""
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    entry = cache / key if cache is not None else None
    if entry is not None and entry.is_file():
        text = entry.read_text().strip()
        if len(text) == 64:
            return bytes.fromhex(text)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.digest()
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_suffix(".tmp")
            tmp.write_text(digest.hex())
            tmp.replace(entry)
        except OSError:
            pass  # the cache is an optimisation
    return digest


def _tensor_digest(state: dict[str, torch.Tensor]) -> bytes:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def weights_digest(loaded: Any, cache: Path | None = None) -> bytes | None:
    """The digest of ``loaded``'s weights (a LoadedModel: streamed or with its transformers
    model, or a bare transformers model); None when it holds neither."""
    weights = getattr(loaded, "weights", None)
    if weights is not None and hasattr(weights, "files"):
        h = hashlib.sha256()
        for path in weights.files():
            h.update(path.name.encode())
            h.update(file_digest(path, cache))
        return h.digest()
    model = getattr(loaded, "hf_model", loaded)
    if not isinstance(model, torch.nn.Module):
        return None
    digest = _IN_MEMORY.get(model)
    if digest is None:
        digest = _IN_MEMORY[model] = _tensor_digest(model.state_dict())
    return digest
