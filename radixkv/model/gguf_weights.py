"""A GGUF file's tensors read as the file stores them, for ``--quantization gguf``: the raw
block-quantized rows (never dequantized whole), the ggml types' block shapes, and the
architectures that quantization serves. :mod:`radixkv.model.gguf_quantized` builds the model
from them; :mod:`radixkv.model.loader` hands them to the runner (this module imports neither the
model nor the native kernels, so the loader's imports stay acyclic).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from radixkv.model.arch.common import UnsupportedModelError
from radixkv.model.gguf_config import GgufHeader

__all__ = [
    "FLOAT_TYPES",
    "GgufWeights",
    "QUANTIZED_ARCHITECTURES",
    "block_shape",
    "check_quantized_architecture",
    "dequantize_rows",
    "type_name",
]


def block_shape(ggml_type: int) -> tuple[int, int]:
    """``(weights per block, bytes per block)`` of a ggml type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]


def type_name(ggml_type: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(ggml_type).name


def dequantize_rows(raw: torch.Tensor, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (uint8 ``[n, row_bytes]``) dequantized by ``gguf.quants.dequantize``: ``[n, K]``
    float32 values (exact, as transformers reads them) in ``dtype``."""
    import gguf

    values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)


#: GGUF architectures ``--quantization gguf`` serves -> the model types they read as
QUANTIZED_ARCHITECTURES = {"llama": ("llama", "mistral"), "qwen2": ("qwen2",)}
#: ggml types that are plain floats (F32, F16, BF16), not blocks
FLOAT_TYPES = frozenset({0, 1, 30})


def check_quantized_architecture(arch: str, model_type: str) -> None:
    """Refuse, naming it, a GGUF architecture ``--quantization gguf`` does not build."""
    if model_type not in QUANTIZED_ARCHITECTURES.get(arch, ()):
        served = ", ".join(sorted(QUANTIZED_ARCHITECTURES))
        raise UnsupportedModelError(
            f"--quantization gguf: GGUF architecture {arch!r} ({model_type}) is not served in its "
            f"own quantization (it serves GGUF architectures {served}); leave --quantization "
            f"unset to serve it dequantized to --dtype"
        )


class GgufWeights:
    """The tensors of GGUF file ``path``, read on demand. ``files()`` and
    :meth:`num_parameters` are what the engine asks of any checkpoint (the weights digest, the
    pool's sizing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.header = GgufHeader(self.path)

    def files(self) -> list[Path]:
        return [self.path]

    def num_parameters(self) -> int:
        return sum(int(np.prod(shape)) for shape, _, _ in self.header.tensors.values())

    def __contains__(self, name: str) -> bool:
        return name in self.header.tensors

    def ggml_type(self, name: str) -> int:
        return self.header.tensors[name][1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.header.tensors[name][0]

    def data_bytes(self) -> int:
        """Bytes of the file's tensor data (every tensor, padding included)."""
        return max(0, self.path.stat().st_size - self.header.data_start)

    def row_shape(self, name: str) -> tuple[int, int]:
        """``(rows, row_bytes)`` of tensor ``name``'s bytes (rows: every dimension but the
        last)."""
        shape, kind, _ = self.header.tensors[name]
        per_block, size = block_shape(kind)
        k = shape[-1]
        if k % per_block:
            raise UnsupportedModelError(f"GGUF tensor {name!r}: rows are not whole blocks")
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return rows, k // per_block * size

    def raw(self, name: str) -> torch.Tensor:
        """Tensor ``name``'s bytes as uint8 ``[rows, row_bytes]`` (:meth:`row_shape`), in memory
        of its own."""
        rows, row_bytes = self.row_shape(name)
        data = np.fromfile(
            self.path,
            dtype=np.uint8,
            count=rows * row_bytes,
            offset=self.header.data_start + self.header.tensors[name][2],
        )
        if data.size != rows * row_bytes:
            raise UnsupportedModelError(f"GGUF tensor {name!r} runs past the end of {self.path}")
        return torch.from_numpy(data.reshape(rows, row_bytes))

    def raw_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Tensor ``name``'s bytes read straight into ``out`` (contiguous CPU uint8 of
        :meth:`row_shape`), which is returned."""
        rows, row_bytes = self.row_shape(name)
        if (
            out.dtype != torch.uint8
            or out.device.type != "cpu"
            or tuple(out.shape) != (rows, row_bytes)
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"GGUF tensor {name!r}: reads into contiguous CPU uint8 [{rows}, {row_bytes}], "
                f"not {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        with open(self.path, "rb") as f:
            f.seek(self.header.data_start + self.header.tensors[name][2])
            got = f.readinto(memoryview(out.numpy()).cast("B"))
        if got != rows * row_bytes:
            raise UnsupportedModelError(f"GGUF tensor {name!r} runs past the end of {self.path}")
        return out

    def dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` dequantized (or, a float type, as stored) in ``dtype``, its shape."""
        return dequantize_rows(self.raw(name), self.ggml_type(name), dtype).reshape(
            self.shape(name)
        )
