"""``radixkv info`` and the server's startup platform line report the real host and paths."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from radixkv.cli import main
from radixkv.model import host_cpu
from radixkv.model.platform_info import format_platform_info
from radixkv.model.runner import ModelRunner, default_dtype


def _info(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["info", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _runner(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> ModelRunner:
    """A runner of ``dtype`` on a one-layer random Llama whose attention heads are ``head_dim``
    wide: the backend an engine of that model would use."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=2 * head_dim,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    runner = ModelRunner(
        LlamaForCausalLM(cfg).eval(),
        num_pages=4,
        page_size=16,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    assert runner.config.head_dim == head_dim and runner.dtype == dtype
    return runner


def test_info_json_reports_host_and_default_path(capsys: pytest.CaptureFixture[str]) -> None:
    from radixkv.model import native

    info = _info(capsys)
    assert info["cpu"] == host_cpu.cpu_model_name()
    assert info["isa"] == host_cpu.best_isa()
    assert info["isa_flags"] == host_cpu.relevant_flags()
    if Path("/proc/cpuinfo").exists():
        text = Path("/proc/cpuinfo").read_text()
        assert ("avx2" in info["isa_flags"]) is (" avx2" in text)
        assert ("avx512_bf16" in info["isa_flags"]) is (" avx512_bf16" in text)
    assert info["native_bf16"] is host_cpu.has_native_bf16()
    assert info["torch"] == torch.__version__
    assert info["threads"] == torch.get_num_threads()
    assert info["default_dtype"] == str(default_dtype("cpu")).removeprefix("torch.")
    assert info["dtype"] == info["default_dtype"]
    assert info["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert (info["device"], info["head_dim"]) == ("cpu", 64)  # the defaults: SmolLM2 on the CPU
    # the backend an engine of SmolLM2's head dim builds on this host, by class
    runner = _runner(64, default_dtype("cpu"))
    assert info["attention_backend"] == runner.attention_backend == "torch"
    assert info["attention_impl"] == type(runner.backend).__name__
    # the native kernels' state as radixkv.model.native reports it
    if native.load() is not None:
        assert info["native_kernels"] == "built"
    else:
        first = (native.build_error() or "unknown").strip().splitlines()[0]
        assert info["native_kernels"] == f"unavailable ({first[:160]})"
    assert info["host_isa"] == native.host_isa()
    assert info["kernel_isa"] == native.kernel_isa()
    assert "\n" not in format_platform_info(info)  # one log line, even for a compiler error


@pytest.mark.parametrize("fp32_attention", ["native", "cascade", "plain"])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_info_backend_follows_the_dtype_and_head_dim(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    head_dim: int,
    fp32_attention: str,
) -> None:
    # RADIXKV_FP32_ATTENTION=plain/cascade gives float32 a backend of its own on every host,
    # so a report that ignored --dtype fails here whatever this CPU's kernels are
    monkeypatch.setenv("RADIXKV_FP32_ATTENTION", fp32_attention)
    info = _info(capsys, "--dtype", dtype, "--head-dim", str(head_dim))
    assert (info["dtype"], info["head_dim"]) == (dtype, head_dim)
    # the same backend class a runner of that dtype and head dim builds
    runner = _runner(head_dim, getattr(torch, dtype))
    assert info["attention_impl"] == type(runner.backend).__name__


def test_info_of_a_runner_names_the_backend_inside_a_wrapper() -> None:
    """A runner over int8 pages wraps its backend in the rotation: the platform line (the
    server logs it at start) names both, so which kernel serves is never hidden."""
    from radixkv.model.platform_info import platform_info

    plain = _runner(64, default_dtype("cpu"))
    assert platform_info(runner=plain)["attention_impl"] == type(plain.backend).__name__
    rotated = _runner(64, default_dtype("cpu"), kv_cache_dtype="int8")
    inner = type(rotated.backend.inner).__name__
    assert platform_info(runner=rotated)["attention_impl"] == f"RotatedKVBackend({inner})"


def test_info_text_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    for key in ("cpu", "isa", "isa_flags", "torch", "threads", "default_dtype", "attention_impl"):
        assert any(line.split()[0] == key for line in text.splitlines() if line.strip()), key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_server_logs_the_platform_line_at_startup() -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.cli", "serve", "--port", str(port)]
        + ["--kv-cache-tokens", "1024"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "platform:" in line:
                break
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    found = [ln for ln in lines if "platform:" in ln]
    assert found, "".join(lines[-20:])
    line = found[0]
    assert f"isa={host_cpu.best_isa()}" in line
    assert f"dtype={str(default_dtype('cpu')).removeprefix('torch.')}" in line
    assert "attention_impl=" in line and f"torch={torch.__version__}" in line
