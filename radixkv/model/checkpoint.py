"""A safetensors checkpoint read tensor by tensor: what the loader streams into radixkv's layout.

:class:`SafetensorsCheckpoint` is a read-only mapping from a Hugging Face directory's tensor names
to tensors; each access opens its shard (``safe_open``, memory-mapped) and reads that one tensor,
so an architecture module (:mod:`radixkv.model.arch`) converts and fuses the weights one by one
and the checkpoint's own copy of each is dropped as soon as radixkv's is made. Nothing builds the
transformers model: at the peak the process holds radixkv's weights plus the few tensors of one
fused projection in flight, not two whole models.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

__all__ = ["SafetensorsCheckpoint", "has_safetensors"]


def has_safetensors(directory: Path) -> bool:
    """Whether ``directory`` holds a safetensors checkpoint (one file or an indexed set)."""
    return any(Path(directory).glob("*.safetensors"))


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """Tensor name -> tensor of the ``*.safetensors`` files of ``directory`` (read on access).

    Invariant: every name maps to exactly one shard (``model.safetensors.index.json``'s
    ``weight_map`` where there is one, else each file's own header); a name in two shards is
    refused at construction."""

    #: each access reads a new tensor nobody else holds (memory-mapped copy-on-write), so the
    #: model's builder may repack it in its own memory
    fresh_tensors = True

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        self._where: dict[str, Path] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: self.directory / f for name, f in weight_map.items()}
        else:
            from safetensors import safe_open

            for path in sorted(self.directory.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (a handle, not a dict)
                        if name in self._where:
                            raise ValueError(
                                f"{name!r} is in both {self._where[name].name} and "
                                f"{path.name} of {self.directory}"
                            )
                        self._where[name] = path
        if not self._where:
            raise FileNotFoundError(f"no safetensors weights in {self.directory}")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def files(self) -> list[Path]:
        """The shard files, sorted."""
        return sorted(set(self._where.values()))

    def num_parameters(self) -> int:
        """Elements of every tensor, read from the headers (no tensor is loaded)."""
        from safetensors import safe_open

        total = 0
        for path in sorted(set(self._where.values())):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118
                    n = 1
                    for d in handle.get_slice(name).get_shape():
                        n *= d
                    total += n
        return total
