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


def test_info_json_reports_host_and_default_path(capsys: pytest.CaptureFixture[str]) -> None:
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
    assert info["attention_backend"] == "torch" and info["attention_impl"].endswith("Backend")
    assert info["native_kernels"] == "built" or info["native_kernels"].startswith("unavailable")
    assert "\n" not in format_platform_info(info)  # one log line, even for a compiler error


def test_info_backend_follows_the_dtype(
    capsys: pytest.CaptureFixture[str], tiny_llama: object
) -> None:
    for dtype in ("float32", "bfloat16"):
        info = _info(capsys, "--dtype", dtype)
        assert info["dtype"] == dtype
        # the same backend class a runner of that dtype builds (head dim 64 as the model's)
        runner = ModelRunner(tiny_llama, num_pages=4, page_size=16, dtype=getattr(torch, dtype))
        if runner.config.head_dim == info["head_dim"]:
            assert info["attention_impl"] == type(runner.backend).__name__


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
