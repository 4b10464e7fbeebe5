"""``radixkv serve`` flags as vLLM and SGLang users type them: every alias lands in the engine
config, choices are enforced, types and defaults come from ``EngineConfig``; the KV pool sized
by a memory fraction; ``--tokenizer``; HF ids resolved from the local HF cache, offline."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest

from radixkv.config import EngineConfig
from radixkv.server.cli import add_serve_parser
from radixkv.server.engine_flags import ENGINE_FLAGS, engine_kwargs


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


ALIASES = [
    (["--block-size", "32"], "page_size", 32),
    (["--page-size", "32"], "page_size", 32),
    (["--max-num-seqs", "7"], "max_running_requests", 7),
    (["--max-running-requests", "7"], "max_running_requests", 7),
    (["--max-num-batched-tokens", "512"], "chunked_prefill_tokens", 512),
    (["--chunked-prefill-size", "512"], "chunked_prefill_tokens", 512),
    (["--max-model-len", "300"], "max_model_len", 300),
    (["--context-length", "300"], "max_model_len", 300),
    (["--dtype", "half"], "dtype", "float16"),
    (["--dtype", "float"], "dtype", "float32"),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--dtype", "float16"], "dtype", "float16"),
    (["--gpu-memory-utilization", "0.8"], "kv_cache_memory_fraction", 0.8),
    (["--mem-fraction-static", "0.8"], "kv_cache_memory_fraction", 0.8),
    (["--kv-cache-memory-fraction", "0.8"], "kv_cache_memory_fraction", 0.8),
    (["--tokenizer", "org/tok"], "tokenizer", "org/tok"),
    (["--chat-template", "{{ x }}"], "chat_template", "{{ x }}"),
    (["--seed", "3"], "seed", 3),
    (["--enable-prefix-caching"], "enable_prefix_cache", True),
    (["--no-enable-prefix-caching"], "enable_prefix_cache", False),
    (["--disable-radix-cache"], "enable_prefix_cache", False),
    (["--disable-prefix-cache"], "enable_prefix_cache", False),
    (["--random-seed", "3"], "seed", 3),
    (["--tokenizer-path", "org/tok"], "tokenizer", "org/tok"),
    (["--max-total-tokens", "4096"], "kv_cache_tokens", 4096),
    (["--attention-backend", "torch_native"], "attention_backend", "torch"),
    (["--attention-backend", "intel_amx"], "attention_backend", "torch"),
]


@pytest.mark.parametrize(("argv", "knob", "value"), ALIASES)
def test_each_alias_lands_in_the_config(argv: list[str], knob: str, value: Any) -> None:
    kwargs = engine_kwargs(parse(*argv))
    assert kwargs == {knob: value}
    config = EngineConfig(**kwargs)
    config.validate()
    assert getattr(config, knob) == value


def test_unset_flags_and_auto_keep_the_engine_defaults() -> None:
    assert engine_kwargs(parse()) == {}
    assert engine_kwargs(parse("--dtype", "auto")) == {}  # the engine picks by device


def test_server_flags_host_port_and_template_trust() -> None:
    args = parse("--host", "0.0.0.0", "--port", "8123", "--trust-request-chat-template")
    assert (args.host, args.port, args.trust_request_chat_template) == ("0.0.0.0", 8123, True)
    assert parse().trust_request_chat_template is False


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtype", "fp8"],
        ["--schedule-policy", "random"],
        ["--eviction-policy", "mru"],
        ["--attention-backend", "flashinfer"],
        ["--kv-layout", "tiled"],
        ["--host-write-policy", "never"],
        ["--block-size", "x"],
    ],
)
def test_choices_and_types_are_enforced(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)
    assert "invalid" in capsys.readouterr().err


def test_types_defaults_and_knobs_come_from_engine_config() -> None:
    hints = typing.get_type_hints(EngineConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    parser = argparse.ArgumentParser()
    serve = add_serve_parser(parser.add_subparsers(dest="command"))
    actions = {a.dest: a for a in serve._actions}
    for entry in ENGINE_FLAGS:
        action = actions[entry.knob]
        assert set(entry.flags) <= set(action.option_strings)
        assert action.type in typing.get_args(hints[entry.knob]) or action.type is hints[entry.knob]
        if "default" not in entry.help and defaults[entry.knob] is not None:
            assert f"(default {defaults[entry.knob]})" in action.help
        assert action.choices == entry.choices
    assert {e.knob for e in ENGINE_FLAGS} <= set(EngineConfig.knob_names())


def test_memory_fraction_sizes_the_pool_from_available_memory(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from radixkv import Engine
    from radixkv.engine import pool_sizing

    monkeypatch.setattr(pool_sizing, "available_memory_bytes", lambda: 1 << 30)
    by_fraction = Engine(tiny_model, page_size=4, dtype="float32", kv_cache_memory_fraction=0.002)
    by_gb = Engine(tiny_model, page_size=4, dtype="float32", kv_cache_memory_gb=0.002)
    assert by_fraction.kv_capacity_tokens == by_gb.kv_capacity_tokens > 0
    with pytest.raises(ValueError, match="not both"):
        Engine(tiny_model, kv_cache_memory_fraction=0.5, kv_cache_memory_gb=1.0)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        Engine(tiny_model, kv_cache_memory_fraction=1.5)


def _hf_cache(home: Path, repo_id: str, files: Any) -> Path:
    """Lay out ``repo_id`` in an HF hub cache under ``home`` (``files(snapshot_dir)`` fills
    the snapshot), as ``hf download`` does."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    files(snapshot)
    return snapshot


def test_hf_ids_resolve_from_the_local_cache_offline(
    tmp_path: Path, real_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.tiny_model import tiny_loaded_model
    from radixkv import Engine
    from radixkv.model.loader import ModelNotFoundError, load_model, load_tokenizer

    tiny = tiny_loaded_model()

    def save(snapshot: Path) -> None:
        tiny.hf_model.save_pretrained(str(snapshot))
        real_model.tokenizer.save_pretrained(str(snapshot))

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    _hf_cache(tmp_path / "hf", "acme/tiny-llama", save)
    loaded = load_model("acme/tiny-llama")
    assert loaded.name == "acme/tiny-llama"
    assert loaded.config.hidden_size == tiny.config.hidden_size
    engine = Engine("acme/tiny-llama", page_size=4, dtype="float32", kv_cache_tokens=256)
    assert engine.model_name == "acme/tiny-llama"
    assert load_tokenizer("acme/tiny-llama").encode("Paris") == real_model.tokenizer.encode("Paris")
    with pytest.raises(ModelNotFoundError, match="hf download acme/absent"):
        load_model("acme/absent")
    _hf_cache(tmp_path / "hf", "acme/tok-only", real_model.tokenizer.save_pretrained)
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model("acme/tok-only")


def test_tokenizer_knob_replaces_the_models(
    tiny_model: Any, real_model: Any, tmp_path: Path
) -> None:
    from radixkv import Engine

    real_model.tokenizer.save_pretrained(str(tmp_path / "tok"))
    engine = Engine(tiny_model, page_size=4, dtype="float32", tokenizer=str(tmp_path / "tok"))
    assert engine.tokenizer.encode("Paris") == real_model.tokenizer.encode("Paris")
    assert tiny_model.tokenizer.encode("Paris") == list(b"Paris")  # the shared model untouched


@pytest.mark.parametrize("gate", [True, False])
def test_a_cpu_serve_leaves_triton_unloaded(gate: bool) -> None:
    """From the checkout's root (where transformers' probe for HF's ``kernels`` package finds
    ``kernels/``), loading a transformers model imports Triton only without the gate."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: nothing to keep unloaded")
    code = (
        "import sys\n"
        "from radixkv.model.triton_gate import skip_triton_without_gpu\n"
        f"assert skip_triton_without_gpu('cpu') if {gate} else True\n"
        "import transformers.models.llama.modeling_llama\n"
        "import radixkv.kernels\n"
        "print('triton' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == str(not gate)


def test_the_pool_is_sized_from_memory_by_default(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No size given: the default share of available memory, capped at every running sequence
    at full context, and the start-up log says how many tokens fit."""
    import logging

    import torch

    from radixkv import Engine
    from radixkv.engine import pool_sizing

    fraction = pool_sizing.DEFAULT_KV_MEMORY_FRACTION["cpu"]
    per_token = pool_sizing.kv_bytes_per_token(tiny_model.config, torch.float32)
    monkeypatch.setattr(pool_sizing, "available_memory_bytes", lambda: 1000 * 4 * per_token)
    with caplog.at_level(logging.INFO, logger="radixkv.engine.assembly"):
        small = Engine(tiny_model, page_size=4, dtype="float32", device="cpu")
    want = int(fraction * 1000 * 4) // 4 * 4
    assert small.kv_capacity_tokens == want
    assert f"KV pool: {want} tokens" in caplog.text and "default: 0.2 of the" in caplog.text
    monkeypatch.setattr(pool_sizing, "available_memory_bytes", lambda: 1 << 40)
    capped = Engine(tiny_model, page_size=4, dtype="float32", device="cpu", max_running_requests=2)
    assert capped.kv_capacity_tokens == pool_sizing.DEFAULT_MIN_CAP_TOKENS
    big = Engine(tiny_model, page_size=4, dtype="float32", device="cpu", max_running_requests=1024)
    assert big.kv_capacity_tokens == 1024 * tiny_model.config.max_position_embeddings
    with pytest.raises(ValueError, match="not both"):
        Engine(tiny_model, kv_cache_tokens=64, kv_cache_memory_gb=1.0)


def test_the_pool_is_touched_on_first_use_not_at_start(tiny_model: Any) -> None:
    """A 1 GiB pool costs address space at start, not resident memory."""
    import resource

    from radixkv import Engine

    def rss_bytes() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize()

    before = rss_bytes()
    engine = Engine(tiny_model, page_size=64, dtype="float32", kv_cache_memory_gb=1.0)
    grown = rss_bytes() - before
    assert engine.kv_capacity_tokens * 512 >= 1 << 30  # 512 B a token in fp32
    assert grown < 256 << 20, f"creating a 1 GiB pool made {grown >> 20} MiB resident"


# ------------------------------------------------------------------ vLLM's flags (issue 58)

#: A vLLM launch command as its users write them (flags from vLLM's docs and common
#: deployment guides), with the model as the positional argument.
VLLM_LAUNCH = (
    "Qwen/Qwen3-0.6B --host 127.0.0.1 --port 8011 --served-model-name qwen --dtype auto "
    "--max-model-len 4096 --gpu-memory-utilization 0.5 --max-num-seqs 64 "
    "--max-num-batched-tokens 2048 --enable-chunked-prefill --enable-prefix-caching "
    "--disable-log-requests --uvicorn-log-level warning --trust-remote-code "
    "--tensor-parallel-size 1 --pipeline-parallel-size 1 --data-parallel-size 1 --seed 0 "
    "--enforce-eager --swap-space 4 --block-size 16 --kv-cache-dtype auto --download-dir /tmp/hf "
    "--enable-prompt-tokens-details --disable-log-stats --max-logprobs 20 --load-format auto "
    "--tokenizer-mode auto --distributed-executor-backend mp --disable-custom-all-reduce "
    "--generation-config auto --scheduling-policy fcfs --max-num-partial-prefills 1 "
    "--compilation-config 0 --max-seq-len-to-capture 8192 --disable-frontend-multiprocessing "
    "--enable-server-load-tracking --response-role assistant --api-server-count 1 "
    "--chat-template-content-format auto --guided-decoding-backend xgrammar --task generate "
    "--preemption-mode recompute --calculate-kv-scales --disable-uvicorn-access-log "
    "--root-path /v --max-log-len 100 --model-impl auto --num-scheduler-steps 1 "
    "--max-parallel-loading-workers 2 --enable-log-requests --no-enable-chunked-prefill"
)


def test_a_vllm_launch_command_parses_and_each_flag_says_what_it_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from radixkv.server.vllm_flags import apply_vllm_flags

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    args = parse(*VLLM_LAUNCH.split())
    lines = apply_vllm_flags(args)
    given = {f for f in VLLM_LAUNCH.split() if f.startswith("--")}
    from radixkv.server.vllm_flags import VLLM_FLAGS

    ours = {spelling for f in VLLM_FLAGS for spelling in f.flags}
    assert len(lines) == len(given & ours)  # one line for each vLLM flag given
    assert all(": " in line for line in lines)
    # the ones that do something here did it
    assert args.uvicorn_log_level == "warning" and args.root_path == "/v"
    assert args.access_log is False and args.log_stats_interval == 0.0
    assert args.log_requests is True and args.schedule_policy == "fcfs"
    import os

    assert os.environ["HF_HUB_CACHE"] == "/tmp/hf"
    # and radixkv's own flags of the same name landed in the engine's config
    knobs = engine_kwargs(args)
    assert knobs["max_running_requests"] == 64 and knobs["page_size"] == 16
    assert knobs["max_model_len"] == 4096 and knobs["chunked_prefill_tokens"] == 2048


@pytest.mark.parametrize(
    "table, argv, why",
    [
        ("vllm", ["--tensor-parallel-size", "2"], "radixkv cluster --replicas"),
        ("vllm", ["-tp", "4"], "runs one device"),
        ("vllm", ["--enable-lora"], "LoRA"),
        ("vllm", ["--speculative-config", "{}"], "speculative"),
        (
            "vllm",
            ["--tool-call-parser", "pythonic", "--enable-auto-tool-choice"],
            "parsers are hermes",
        ),
        ("vllm", ["--tool-call-parser", "hermes"], "goes with --enable-auto-tool-choice"),
        ("vllm", ["--reasoning-parser", "granite"], "reasoning parsers are qwen3, deepseek_r1"),
        ("vllm", ["--allowed-origins", '["*"]'], "CORS"),
        ("vllm", ["--scheduling-policy", "priority"], "priorities"),
        ("vllm", ["--revision", "main"], "hf download"),
        ("sglang", ["--tp-size", "2"], "radixkv cluster --replicas"),
        ("sglang", ["--dp", "2"], "runs one replica"),
        ("sglang", ["--enable-hierarchical-cache"], "--host-cache-tokens N"),
        ("sglang", ["--hicache-ratio", "2"], "host tier"),
        ("sglang", ["--is-embedding"], "not embeddings"),
        ("sglang", ["--enable-deterministic-inference"], "independent of the batch"),
        ("sglang", ["--allow-auto-truncate"], "400"),
        ("sglang", ["--speculative-algorithm", "EAGLE"], "speculative"),
    ],
)
def test_a_flag_radixkv_cannot_honour_is_refused_saying_why(
    table: str, argv: list[str], why: str
) -> None:
    flags, apply = peer_table(table)
    with pytest.raises(ValueError, match=why) as exc:
        apply(parse(*argv))
    first = next(f.flags[0] for f in flags if argv[0] in f.flags)  # named by its first spelling
    assert str(exc.value).startswith(first), exc.value


def test_radixkv_serve_exits_2_on_a_refused_flag_before_loading() -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "radixkv", "serve", "--model", "smollm2", "-tp", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--tensor-parallel-size 2: radixkv runs one device" in r.stderr


@pytest.mark.parametrize("table", ["vllm", "sglang"])
def test_every_flag_in_a_table_parses(table: str) -> None:
    flags, apply = peer_table(table)
    for flag in flags:
        for spelling in flag.flags:
            argv = [spelling, "1"] if flag.takes_value else [spelling]
            try:
                lines = apply(parse(*argv))
            except ValueError as exc:
                assert str(exc).startswith(flag.flags[0]), exc
            else:
                assert len(lines) == 1 and lines[0].startswith(flag.flags[0]), lines


def test_the_request_log_line_is_off_by_default_and_never_holds_the_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's ``--enable-log-requests`` (``create_app(log_requests=True)``): one line per
    finished request with its counts and latencies; off by default; never the prompt."""
    import logging

    import httpx
    from fake_engine import ServerThread
    from test_server import build_tiny_engine

    from radixkv.server.app import create_app

    body = {"prompt": "a secret prompt", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    for enabled in (False, True):
        caplog.clear()
        with (
            caplog.at_level(logging.INFO, logger="radixkv.server.engine_loop"),
            ServerThread(create_app(build_tiny_engine(), log_requests=enabled)) as srv,
        ):
            r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200
        lines = [m for m in caplog.messages if "finished (" in m]
        assert len(lines) == int(enabled), lines
        assert all("secret" not in m for m in caplog.messages)
    assert "finished (length): prompt 15 tokens (0 cached), 3 generated, TTFT" in lines[0]


SGLANG_LAUNCH = (
    "--model-path smollm2 --tokenizer-path smollm2 --host 0.0.0.0 --port 30000 --tp-size 1 "
    "--dp-size 1 --mem-fraction-static 0.5 --context-length 4096 --chunked-prefill-size 1024 "
    "--max-running-requests 32 --max-total-tokens 8192 --max-prefill-tokens 4096 "
    "--max-queued-requests 50 --page-size 16 --schedule-policy lpm --enable-metrics "
    "--log-requests --log-level info --random-seed 7 --attention-backend torch_native "
    "--stream-interval 1 --disable-cuda-graph --cuda-graph-max-bs 8 --enable-torch-compile "
    "--schedule-conservativeness 1.0 --grammar-backend xgrammar --watchdog-timeout 300 "
    "--disable-overlap-schedule --enable-mixed-chunk --sampling-backend pytorch "
    "--enable-cache-report --trust-remote-code --tool-call-parser qwen25 --reasoning-parser qwen3 "
    "--host-cache-tokens 65536 --enable-hierarchical-cache --decode-log-interval 40"
)


def test_an_sglang_launch_command_parses_and_each_flag_says_what_it_does() -> None:
    from radixkv.server.cli import resolve_model
    from radixkv.server.sglang_flags import SGLANG_FLAGS, apply_sglang_flags
    from radixkv.server.vllm_flags import apply_vllm_flags

    args = parse(*SGLANG_LAUNCH.split())
    vllm_lines = apply_vllm_flags(args)  # --tool-call-parser, --reasoning-parser, ...
    lines = apply_sglang_flags(args)
    given = {f for f in SGLANG_LAUNCH.split() if f.startswith("--")}
    ours = {spelling for f in SGLANG_FLAGS for spelling in f.flags}
    assert len(lines) == len(given & ours) and all(": " in line for line in lines)
    assert any("qwen25: SGLang's name of radixkv's hermes parser" in x for x in vllm_lines)
    # what they do here, done
    assert args.tool_call_parser == "hermes" and args.auto_tool_choice is True
    assert args.log_requests is True and args.max_waiting == 50
    assert resolve_model(args)[0] == "smollm2"
    knobs = engine_kwargs(args)
    assert knobs["kv_cache_tokens"] == 8192 and knobs["seed"] == 7
    assert knobs["tokenizer"] == "smollm2" and knobs["attention_backend"] == "torch"
    assert knobs["max_model_len"] == 4096 and knobs["chunked_prefill_tokens"] == 1024
    assert knobs["max_running_requests"] == 32 and knobs["host_cache_tokens"] == 65536


def peer_table(table: str) -> tuple[list[Any], Any]:
    """A peer's flag table and the function that judges it."""
    if table == "vllm":
        from radixkv.server.vllm_flags import VLLM_FLAGS, apply_vllm_flags

        return VLLM_FLAGS, apply_vllm_flags
    from radixkv.server.sglang_flags import SGLANG_FLAGS, apply_sglang_flags

    return SGLANG_FLAGS, apply_sglang_flags
