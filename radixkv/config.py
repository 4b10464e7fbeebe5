"""Engine configuration: every knob a user sets, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, fields

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
EVICTION_POLICIES = ("lru", "lfu", "fifo")
ATTENTION_BACKENDS = ("torch", "triton")
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # radixkv.model.kv_quant.KV_CACHE_DTYPES
WRITE_POLICIES = ("write_back", "write_through")
KV_LAYOUTS = ("paged", "virtual")
#: weight quantizations besides None (radixkv/model/int8_linear.py; gguf:
#: radixkv/model/gguf_quantized.py)
QUANTIZATIONS = ("int8", "gguf")


def kv_layout_clash(kv_layout: str, kv_cache_dtype: str) -> str | None:
    """Why ``kv_layout`` cannot hold pages of ``kv_cache_dtype`` (None: it can). The one rule
    that :meth:`EngineConfig.validate` and :class:`radixkv.model.runner.RunnerSpec` apply."""
    if kv_cache_dtype != "auto" and kv_layout == "virtual":
        return (
            "quantized pages need kv_layout='paged' (the virtual layout stores the model's "
            "dtype); use kv_layout='paged', or kv_cache_dtype='auto'"
        )
    return None


#: URL schemes of ``remote_cache_url`` (radixkv/cache/remote_conn.py parses them).
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


@dataclass
class EngineConfig:
    """What an :class:`~radixkv.engine.engine.Engine` is built from.

    The device KV pool is sized by one of (give at most one): ``kv_cache_tokens`` (tokens,
    rounded down to whole pages); ``kv_cache_memory_gb`` (a budget); ``kv_cache_memory_fraction``
    (a share of memory: on CUDA, of the GPU's total memory less the weights, what vLLM's
    ``gpu_memory_utilization`` and SGLang's ``mem_fraction_static`` bound; on CPU, of the memory
    available, ``MemAvailable``, once the model is loaded). None of them: the default share
    (0.2 of available memory on CPU, 0.9 on CUDA; radixkv/engine/pool_sizing.py), capped at
    ``max_running_requests`` sequences of full context. The pool's pages are touched on first
    use, so an unfilled pool costs no resident memory.
    ``None`` for ``attention_backend`` / ``dtype`` / ``device`` picks the measured default of the
    machine (triton + bfloat16 on CUDA; torch on CPU, in bfloat16 where the CPU has native bf16,
    AVX512-BF16 or AMX, else float32).
    ``disk_write_policy``: ``write_back`` (pages reach the disk when they leave the device or the
    host, and when the engine closes) or ``write_through`` (queued for the disk when cached).
    ``remote_cache_url``: the shared remote tier, ``redis://HOST:PORT[/DB]`` (``rediss://``,
    ``unix://``) or a Redis Cluster, ``redis+cluster://HOST:PORT`` (``rediss+cluster://``).
    ``remote_write_policy``: ``write_through`` (the default: pages are queued for Redis when they
    are cached, so another replica finds a prompt as soon as this one has computed it) or
    ``write_back`` (sent when they leave the device: fewer writes, later sharing).
    ``kv_layout``: ``paged`` (page table, the default) or ``virtual`` (each running sequence's K/V
    contiguous in virtual memory over a shared memfd page pool; see radixkv/model/virtual_kv.py).
    ``kv_cache_dtype``: ``auto`` (pages in the model's dtype), ``int8`` or ``fp8_e4m3`` (one
    code per element and a bfloat16 scale per token and KV head: 1.94x the tokens of bfloat16
    at head dim 64; radixkv/model/kv_quant.py). Every tier stores the quantized rows as they are.
    ``kv_mac_key_file``: a file (mode 0600) holding the secret (at least 16 bytes) that keys the
    HMAC of every page on disk and in Redis; replicas sharing a Redis must share it. Unset: the
    environment variable ``RADIXKV_KV_MAC_KEY``, else the disk tier's ``kv_mac.key`` (created in
    ``disk_cache_dir`` on first start), else a random key of the process (see
    radixkv/cache/kv_mac.py).
    A step that decodes carries prefill tokens in proportion to the requests on each side: the
    step budget (``chunked_prefill_tokens``) times w / (w + d), for w requests waiting for their
    first token and d decodes, kept within [``mixed_prefill_min_tokens``,
    ``mixed_prefill_tokens``], or all the step can carry once every waiting request's
    uncached rest fits in it; a floor at or above the cap is a fixed budget (radixkv/engine/
    scheduler.py).
    ``chat_template``: a Jinja chat template (a file's path or the text itself, as vLLM's
    ``--chat-template``) replacing the model's own for chat requests. ``tokenizer``: a
    tokenizer (local directory or Hugging Face id in the local cache) replacing the model's.
    ``quantization``: None (weights in ``dtype``) or ``int8``: every decoder layer's projection
    (fused q/k/v, o, gate/up, down) weight-only int8 with one scale per output channel, the
    lm_head and embedding left in ``dtype`` (radixkv/model/int8_linear.py). A GGUF source is
    dequantized to ``dtype`` first and then re-quantized: allowed, but its error adds to the
    GGUF's own. ``gguf``: the model is a ``.gguf`` file whose block-quantized tensors (Q8_0,
    Q4_0, Q4_1, Q4_K, Q6_K, ...) stay quantized in memory and are multiplied block by block,
    activations in ``dtype`` (float32 or bfloat16; radixkv/model/gguf_quantized.py); any other
    model is refused at load.
    """

    model: str = "smollm2"
    page_size: int = 16
    kv_cache_tokens: int | None = None
    kv_cache_memory_gb: float | None = None
    kv_cache_memory_fraction: float | None = None
    enable_prefix_cache: bool = True
    schedule_policy: str = "lpm"
    eviction_policy: str = "lru"
    chunked_prefill_tokens: int = 2048
    mixed_prefill_tokens: int = 2048
    mixed_prefill_min_tokens: int = 512
    max_running_requests: int = 128
    max_model_len: int | None = None
    attention_backend: str | None = None
    dtype: str | None = None
    device: str | None = None
    seed: int = 0
    host_cache_tokens: int = 0
    host_write_policy: str = "write_back"
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 8 << 30
    disk_write_policy: str = "write_back"
    remote_cache_url: str | None = None
    remote_write_policy: str = "write_through"
    kv_mac_key_file: str | None = None
    kv_layout: str = "paged"
    kv_cache_dtype: str = "auto"
    chat_template: str | None = None
    tokenizer: str | None = None
    quantization: str | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad knob and what values it takes."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is invalid: {why}")

        if not isinstance(self.page_size, int) or not 1 <= self.page_size <= 1024:
            raise bad("page_size", "must be an integer in [1, 1024]")
        sizes = [
            k
            for k in ("kv_cache_tokens", "kv_cache_memory_gb", "kv_cache_memory_fraction")
            if getattr(self, k) is not None
        ]
        if len(sizes) > 1:
            raise bad(sizes[-1], f"give one of {' and '.join(sizes)}, not both")
        if self.kv_cache_memory_fraction is not None:
            if not 0 < self.kv_cache_memory_fraction <= 1:
                raise bad("kv_cache_memory_fraction", "must be in (0, 1]")
        elif self.kv_cache_memory_gb is not None:
            if not self.kv_cache_memory_gb > 0:
                raise bad("kv_cache_memory_gb", "must be > 0")
        elif self.kv_cache_tokens is not None and (
            not isinstance(self.kv_cache_tokens, int) or self.kv_cache_tokens < self.page_size
        ):
            raise bad("kv_cache_tokens", f"must be an integer >= page_size ({self.page_size})")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise bad("schedule_policy", f"choose one of {', '.join(SCHEDULE_POLICIES)}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise bad("eviction_policy", f"choose one of {', '.join(EVICTION_POLICIES)}")
        if not isinstance(self.chunked_prefill_tokens, int) or self.chunked_prefill_tokens < 1:
            raise bad("chunked_prefill_tokens", "must be an integer >= 1")
        if not isinstance(self.mixed_prefill_tokens, int) or self.mixed_prefill_tokens < 1:
            raise bad("mixed_prefill_tokens", "must be an integer >= 1")
        if not isinstance(self.mixed_prefill_min_tokens, int) or self.mixed_prefill_min_tokens < 1:
            raise bad("mixed_prefill_min_tokens", "must be an integer >= 1")
        if not isinstance(self.max_running_requests, int) or self.max_running_requests < 1:
            raise bad("max_running_requests", "must be an integer >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be >= 2")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", f"choose one of {', '.join(ATTENTION_BACKENDS)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise bad("dtype", f"choose one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad(
                "kv_cache_dtype",
                f"choose one of {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype)",
            )
        clash = kv_layout_clash(self.kv_layout, self.kv_cache_dtype)
        if clash is not None:
            raise bad("kv_cache_dtype", clash)
        if not isinstance(self.host_cache_tokens, int) or self.host_cache_tokens < 0:
            raise bad("host_cache_tokens", "must be an integer >= 0 (0 turns the host tier off)")
        if self.host_write_policy not in WRITE_POLICIES:
            raise bad("host_write_policy", f"choose one of {', '.join(WRITE_POLICIES)}")
        if self.disk_cache_bytes <= 0:
            raise bad("disk_cache_bytes", "must be > 0")
        if self.disk_write_policy not in WRITE_POLICIES:
            raise bad("disk_write_policy", f"choose one of {', '.join(WRITE_POLICIES)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise bad("kv_layout", f"choose one of {', '.join(KV_LAYOUTS)}")
        if self.remote_cache_url is not None and not str(self.remote_cache_url).startswith(
            REMOTE_SCHEMES
        ):
            raise bad(
                "remote_cache_url",
                "expected redis://HOST:PORT[/DB] (or rediss://, unix://, "
                "redis+cluster://HOST:PORT for a Redis Cluster)",
            )
        if self.remote_write_policy not in WRITE_POLICIES:
            raise bad("remote_write_policy", f"choose one of {', '.join(WRITE_POLICIES)}")
        if self.kv_mac_key_file is not None and not (
            isinstance(self.kv_mac_key_file, str) and self.kv_mac_key_file
        ):
            raise bad("kv_mac_key_file", "expected the path of a file holding the secret")
        if self.chat_template is not None and not (
            isinstance(self.chat_template, str) and self.chat_template
        ):
            raise bad("chat_template", "expected a template file's path or Jinja template text")
        if self.tokenizer is not None and not (isinstance(self.tokenizer, str) and self.tokenizer):
            raise bad("tokenizer", "expected a tokenizer directory or Hugging Face id")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad(
                "quantization",
                f"choose one of {', '.join(QUANTIZATIONS)} (unset: weights in the model's dtype)",
            )

    @classmethod
    def knob_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
