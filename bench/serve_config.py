"""The configuration of one serving-benchmark run (:mod:`bench.serve`): :class:`BenchConfig`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["WORKLOADS", "BenchConfig"]

WORKLOADS = ("generated-shared-prefix", "multi-turn", "few-shot", "sharegpt", "trace")


@dataclass
class BenchConfig:
    """Everything one benchmark run depends on (stored in the report as ``config``)."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "completions"
    workload: str = "generated-shared-prefix"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    prompt_format: str = "auto"
    vocab_min: int = 1000
    vocab_max: int = 40000
    # generated-shared-prefix (SGLang's flag names)
    gsp_num_groups: int = 4
    gsp_prompts_per_group: int = 8
    gsp_system_prompt_len: int = 512
    gsp_question_len: int = 32
    gsp_output_len: int = 16
    # multi-turn
    mt_clients: int = 4
    mt_rounds: int = 4
    mt_turn_len: int = 64
    mt_output_len: int = 16
    mt_system_prompt_len: int = 0
    # few-shot
    fs_shots: int = 5
    fs_requests: int = 16
    fs_example_len: int = 32
    fs_question_len: int = 32
    fs_output_len: int = 16
    # sharegpt / trace
    dataset_path: str | None = None
    trace_path: str | None = None
    num_prompts: int = 100
    sharegpt_output_len: int | None = None
    sharegpt_max_output_len: int = 256
    use_trace_arrivals: bool = False
    # client
    warmup_requests: int = 1
    flush_cache_after_warmup: bool = True
    timeout_s: float = 600.0
    disable_tqdm: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload={self.workload!r}: choose one of {', '.join(WORKLOADS)}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint={self.endpoint!r}: choose completions or chat")
        if self.prompt_format not in ("auto", "ids", "text"):
            raise ValueError(f"prompt_format={self.prompt_format!r}: choose auto, ids or text")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate}: must be > 0 (or inf)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency}: must be >= 1")
        if self.workload == "sharegpt" and not self.dataset_path:
            raise ValueError("workload sharegpt needs dataset_path (--dataset-path FILE.json)")
        if self.workload == "trace" and not self.trace_path:
            raise ValueError("workload trace needs trace_path (--trace-path FILE.jsonl)")
        if self.endpoint == "chat" and self.prompt_format == "ids":
            raise ValueError("the chat endpoint takes text: use prompt_format auto or text")

    @property
    def text_prompts(self) -> bool:
        """Whether generated workloads use text prompts (chat always does)."""
        if self.prompt_format == "auto":
            return self.endpoint == "chat"
        return self.prompt_format == "text"

    def to_json(self) -> dict[str, Any]:
        """The config as JSON-safe values (``inf`` becomes the string ``"inf"``)."""
        d = asdict(self)
        if math.isinf(self.request_rate):
            d["request_rate"] = "inf"
        return d
