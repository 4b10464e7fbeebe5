"""ModelRunner: our model + its paged KV pool + an attention backend, one call per step.

Typical use (the engine's view)::

    runner = ModelRunner(load_model("smollm2"), kv_cache_tokens=65536, page_size=16)
    # the engine's: ModelRunner(loaded, spec=RunnerSpec(...)), resolved once by its assembly
    batch = runner.build_batch([
        RequestSlice(token_ids=prompt_ids, prefix_len=0, pages=[7, 3, 9]),     # prefill
        RequestSlice(token_ids=[last_tok], prefix_len=130, pages=[1, 4, ...]),  # decode
    ])
    logits = runner.forward(batch)   # [2, vocab] float32
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.config import KV_LAYOUTS, QUANTIZATIONS, kv_layout_clash
from radixkv.model.attention.base import AttentionBackend, ForwardBatch
from radixkv.model.attention.factory import make_attention_backend
from radixkv.model.host_cpu import has_native_bf16
from radixkv.model.kv_pool import KVPool
from radixkv.model.kv_quant import is_quantized, is_rotated, kv_storage_dtype
from radixkv.model.llama import LlamaModel, model_config

__all__ = [
    "ModelRunner",
    "RequestSlice",
    "ForwardBatch",
    "build_forward_batch",
    "default_dtype",
    "warn_if_emulated_bf16",
]

log = logging.getLogger(__name__)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 where it is fast (CUDA; CPUs with AVX512-BF16/AMX-BF16), else float32.

    On a 2-core AVX512-BF16 host bf16 matmuls run ~4.5x faster than fp32, so bf16 is the CPU
    default whenever the CPU computes bf16 natively (:func:`radixkv.model.host_cpu.has_native_bf16`);
    on an AVX2-only host (no native bf16) torch emulates bf16 and fp32 is the fast dtype.
    ``RADIXKV_DTYPE`` (float32/bfloat16/float16) overrides the CPU default.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16
    env = os.environ.get("RADIXKV_DTYPE")
    if env:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[env]
    return torch.bfloat16 if has_native_bf16() else torch.float32


def warn_if_emulated_bf16(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Log one warning line when bf16 is asked for on a CPU without native bf16; True if so."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or has_native_bf16():
        return False
    log.warning(
        "dtype bfloat16 on a CPU without native bf16 (no avx512_bf16/amx_bf16): it is emulated "
        "and slow here (2-3x slower than float32); use dtype float32 on this host"
    )
    return True


@dataclass
class RequestSlice:
    """One request's part of a step.

    Attributes:
        token_ids: the new tokens to run (the whole uncached prompt part, or 1 for a decode).
        prefix_len: tokens of this request already in the KV pool.
        pages: the request's page ids covering at least ``prefix_len + len(token_ids)`` tokens.
    """

    token_ids: Sequence[int]
    prefix_len: int
    pages: Sequence[int]


def build_forward_batch(
    requests: Sequence[RequestSlice],
    page_size: int,
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Build a :class:`ForwardBatch` (all tensors) from plain per-request lists."""
    if not requests:
        raise ValueError("build_forward_batch needs at least one request")
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    extend_lens: list[int] = []
    prefix_lens: list[int] = []
    max_pages = 1
    for r in requests:
        n = len(r.token_ids)
        if n == 0:
            raise ValueError("every request needs at least one new token")
        total = r.prefix_len + n
        need = -(-total // page_size)
        if len(r.pages) < need:
            raise ValueError(
                f"a request with {total} tokens needs {need} pages of {page_size}, got {len(r.pages)}"
            )
        pages = r.pages
        ids.extend(int(t) for t in r.token_ids)
        for pos in range(r.prefix_len, total):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        extend_lens.append(n)
        prefix_lens.append(int(r.prefix_len))
        max_pages = max(max_pages, need)
    table: list[int] = []  # row-major [B, max_pages], padded with page 0
    for r in requests:
        need = -(-(r.prefix_len + len(r.token_ids)) // page_size)
        table.extend(int(p) for p in r.pages[:need])
        table.extend([0] * (max_pages - need))
    dev = torch.device(device)
    # ids, positions and slots as one tensor's three views: one allocation and copy, not three
    t = len(ids)
    flat = torch.tensor(ids + positions + slots, dtype=torch.long, device=dev)
    return ForwardBatch(
        input_ids=flat[:t],
        positions=flat[t : 2 * t],
        extend_lens=extend_lens,
        prefix_lens=prefix_lens,
        page_table=torch.tensor(table, dtype=torch.int32, device=dev).view(len(requests), -1),
        out_slots=flat[2 * t :],
        page_size=page_size,
    )


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a :class:`ModelRunner` is built with besides its weights, resolved: the engine's
    assembly makes it from an :class:`~radixkv.config.EngineConfig` (the pool sized, the context
    clamped to the model's, the storage dtype derived once: :func:`radixkv.engine.assembly.
    assemble`); direct users (tests, benches) from knobs with :meth:`of`.

    ``num_pages`` pages of ``page_size`` tokens in the KV pool; ``dtype``: weights and
    activations; ``kv_cache_dtype``: ``"auto"`` (pages in ``dtype``), ``"int8"`` or
    ``"fp8_e4m3"`` (codes with a scale per token and head, :mod:`radixkv.model.kv_quant`), stored
    as ``kv_dtype``; ``attention_backend``: ``"torch"``, ``"triton"`` or None (triton on CUDA,
    else torch); ``kv_layout``: ``"paged"`` or ``"virtual"`` (memfd pool, contiguous
    per-sequence ranges, :mod:`radixkv.model.virtual_kv`; falls back to paged with a warning
    where the OS page does not divide a KV page, or off Linux/CPU); ``max_model_len``: the
    longest sequence (sizes the virtual ranges; None: the model's context); ``num_threads``:
    intra-op CPU threads (None leaves torch's setting); ``quantization``: None (weights in
    ``dtype``), ``"int8"`` (the decoder layers' projections weight-only int8 with per-channel
    scales, :mod:`radixkv.model.int8_linear`) or ``"gguf"`` (a GGUF's quantized tensors kept
    as the file has them, :mod:`radixkv.model.gguf_quantized`: CPU, float32 or bfloat16).
    """

    num_pages: int
    page_size: int
    dtype: torch.dtype
    kv_dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    attention_backend: str | None = None
    kv_layout: str = "paged"
    max_model_len: int | None = None
    num_threads: int | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization={self.quantization!r} is invalid: choose one of "
                f"{', '.join(QUANTIZATIONS)} (or None: weights in the model's dtype)"
            )
        if self.quantization == "gguf" and (
            torch.device(self.device).type != "cpu"
            or self.dtype not in (torch.float32, torch.bfloat16)
        ):
            raise ValueError(
                f"quantization='gguf' runs on the CPU in float32 or bfloat16 (got "
                f"{torch.device(self.device).type}, {self.dtype}): leave quantization unset to serve the GGUF "
                "dequantized"
            )
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"unknown kv_layout {self.kv_layout!r}: use 'paged' or 'virtual'")
        clash = kv_layout_clash(self.kv_layout, self.kv_cache_dtype)
        if clash is not None:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is invalid: {clash}")

    @classmethod
    def of(
        cls,
        *,
        num_pages: int | None = None,
        kv_cache_tokens: int | None = None,
        page_size: int = 16,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
        **rest: Any,
    ) -> RunnerSpec:
        """A spec from knobs: the pool holds ``num_pages`` pages, or ``kv_cache_tokens``
        rounded up to pages (one of them is needed); ``dtype`` None is the device's
        :func:`default_dtype`; ``rest``: the fields as they are."""
        if num_pages is None:
            if kv_cache_tokens is None:
                raise TypeError("give num_pages or kv_cache_tokens (the KV pool's size)")
            num_pages = max(1, -(-kv_cache_tokens // page_size))
        device = torch.device(device)
        dtype = dtype if dtype is not None else default_dtype(device)
        kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        return cls(num_pages, page_size, dtype, kv_dtype, kv_cache_dtype, device, **rest)


class ModelRunner:
    """Owns the model, its KV pool and the attention backend.

    Args:
        model: a :class:`~radixkv.model.loader.LoadedModel` (or anything with ``hf_model`` /
            ``config``), or a transformers config when ``state_dict`` is given.
        state_dict: weights in transformers' naming (only with a config as ``model``).
        spec: the pool, dtypes, device and layout (:class:`RunnerSpec`), or
        knobs: :meth:`RunnerSpec.of`'s (``num_pages`` or ``kv_cache_tokens``, ``page_size``,
            ``dtype``, ``device``, ``kv_cache_dtype``, ``attention_backend``, ``kv_layout``,
            ``max_model_len``, ``num_threads``) for a spec made here.
    """

    def __init__(
        self,
        model: Any,
        state_dict: dict[str, torch.Tensor] | None = None,
        *,
        spec: RunnerSpec | None = None,
        **knobs: Any,
    ) -> None:
        if spec is None:
            spec = RunnerSpec.of(**knobs)
        elif knobs:
            raise TypeError(f"give a spec or knobs, not both (got {sorted(knobs)} too)")
        self.spec = spec
        self.device = spec.device
        self.dtype = spec.dtype
        self.kv_cache_dtype = spec.kv_cache_dtype
        self.kv_dtype = spec.kv_dtype
        kv_layout, max_model_len, page_size = spec.kv_layout, spec.max_model_len, spec.page_size
        warn_if_emulated_bf16(self.dtype, self.device)
        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        if state_dict is None and getattr(model, "weights", None) is not None:
            hf_config, state_dict = model.config, model.weights  # streamed (loader.py)
        elif state_dict is None:
            hf_model = getattr(model, "hf_model", model)
            hf_config = getattr(model, "config", None) or hf_model.config
            state_dict = hf_model.state_dict()
        else:
            hf_config = model
        self.hf_config = hf_config
        self.config = model_config(hf_config)
        if self.config.has_windows and (kv_layout == "virtual" or is_quantized(self.kv_dtype)):
            raise ValueError(
                f"{self.config.model_type} has sliding-window layers, which radixkv attends over "
                f"paged pages in the model's dtype: use kv_layout='paged' and "
                f"kv_cache_dtype='auto' (got {kv_layout!r}, {spec.kv_cache_dtype!r})"
            )
        if spec.quantization == "gguf":
            from radixkv.model.gguf_quantized import build_quantized_model
            from radixkv.model.gguf_weights import GgufWeights

            if not isinstance(state_dict, GgufWeights):
                raise ValueError(
                    "quantization='gguf' serves a .gguf file's own quantized tensors: load the "
                    "model by its .gguf path (or 'smollm2') with quantization='gguf' "
                    "(radixkv.model.loader.load_model), or leave quantization unset"
                )
            self.model = build_quantized_model(self.config, state_dict, self.dtype)
        else:
            self.model = LlamaModel.from_hf_state_dict(
                self.config, state_dict, self.dtype, self.device, spec.quantization
            )
        self.page_size = page_size
        pool_args = (
            self.config.num_layers,
            spec.num_pages,
            page_size,
            self.config.num_kv_heads,
            self.config.head_dim,
            self.kv_dtype,
            self.device,
        )
        self.virtual: Any = None
        self.kv_layout = kv_layout
        if kv_layout == "virtual":
            from radixkv.model.virtual_kv import virtual_layout_problem

            problem = virtual_layout_problem(*pool_args[2:])
            if problem is not None:
                log.warning("%s; falling back to kv_layout='paged'", problem)
                self.kv_layout = "paged"
        if self.kv_layout == "virtual":
            from radixkv.model.attention.virtual_backend import VirtualAttentionBackend
            from radixkv.model.virtual_kv import VirtualKV, VirtualKVPool

            self.pool = VirtualKVPool(*pool_args)
            context = getattr(hf_config, "max_position_embeddings", None) or 2048
            self.virtual = VirtualKV(self.pool, (max_model_len or context) + page_size)
            self.backend: AttentionBackend = VirtualAttentionBackend(self.virtual)
        else:
            self.pool = KVPool(*pool_args)
            self.backend = make_attention_backend(
                spec.attention_backend, self.device, self.dtype, self.config.head_dim, self.kv_dtype
            )
            # quantized pages hold rotated rows (kv_quant's docstring)
            if is_rotated(self.kv_dtype):
                from radixkv.model.attention.rotated_kv import RotatedKVBackend

                self.backend = RotatedKVBackend(self.backend, self.config.head_dim)
        self.attention_backend = self.backend.name

    @property
    def num_pages(self) -> int:
        """Pages in the KV pool."""
        return self.pool.num_pages

    @property
    def vocab_size(self) -> int:
        """Rows of the logits."""
        return self.config.vocab_size

    def build_batch(self, requests: Sequence[RequestSlice]) -> ForwardBatch:
        """:func:`build_forward_batch` with this runner's page size and device."""
        return build_forward_batch(requests, self.page_size, self.device)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, return_all_logits: bool = False, float_logits: bool = True
    ) -> torch.Tensor:
        """Run one step; float32 logits ``[B, vocab]`` (``[T, vocab]`` with return_all_logits),
        or in the model's dtype with ``float_logits=False`` (see ``LlamaModel.forward``)."""
        if batch.page_size == 0:
            batch.page_size = self.page_size
        elif batch.page_size != self.page_size:
            raise ValueError(f"batch page_size {batch.page_size} != pool's {self.page_size}")
        return self.model(
            batch, self.pool.k, self.pool.v, self.backend, return_all_logits, float_logits
        )
