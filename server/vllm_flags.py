"""``vllm serve`` flags that ``radixkv serve`` takes so that a vLLM launch command runs unchanged
(issue 58), beyond the ones radixkv has under the same name (``--host``, ``--port``,
``--api-key``, ``--served-model-name``, ``--dtype``, ``--max-model-len``, ``--seed``,
``--block-size``, ``--gpu-memory-utilization``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--kv-cache-dtype``, ``--quantization`` (``int8`` only: vLLM's
other methods are refused by argparse's choices), ``--tokenizer``, ``--chat-template``,
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
from typing import Any

from .peer_flags import (
    PeerFlag,
    add_peer_flags,
    apply_peer_flags,
    env,
    noop,
    one_only,
    only,
    refuse,
    set_arg,
)

__all__ = ["VLLM_FLAGS", "VllmFlag", "add_vllm_flags", "apply_vllm_flags"]

#: one vLLM flag (:class:`~.peer_flags.PeerFlag`)
VllmFlag = PeerFlag


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


def _no_offload(value: Any, args: argparse.Namespace) -> str:
    if float(value) == 0:
        return "no-op here: radixkv keeps all weights on the device"
    raise ValueError("radixkv keeps all weights on the device")


#: SGLang's names of radixkv's tool-call parsers (SGLang's flag turns "auto" on by itself)
SGLANG_TOOL_PARSERS = {"qwen25": "hermes", "qwen": "hermes", "llama3": "llama3_json"}


def _tool_parser(value: Any, args: argparse.Namespace) -> str:
    from .tool_calls import TOOL_CALL_PARSERS

    if value in SGLANG_TOOL_PARSERS:
        args.auto_tool_choice, args.tool_call_parser = True, SGLANG_TOOL_PARSERS[value]
        return (
            f"SGLang's name of radixkv's {args.tool_call_parser} parser; "
            'tool_choice "auto" parses the model\'s tool calls, as in SGLang'
        )
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
        noop("the request log line is off unless --enable-log-requests"),
    ),
    VllmFlag(
        ("--enable-log-requests",),
        False,
        set_arg(
            "log_requests",
            True,
            "one log line per finished request (token counts and latencies, never its text)",
        ),
    ),
    VllmFlag(
        ("--disable-log-stats",),
        False,
        set_arg("log_stats_interval", 0.0, "no periodic stats line (--log-stats-interval 0)"),
    ),
    VllmFlag(
        ("--uvicorn-log-level",), True, set_arg("uvicorn_log_level", None, "uvicorn's log level")
    ),
    VllmFlag(
        ("--disable-uvicorn-access-log",),
        False,
        set_arg("access_log", False, "no uvicorn access log"),
    ),
    VllmFlag(
        ("--root-path",), True, set_arg("root_path", None, "uvicorn's root_path (a proxy's prefix)")
    ),
    VllmFlag(("--ssl-keyfile",), True, set_arg("ssl_keyfile", None, "TLS: uvicorn's key file")),
    VllmFlag(
        ("--ssl-certfile",), True, set_arg("ssl_certfile", None, "TLS: uvicorn's certificate")
    ),
    VllmFlag(("--ssl-ca-certs",), True, set_arg("ssl_ca_certs", None, "TLS: uvicorn's CA file")),
    VllmFlag(
        ("--disable-fastapi-docs",),
        False,
        set_arg("fastapi_docs", False, "no /docs, /redoc, /openapi.json"),
    ),
    VllmFlag(
        ("--disable-frontend-multiprocessing",),
        False,
        noop("radixkv's HTTP front and engine share one process"),
    ),
    VllmFlag(("--api-server-count",), True, one_only("API server process", _PARALLEL)),
    VllmFlag(
        ("--enable-server-load-tracking",),
        False,
        noop("/metrics has the running and waiting counts"),
    ),
    VllmFlag(
        ("--allowed-origins", "--allowed-methods", "--allowed-headers"),
        True,
        refuse(
            "radixkv serves no CORS: a keyless server refuses cross-site "
            "state-changing requests (Origin), a keyed one needs the key; put a proxy "
            "in front to serve browsers of another origin"
        ),
    ),
    VllmFlag(
        ("--allow-credentials",), False, refuse("radixkv serves no CORS (see --allowed-origins)")
    ),
    VllmFlag(("--middleware",), True, refuse("radixkv loads no middleware by import path")),
    VllmFlag(
        ("--enable-prompt-tokens-details",),
        False,
        noop("usage always has prompt_tokens_details.cached_tokens"),
    ),
    VllmFlag(
        ("--enable-force-include-usage",),
        False,
        refuse("streams carry usage when stream_options.include_usage is true"),
    ),
    VllmFlag(("--return-tokens-as-token-ids",), False, refuse("logprob tokens are text here")),
    VllmFlag(("--response-role",), True, only(("assistant",), "chat answers are the assistant's")),
    VllmFlag(
        ("--chat-template-content-format",),
        True,
        only(("auto", "string"), "message content is flattened to text for the template"),
    ),
    VllmFlag(("--max-log-len",), True, noop("radixkv logs no prompt")),
    VllmFlag(("--otlp-traces-endpoint",), True, refuse("radixkv exports no OpenTelemetry traces")),
    # tools and reasoning (issue 58)
    VllmFlag(("--enable-auto-tool-choice",), False, set_arg("auto_tool_choice", True, _AUTO)),
    VllmFlag(("--tool-call-parser",), True, _tool_parser),
    VllmFlag(("--tool-parser-plugin",), True, refuse("radixkv loads no parser plugins")),
    VllmFlag(("--reasoning-parser",), True, _reasoning),
    VllmFlag(
        ("--enable-reasoning",),
        False,
        noop("reasoning is separated when --reasoning-parser names a parser"),
    ),
    VllmFlag(
        ("--guided-decoding-backend",),
        True,
        only(("auto", "xgrammar"), "structured outputs are xgrammar's"),
    ),
    # the model and its files
    VllmFlag(
        ("--trust-remote-code",),
        False,
        noop(
            "radixkv runs no model's own Python code; it serves the architectures it "
            "implements and refuses others by name"
        ),
    ),
    VllmFlag(
        ("--download-dir",),
        True,
        env("HF_HUB_CACHE", "Hugging Face ids are looked up and downloaded there"),
    ),
    VllmFlag(("--hf-token",), True, env("HF_TOKEN", "the Hub token for downloads")),
    VllmFlag(
        ("--revision", "--code-revision", "--tokenizer-revision"),
        True,
        refuse(
            "radixkv loads a Hub id's cached snapshot: download the revision first "
            "(hf download ID --revision REV) and pass its path"
        ),
    ),
    VllmFlag(
        ("--load-format",),
        True,
        only(("auto", "safetensors", "gguf"), "the format is read from the files"),
    ),
    VllmFlag(
        ("--tokenizer-mode",), True, only(("auto", "hf"), "the model's Hugging Face tokenizer")
    ),
    VllmFlag(
        ("--hf-overrides", "--rope-scaling", "--rope-theta"),
        True,
        refuse("the model's config.json is served as it is; edit a copy of it instead"),
    ),
    VllmFlag(("--disable-sliding-window",), False, refuse("a model's window is part of the model")),
    VllmFlag(
        ("--generation-config",),
        True,
        only(("auto", "vllm"), "sampling defaults are OpenAI's; a request's fields apply"),
    ),
    VllmFlag(
        ("--override-generation-config",),
        True,
        refuse("sampling defaults are OpenAI's; set them in the requests"),
    ),
    VllmFlag(("--task", "--runner"), True, only(("auto", "generate"), "radixkv generates text")),
    VllmFlag(("--limit-mm-per-prompt",), True, refuse("radixkv serves text-only models")),
    VllmFlag(("--max-logprobs",), True, noop("radixkv returns at most 20 logprobs a position")),
    VllmFlag(("--max-parallel-loading-workers",), True, noop("weights stream shard by shard")),
    VllmFlag(("--model-impl",), True, only(("auto",), "radixkv's own model code")),
    # parallelism and devices
    VllmFlag(("--tensor-parallel-size", "-tp"), True, one_only("device", _PARALLEL)),
    VllmFlag(("--pipeline-parallel-size", "-pp"), True, one_only("device", _PARALLEL)),
    VllmFlag(("--data-parallel-size", "-dp"), True, one_only("replica", _PARALLEL)),
    VllmFlag(("--distributed-executor-backend",), True, noop("one process, no executor")),
    VllmFlag(("--disable-custom-all-reduce",), False, noop("one device, no all-reduce")),
    VllmFlag(
        ("--enable-expert-parallel",),
        False,
        refuse("radixkv serves no mixture-of-experts model yet"),
    ),
    # the scheduler and the KV cache
    VllmFlag(("--enable-chunked-prefill",), False, noop("chunked prefill is always on")),
    VllmFlag(
        ("--no-enable-chunked-prefill",),
        False,
        noop("chunked prefill stays on; --chunked-prefill-tokens sets the chunk"),
    ),
    VllmFlag(
        ("--max-num-partial-prefills", "--max-long-partial-prefills"),
        True,
        noop("radixkv's scheduler mixes prefills by its own token budget"),
    ),
    VllmFlag(("--scheduling-policy",), True, _scheduling),
    VllmFlag(("--num-scheduler-steps",), True, noop("one scheduler step per forward")),
    VllmFlag(("--preemption-mode",), True, only(("recompute",), "preempted requests recompute")),
    VllmFlag(
        ("--swap-space",),
        True,
        noop("evicted KV pages go to radixkv's host tier: --host-cache-tokens sizes it"),
    ),
    VllmFlag(("--cpu-offload-gb",), True, _no_offload),
    VllmFlag(
        ("--calculate-kv-scales",),
        False,
        noop("int8/fp8 KV scales are per page, computed as written"),
    ),
    VllmFlag(
        ("--kv-transfer-config", "--kv-events-config"),
        True,
        refuse("radixkv shares KV across replicas through its Redis tier (--remote-cache)"),
    ),
    VllmFlag(("--enforce-eager",), False, noop("radixkv captures no CUDA graphs")),
    VllmFlag(("--max-seq-len-to-capture", "--cuda-graph-sizes"), True, noop("no CUDA graphs")),
    VllmFlag(("--compilation-config", "-O"), True, noop("no torch.compile of the model")),
    VllmFlag(("--enable-sleep-mode",), False, refuse("radixkv has no sleep mode")),
    # adapters and speculation
    VllmFlag(("--enable-lora",), False, refuse(_NO_LORA)),
    VllmFlag(
        ("--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras"),
        True,
        refuse(_NO_LORA),
    ),
    VllmFlag(
        ("--speculative-config", "--num-speculative-tokens", "--speculative-model"),
        True,
        refuse("radixkv has no speculative decoding"),
    ),
]


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Register every flag of :data:`VLLM_FLAGS` (each stores its value, None when absent)."""
    add_peer_flags(parser, VLLM_FLAGS, "vllm", "vLLM flags (each says at start what it does here)")


def apply_vllm_flags(args: argparse.Namespace) -> list[str]:
    """Judge the vLLM flags given in ``args``: set what they map to (``args`` attributes such
    as ``uvicorn_log_level``, ``root_path``, ``ssl_keyfile``, ``access_log``, environment
    variables) and return one line per flag saying what it does here. Raises ``ValueError``
    naming the first refused flag and why."""
    return apply_peer_flags(args, VLLM_FLAGS, "vllm")
