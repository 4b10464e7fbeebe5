"""``vllm serve`` flags that ``radixkv serve`` takes so that a vLLM launch command runs unchanged
(issue 58), beyond the ones radixkv has under the same name (``--host``, ``--port``,
``--api-key``, ``--served-model-name``, ``--dtype``, ``--max-model-len``, ``--seed``,
``--block-size``, ``--gpu-memory-utilization``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--kv-cache-dtype``, ``--tokenizer``, ``--chat-template``,
``--enable-prefix-caching`` / ``--no-enable-prefix-caching``, ``--device``).

Each flag has one of three dispositions, said at start (:func:`apply_vllm_flags`):

* **done**: it does here what it does in vLLM (``--enable-log-requests``,
  ``--uvicorn-log-level``, ``--disable-log-stats``, ``--ssl-keyfile`` / ``--ssl-certfile``, ``--root-path``, ``--disable-uvicorn-access-log``,
  ``--download-dir``, ``--hf-token``, ``--scheduling-policy fcfs``, ``--reasoning-parser qwen3``
  or ``deepseek_r1``, ``--enable-auto-tool-choice --tool-call-parser hermes|llama3_json|mistral``); an INFO line
  names it.
* **no-op**: what it asks for is what radixkv always does, or means nothing on this engine
  (``--enable-chunked-prefill``: always on; ``--trust-remote-code``: radixkv runs no model
  code; ``--tensor-parallel-size 1``; ``--enforce-eager``; ...); an INFO line says why.
* **refused**: it asks for what radixkv cannot do (``--tensor-parallel-size 2``, LoRA,
  speculative decoding, another tool-call parser, CORS): ``radixkv serve`` exits 2
  naming the flag and the reason, before loading anything.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["VLLM_FLAGS", "VllmFlag", "add_vllm_flags", "apply_vllm_flags"]


class VllmFlag(NamedTuple):
    """One vLLM flag: its spellings, whether it takes a value, and ``judge(value, args)``: the
    log line (done or no-op), or raises ``ValueError`` with the reason it is refused."""

    flags: tuple[str, ...]
    takes_value: bool
    judge: Callable[[Any, argparse.Namespace], str]


def _noop(why: str) -> Callable[[Any, argparse.Namespace], str]:
    return lambda value, args: f"no-op here: {why}"


def _refuse(why: str) -> Callable[[Any, argparse.Namespace], str]:
    def judge(value: Any, args: argparse.Namespace) -> str:
        raise ValueError(why)

    return judge


def _one_only(what: str, instead: str) -> Callable[[Any, argparse.Namespace], str]:
    """Accepted as 1 (the one device or process radixkv runs); more is refused."""

    def judge(value: Any, args: argparse.Namespace) -> str:
        if int(value) == 1:
            return f"no-op here: radixkv runs one {what}"
        raise ValueError(f"radixkv runs one {what}, not {value}: {instead}")

    return judge


def _only(allowed: tuple[str, ...], why: str) -> Callable[[Any, argparse.Namespace], str]:
    """Accepted for the values in ``allowed`` (what radixkv does anyway), refused otherwise."""

    def judge(value: Any, args: argparse.Namespace) -> str:
        if str(value).lower() in allowed:
            return f"no-op here: {why}"
        raise ValueError(f"{value!r} is not supported ({', '.join(allowed)} only): {why}")

    return judge


def _set(name: str, value: Any, line: str) -> Callable[[Any, argparse.Namespace], str]:
    def judge(given: Any, args: argparse.Namespace) -> str:
        setattr(args, name, given if value is None else value)
        return line

    return judge


def _env(name: str, line: str) -> Callable[[Any, argparse.Namespace], str]:
    def judge(value: Any, args: argparse.Namespace) -> str:
        os.environ[name] = str(value)
        return line

    return judge


def _scheduling(value: Any, args: argparse.Namespace) -> str:
    if value == "fcfs":
        args.schedule_policy = "fcfs"
        return "radixkv's --schedule-policy fcfs (its default, lpm, serves cache hits first)"
    raise ValueError(f"{value!r}: radixkv has no request priorities (fcfs, or its own lpm)")


def _reasoning(value: Any, args: argparse.Namespace) -> str:
    from .reasoning import REASONING_PARSERS

    if value not in REASONING_PARSERS:
        raise ValueError(f"radixkv's reasoning parsers are {', '.join(REASONING_PARSERS)}")
    args.reasoning_parser = value
    return "chat answers carry the <think> block as reasoning_content, whole and streamed"


_PARALLEL = "run several replicas with `radixkv cluster --replicas N` instead"
_NO_LORA = "radixkv serves one model's weights, without LoRA adapters"
_AUTO = 'tool_choice "auto" parses the model\'s tool calls (with --tool-call-parser)'


def _tool_parser(value: Any, args: argparse.Namespace) -> str:
    from .tool_calls import TOOL_CALL_PARSERS

    if value not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"radixkv's tool-call parsers are {', '.join(TOOL_CALL_PARSERS)}; tool_choice "
            '"required" or a named function constrain the output to the tools\' schemas '
            "without one"
        )
    if getattr(args, "vllm_enable_auto_tool_choice", None) is None:
        raise ValueError("it goes with --enable-auto-tool-choice, as in vLLM")
    args.tool_call_parser = value
    return 'tool_choice "auto": the tool calls the model writes become tool_calls'


VLLM_FLAGS: list[VllmFlag] = [
    # logging and the HTTP front
    VllmFlag(
        ("--disable-log-requests",),
        False,
        _noop("the request log line is off unless --enable-log-requests"),
    ),
    VllmFlag(
        ("--enable-log-requests",),
        False,
        _set(
            "log_requests",
            True,
            "one log line per finished request (token counts and latencies, never its text)",
        ),
    ),
    VllmFlag(
        ("--disable-log-stats",),
        False,
        _set("log_stats_interval", 0.0, "no periodic stats line (--log-stats-interval 0)"),
    ),
    VllmFlag(
        ("--uvicorn-log-level",), True, _set("uvicorn_log_level", None, "uvicorn's log level")
    ),
    VllmFlag(
        ("--disable-uvicorn-access-log",), False, _set("access_log", False, "no uvicorn access log")
    ),
    VllmFlag(
        ("--root-path",), True, _set("root_path", None, "uvicorn's root_path (a proxy's prefix)")
    ),
    VllmFlag(("--ssl-keyfile",), True, _set("ssl_keyfile", None, "TLS: uvicorn's key file")),
    VllmFlag(("--ssl-certfile",), True, _set("ssl_certfile", None, "TLS: uvicorn's certificate")),
    VllmFlag(("--ssl-ca-certs",), True, _set("ssl_ca_certs", None, "TLS: uvicorn's CA file")),
    VllmFlag(
        ("--disable-fastapi-docs",),
        False,
        _set("fastapi_docs", False, "no /docs, /redoc, /openapi.json"),
    ),
    VllmFlag(
        ("--disable-frontend-multiprocessing",),
        False,
        _noop("radixkv's HTTP front and engine share one process"),
    ),
    VllmFlag(("--api-server-count",), True, _one_only("API server process", _PARALLEL)),
    VllmFlag(
        ("--enable-server-load-tracking",),
        False,
        _noop("/metrics has the running and waiting counts"),
    ),
    VllmFlag(
        ("--allowed-origins", "--allowed-methods", "--allowed-headers"),
        True,
        _refuse(
            "radixkv serves no CORS: a keyless server refuses cross-site "
            "state-changing requests (Origin), a keyed one needs the key; put a proxy "
            "in front to serve browsers of another origin"
        ),
    ),
    VllmFlag(
        ("--allow-credentials",), False, _refuse("radixkv serves no CORS (see --allowed-origins)")
    ),
    VllmFlag(("--middleware",), True, _refuse("radixkv loads no middleware by import path")),
    VllmFlag(
        ("--enable-prompt-tokens-details",),
        False,
        _noop("usage always has prompt_tokens_details.cached_tokens"),
    ),
    VllmFlag(
        ("--enable-force-include-usage",),
        False,
        _refuse("streams carry usage when stream_options.include_usage is true"),
    ),
    VllmFlag(("--return-tokens-as-token-ids",), False, _refuse("logprob tokens are text here")),
    VllmFlag(("--response-role",), True, _only(("assistant",), "chat answers are the assistant's")),
    VllmFlag(
        ("--chat-template-content-format",),
        True,
        _only(("auto", "string"), "message content is flattened to text for the template"),
    ),
    VllmFlag(("--max-log-len",), True, _noop("radixkv logs no prompt")),
    VllmFlag(("--otlp-traces-endpoint",), True, _refuse("radixkv exports no OpenTelemetry traces")),
    # tools and reasoning (issue 58)
    VllmFlag(("--enable-auto-tool-choice",), False, _set("auto_tool_choice", True, _AUTO)),
    VllmFlag(("--tool-call-parser",), True, _tool_parser),
    VllmFlag(("--tool-parser-plugin",), True, _refuse("radixkv loads no parser plugins")),
    VllmFlag(("--reasoning-parser",), True, _reasoning),
    VllmFlag(
        ("--enable-reasoning",),
        False,
        _noop("reasoning is separated when --reasoning-parser names a parser"),
    ),
    VllmFlag(
        ("--guided-decoding-backend",),
        True,
        _only(("auto", "xgrammar"), "structured outputs are xgrammar's"),
    ),
    # the model and its files
    VllmFlag(
        ("--trust-remote-code",),
        False,
        _noop(
            "radixkv runs no model's own Python code; it serves the architectures it "
            "implements and refuses others by name"
        ),
    ),
    VllmFlag(
        ("--download-dir",),
        True,
        _env("HF_HUB_CACHE", "Hugging Face ids are looked up and downloaded there"),
    ),
    VllmFlag(("--hf-token",), True, _env("HF_TOKEN", "the Hub token for downloads")),
    VllmFlag(
        ("--revision", "--code-revision", "--tokenizer-revision"),
        True,
        _refuse(
            "radixkv loads a Hub id's cached snapshot: download the revision first "
            "(hf download ID --revision REV) and pass its path"
        ),
    ),
    VllmFlag(
        ("--load-format",),
        True,
        _only(("auto", "safetensors", "gguf"), "the format is read from the files"),
    ),
    VllmFlag(
        ("--tokenizer-mode",), True, _only(("auto", "hf"), "the model's Hugging Face tokenizer")
    ),
    VllmFlag(
        ("--quantization", "-q"),
        True,
        _refuse(
            "radixkv loads weights in --dtype (a GGUF's quantized weights are "
            "dequantized); see --kv-cache-dtype for the KV cache"
        ),
    ),
    VllmFlag(
        ("--hf-overrides", "--rope-scaling", "--rope-theta"),
        True,
        _refuse("the model's config.json is served as it is; edit a copy of it instead"),
    ),
    VllmFlag(
        ("--disable-sliding-window",), False, _refuse("a model's window is part of the model")
    ),
    VllmFlag(
        ("--generation-config",),
        True,
        _only(("auto", "vllm"), "sampling defaults are OpenAI's; a request's fields apply"),
    ),
    VllmFlag(
        ("--override-generation-config",),
        True,
        _refuse("sampling defaults are OpenAI's; set them in the requests"),
    ),
    VllmFlag(("--task", "--runner"), True, _only(("auto", "generate"), "radixkv generates text")),
    VllmFlag(("--limit-mm-per-prompt",), True, _refuse("radixkv serves text-only models")),
    VllmFlag(("--max-logprobs",), True, _noop("radixkv returns at most 20 logprobs a position")),
    VllmFlag(("--max-parallel-loading-workers",), True, _noop("weights stream shard by shard")),
    VllmFlag(("--model-impl",), True, _only(("auto",), "radixkv's own model code")),
    # parallelism and devices
    VllmFlag(("--tensor-parallel-size", "-tp"), True, _one_only("device", _PARALLEL)),
    VllmFlag(("--pipeline-parallel-size", "-pp"), True, _one_only("device", _PARALLEL)),
    VllmFlag(("--data-parallel-size", "-dp"), True, _one_only("replica", _PARALLEL)),
    VllmFlag(("--distributed-executor-backend",), True, _noop("one process, no executor")),
    VllmFlag(("--disable-custom-all-reduce",), False, _noop("one device, no all-reduce")),
    VllmFlag(
        ("--enable-expert-parallel",),
        False,
        _refuse("radixkv serves no mixture-of-experts model yet"),
    ),
    # the scheduler and the KV cache
    VllmFlag(("--enable-chunked-prefill",), False, _noop("chunked prefill is always on")),
    VllmFlag(
        ("--no-enable-chunked-prefill",),
        False,
        _noop("chunked prefill stays on; --chunked-prefill-tokens sets the chunk"),
    ),
    VllmFlag(
        ("--max-num-partial-prefills", "--max-long-partial-prefills"),
        True,
        _noop("radixkv's scheduler mixes prefills by its own token budget"),
    ),
    VllmFlag(("--scheduling-policy",), True, _scheduling),
    VllmFlag(("--num-scheduler-steps",), True, _noop("one scheduler step per forward")),
    VllmFlag(("--preemption-mode",), True, _only(("recompute",), "preempted requests recompute")),
    VllmFlag(
        ("--swap-space",),
        True,
        _noop("evicted KV pages go to radixkv's host tier: --host-cache-tokens sizes it"),
    ),
    VllmFlag(("--cpu-offload-gb",), True, _refuse("radixkv keeps all weights on the device")),
    VllmFlag(
        ("--calculate-kv-scales",),
        False,
        _noop("int8/fp8 KV scales are per page, computed as written"),
    ),
    VllmFlag(
        ("--kv-transfer-config", "--kv-events-config"),
        True,
        _refuse("radixkv shares KV across replicas through its Redis tier (--remote-cache)"),
    ),
    VllmFlag(("--enforce-eager",), False, _noop("radixkv captures no CUDA graphs")),
    VllmFlag(("--max-seq-len-to-capture", "--cuda-graph-sizes"), True, _noop("no CUDA graphs")),
    VllmFlag(("--compilation-config", "-O"), True, _noop("no torch.compile of the model")),
    VllmFlag(("--enable-sleep-mode",), False, _refuse("radixkv has no sleep mode")),
    # adapters and speculation
    VllmFlag(("--enable-lora",), False, _refuse(_NO_LORA)),
    VllmFlag(
        ("--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras"),
        True,
        _refuse(_NO_LORA),
    ),
    VllmFlag(
        ("--speculative-config", "--num-speculative-tokens", "--speculative-model"),
        True,
        _refuse("radixkv has no speculative decoding"),
    ),
]


def _dest(flag: VllmFlag) -> str:
    return "vllm_" + flag.flags[0].lstrip("-").replace("-", "_")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Register every flag of :data:`VLLM_FLAGS` (each stores its value, None when absent)."""
    group = parser.add_argument_group("vLLM flags (each says at start what it does here)")
    for flag in VLLM_FLAGS:
        if flag.takes_value:
            group.add_argument(*flag.flags, dest=_dest(flag), default=None, metavar="VALUE")
        else:
            group.add_argument(*flag.flags, dest=_dest(flag), action="store_const", const=True)


def apply_vllm_flags(args: argparse.Namespace) -> list[str]:
    """Judge the vLLM flags given in ``args``: set what they map to (``args`` attributes such
    as ``uvicorn_log_level``, ``root_path``, ``ssl_keyfile``, ``access_log``, environment
    variables) and return one line per flag saying what it does here. Raises ``ValueError``
    naming the first refused flag and why."""
    lines = []
    for flag in VLLM_FLAGS:
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        shown = flag.flags[0] if value is True else f"{flag.flags[0]} {value}"
        try:
            what = flag.judge(value, args)
        except ValueError as exc:
            raise ValueError(f"{shown}: {exc}") from None
        lines.append(f"{shown}: {what}")
    return lines
