"""Explicit assembly: every collaborator of an :class:`~radixkv.engine.engine.Engine`, built and
wired here, in one place, by constructor arguments.

Order (each part receives what it needs, nothing reaches back): the model runner (weights, KV
pool, attention backend) -> the block allocator and the radix tree over its pages -> the virtual
KV layout (when the runner has one) -> the offload tiers (host, disk, remote: they hook the
tree's eviction and insert events, keyed by :func:`engine_fingerprint`) -> the KV manager (page
ownership between tree and sequences; given the tiers and the layout's release hook) -> the
scheduler. The engine then adds what is its own (the lifecycle owner, beam search, counters).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.radix_tree import RadixTree
from radixkv.config import EngineConfig
from radixkv.engine.chat_template import load_chat_template
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.pool_sizing import size_kv_pool
from radixkv.engine.sampler import Sampler
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.tokenizer_lock import LockedTokenizer
from radixkv.engine.virtual_layout import VirtualLayout
from radixkv.model.kv_quant import is_quantized, is_rotated, kv_storage_dtype

if TYPE_CHECKING:
    from radixkv.cache.tiers import TieredCache
    from radixkv.model.kv_pool import KVPool
    from radixkv.model.runner import ModelRunner

logger = logging.getLogger(__name__)
__all__ = ["EngineParts", "assemble", "build_tiers", "engine_fingerprint"]


@dataclass
class EngineParts:
    """The engine's collaborators and the facts it reads from them."""

    model_name: str
    #: the server encodes in worker threads while the engine's thread decodes: one lock
    tokenizer: LockedTokenizer | None
    runner: ModelRunner
    sampler: Sampler
    page_size: int
    allocator: BlockAllocator
    tree: RadixTree
    virtual_layout: VirtualLayout | None
    tiers: TieredCache | None
    kv: KVManager
    scheduler: Scheduler
    max_model_len: int
    kv_capacity_tokens: int
    eos_token_ids: set[int]
    vocab_size: int
    chat_template: str | None = None  # the --chat-template text (None: the model's own)


def assemble(cfg: EngineConfig, model: Any) -> EngineParts:
    """Load ``model`` (a name, or a loaded model) and build every part ``cfg`` asks for."""
    template = load_chat_template(cfg.chat_template) if cfg.chat_template else None  # fail fast
    from radixkv.model.loader import load_model, load_tokenizer
    from radixkv.model.runner import ModelRunner, RunnerSpec, default_dtype

    # a name is streamed into radixkv's layout (no transformers model is built)
    loaded = (
        load_model(model, hf_model=False, quantization=cfg.quantization)
        if isinstance(model, str)
        else model
    )
    if cfg.tokenizer:  # a tokenizer of its own (the loaded model is shared: not mutated)
        loaded = dataclasses.replace(loaded, tokenizer=load_tokenizer(cfg.tokenizer))
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else default_dtype(device)
    kv_dtype = kv_storage_dtype(cfg.kv_cache_dtype, dtype)  # the pool's element type, once
    context = getattr(loaded.config, "max_position_embeddings", None) or 2048
    max_model_len = min(cfg.max_model_len or context, context)
    pool = size_kv_pool(cfg, device, loaded, dtype, kv_dtype, max_model_len)
    spec = RunnerSpec(  # the runner takes it as resolved here: no knob read twice
        num_pages=pool.tokens // cfg.page_size,
        page_size=cfg.page_size,
        dtype=dtype,
        kv_dtype=kv_dtype,
        kv_cache_dtype=cfg.kv_cache_dtype,
        device=device,
        attention_backend=cfg.attention_backend,
        kv_layout=cfg.kv_layout,
        max_model_len=max_model_len,
        quantization=cfg.quantization,
    )
    runner = ModelRunner(loaded, spec=spec)
    num_pages = runner.num_pages
    logger.info(
        "KV pool: %d tokens (%d pages of %d, %.2f GiB of %s; %s), touched on first use",
        num_pages * cfg.page_size,
        num_pages,
        cfg.page_size,
        runner.pool.total_bytes / 2**30,
        str(dtype).removeprefix("torch.")
        if cfg.kv_cache_dtype == "auto"
        else f"{cfg.kv_cache_dtype} with per-token scales",
        pool.how,
    )
    allocator = BlockAllocator(num_pages, cfg.page_size)
    tree = RadixTree(allocator, cfg.page_size, eviction_policy=cfg.eviction_policy)
    virtual = getattr(runner, "virtual", None)
    layout = VirtualLayout(virtual) if virtual is not None else None
    tiers = build_tiers(cfg, loaded.name, runner, tree, allocator, loaded)
    kv = KVManager(
        allocator,
        tree,
        cfg.enable_prefix_cache,
        runner.pool.copy_pages,
        tiers=tiers,
        on_release=layout.release if layout is not None else None,
    )
    tokenizer = loaded.tokenizer
    eos_token_ids = _eos_token_ids(loaded)
    return EngineParts(
        model_name=loaded.name,
        tokenizer=LockedTokenizer(tokenizer) if tokenizer is not None else None,
        runner=runner,
        sampler=Sampler(eos_token_ids),
        page_size=cfg.page_size,
        allocator=allocator,
        tree=tree,
        virtual_layout=layout,
        tiers=tiers,
        kv=kv,
        scheduler=Scheduler(cfg, kv),
        max_model_len=max_model_len,
        kv_capacity_tokens=num_pages * cfg.page_size,
        eos_token_ids=eos_token_ids,
        vocab_size=runner.vocab_size,
        chat_template=template,
    )


def build_tiers(
    cfg: EngineConfig,
    model_name: str,
    runner: ModelRunner,
    tree: RadixTree,
    allocator: BlockAllocator,
    loaded: Any = None,
) -> TieredCache | None:
    """The host / disk / remote tiers ``cfg`` configures under ``tree`` (None without any):
    they hook the tree's eviction and insert events and share the runner's KV pool layout.
    Tiers that outlive the process (disk, remote) are keyed by a digest of every weight byte of
    ``loaded`` (:func:`radixkv.model.weights_digest.weights_digest`, cached per model file)."""
    if not (cfg.host_cache_tokens or cfg.disk_cache_dir or cfg.remote_cache_url):
        return None
    from radixkv.cache.disk_store import DiskStore
    from radixkv.cache.host_pool import HostPool
    from radixkv.cache.kv_mac import configured_mac_key
    from radixkv.cache.tiers import TieredCache

    kv_pool = getattr(runner, "kv_pool", None) or runner.pool
    P = cfg.page_size
    host = (
        HostPool.like(kv_pool, max(1, cfg.host_cache_tokens // P))
        if cfg.host_cache_tokens
        else None
    )
    digest = None
    if loaded is not None and (cfg.disk_cache_dir or cfg.remote_cache_url):
        from radixkv.model.loader import cache_dir
        from radixkv.model.weights_digest import weights_digest

        digest = weights_digest(loaded, cache_dir() / "weight-digests")
    fp = engine_fingerprint(
        model_name,
        kv_pool,
        P,
        getattr(runner, "model", None),
        getattr(runner, "hf_config", None),
        compute_dtype=getattr(runner, "dtype", None),
        weights_digest=digest,
        quantization=_weight_quantization(cfg.quantization),
    )
    mac_key = configured_mac_key(cfg.kv_mac_key_file)  # None: the stores' own default
    disk = None
    if cfg.disk_cache_dir:
        page_bytes = kv_pool.bytes_per_page
        max_pending = int(min(4096, max(16, (256 << 20) // max(1, page_bytes))))
        disk = DiskStore(
            cfg.disk_cache_dir, cfg.disk_cache_bytes, fp, max_pending=max_pending, mac_key=mac_key
        )
    remote = None
    if cfg.remote_cache_url:
        from radixkv.cache.remote_store import RemoteStore

        # no secret given: the disk tier's key file (replicas sharing a disk dir share it)
        key = disk.mac_key if disk is not None else mac_key
        remote = RemoteStore(cfg.remote_cache_url, fp, mac_key=key)
    return TieredCache(
        tree,
        allocator,
        kv_pool,
        host,
        disk,
        cfg.host_write_policy,
        fp,
        remote=remote,
        disk_write_policy=cfg.disk_write_policy,
        remote_write_policy=cfg.remote_write_policy,
    )


def _weight_quantization(quantization: str | None) -> str | None:
    """The fingerprint's name of the weights' arithmetic: ``quantization``, and for ``gguf`` with
    int8 activations (``RADIXKV_QUANT_ACTIVATIONS=int8`` or ``int8x2``)
    ``gguf+int8-activations`` / ``gguf+int8x2-activations``, whose K/V differ from the
    float-activation engine's and each other's (radixkv/model/quant_linear.py)."""
    if quantization == "gguf":
        from radixkv.model.quant_linear import activation_mode

        mode = activation_mode()
        if mode != "float":
            return f"gguf+{mode}-activations"
    return quantization


def engine_fingerprint(
    model_name: str,
    kv_pool: KVPool,
    page_size: int,
    model: Any = None,
    config: Any = None,
    compute_dtype: torch.dtype | None = None,
    weights_digest: bytes | None = None,
    quantization: str | None = None,
) -> bytes:
    """sha256 over the model name, its config, its weights (``weights_digest``: every byte;
    without one, a sample of the first tensors), the KV dtype (for
    quantized pages also their format and the model dtype they were computed in), the weights'
    ``quantization`` (an int8 model's KV is not the checkpoint's: absent when None, so existing
    fingerprints stand), the page size and the KV layout: files written under one fingerprint
    are never read under another."""
    h = hashlib.sha256()
    parts = {
        "model": model_name,
        "dtype": str(kv_pool.dtype),
        "page_size": page_size,
        "layers": kv_pool.num_layers,
        "kv_heads": kv_pool.num_kv_heads,
        "head_dim": kv_pool.head_dim,
    }
    if is_quantized(kv_pool.dtype):  # rows of codes + a bf16 scale, from which model dtype
        rotation = "hadamard" if is_rotated(kv_pool.dtype) else "unrotated"
        parts["kv_format"] = f"{rotation}/{kv_pool.dtype}+bf16-scale-per-token-head/{compute_dtype}"
    if quantization is not None:
        parts["weight_quantization"] = quantization
    h.update(json.dumps(parts, sort_keys=True).encode())
    if config is not None:
        try:
            text = config.to_json_string() if hasattr(config, "to_json_string") else repr(config)
        except Exception:
            text = repr(config)
        h.update(text.encode())
    if weights_digest is not None:  # every weight byte (radixkv.model.weights_digest)
        h.update(weights_digest)
    elif model is not None:
        try:  # a sample of the weights: tells two random models with one config apart
            for i, p in enumerate(q for q in model.parameters() if not q.is_meta):
                if i >= 4:
                    break
                flat = p.detach().reshape(-1)[:4096].to("cpu", torch.float32)
                h.update(flat.numpy().tobytes())
        except Exception:
            pass
    return h.digest()


def _generation_config(loaded: Any) -> Any:
    """The model's generation config: a LoadedModel's (transformers model or streamed), or a
    bare transformers model's."""
    if hasattr(loaded, "generation_config"):
        return loaded.generation_config
    return getattr(getattr(loaded, "hf_model", None), "generation_config", None)


def _eos_token_ids(loaded: Any) -> set[int]:
    """End-of-sequence ids from the config, the generation config and the tokenizer."""
    ids: set[int] = set()
    sources = [
        getattr(loaded.config, "eos_token_id", None),
        getattr(_generation_config(loaded), "eos_token_id", None),
        getattr(loaded.tokenizer, "eos_token_id", None) if loaded.tokenizer is not None else None,
    ]
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids
