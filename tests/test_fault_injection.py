"""Fault injection: each failure reaches the request that hit it (or is logged and counted), the
other requests go on, nothing already admitted is lost, and the engine's structures stay whole.

All on the real engine over the tiny random Llama (``bench/tiny_model.py``). The faults:

* the disk tier's directory is replaced by a file mid-run (every open fails: ENOTDIR);
* the disk tier's filesystem fills up mid-run (a 48 KiB tmpfs when this host may mount one, and
  an injected ``OSError(ENOSPC)`` from the store's ``open`` everywhere);
* disk files truncated or bit-flipped between their write and their read;
* the sampler raising inside a step for one request of a batch (an injected fault in
  ``Sampler.candidates`` keyed on that request's parameters);
* a prompt longer than ``max_model_len``, and a ``max_tokens`` that cannot fit, while another
  request streams.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import ServerThread

from bench.tiny_model import ByteTokenizer, tiny_loaded_model
from radixkv.engine.sampling import SamplingParams
from radixkv.server.app import create_app

MODEL = "test-model"
TOK = ByteTokenizer()
PROMPTS = [
    "alpha beta gamma delta epsilon zeta eta theta iota kappa",
    "one two three four five six seven eight nine ten eleven",
    "red orange yellow green blue indigo violet black white!",
]


def tiny_engine(**knobs: Any) -> Any:
    from radixkv.engine.engine import Engine

    base: dict[str, Any] = dict(
        page_size=4,
        kv_cache_tokens=96,
        attention_backend="torch",
        dtype="float32",
        max_running_requests=8,
    )
    base.update(knobs)
    return Engine(tiny_loaded_model(), **base)


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_end(engine: Any, limit: int = 10_000) -> dict[str, list[Any]]:
    """Step until idle; every StepOutput grouped by request id."""
    outs: dict[str, list[Any]] = defaultdict(list)
    for _ in range(limit):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outs[out.request_id].append(out)
    assert not engine.has_unfinished()
    return outs


def assert_whole(engine: Any) -> None:
    """Idle engine: integrity holds and every used page is the prefix cache's (nothing leaked)."""
    engine.check_integrity()
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["pages_used"] == stats["pages_cached"], stats


def tokens_of(outs: list[Any], index: int = 0) -> list[int]:
    return [t for o in outs if o.index == index for t in o.new_token_ids]


# ---------------------------------------------------------------------------------- disk tier


def through_disk(engine: Any, prompt: str) -> Any:
    """Generate ``prompt`` after the other prompts pushed it out of the device pool."""
    for other in PROMPTS:
        if other != prompt:
            engine.generate(other, greedy())
    engine.tiers.sync()
    return engine.generate(prompt, greedy())[0]


def test_disk_directory_replaced_by_a_file_mid_run(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    engine = tiny_engine(disk_cache_dir=str(disk), disk_cache_bytes=1 << 20)
    reference = [engine.generate(p, greedy())[0].token_ids for p in PROMPTS]
    first = through_disk(engine, PROMPTS[0])
    assert first.cached_tokens_by_tier.get("disk", 0) > 0  # the tier worked before the fault
    # the fault: the directory vanishes and a file takes its name (every open now fails)
    shutil.move(str(disk), str(tmp_path / "moved-away"))
    disk.write_bytes(b"not a directory")
    errors_before = engine.tiers.disk.counters["write_errors"]
    for _ in range(2):
        for prompt, ref in zip(PROMPTS, reference):
            out = engine.generate(prompt, greedy())[0]
            assert out.token_ids == ref  # recomputed where the disk could not serve
    engine.tiers.sync()
    d = engine.tiers.disk.counters
    assert d["write_errors"] > errors_before, d  # counted (and logged)
    assert d["misses"] > 0, d  # indexed files that could no longer be opened
    assert_whole(engine)
    # the directory comes back: the tier works again
    disk.unlink()
    disk.mkdir()
    again = through_disk(engine, PROMPTS[1])
    assert again.token_ids == reference[1]
    assert engine.tiers.disk.num_files > 0
    assert_whole(engine)
    engine.tiers.close()


def test_disk_full_injected_enospc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv.cache import private_files

    engine = tiny_engine(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)
    reference = [engine.generate(p, greedy())[0].token_ids for p in PROMPTS]
    engine.tiers.sync()
    files_before = engine.tiers.disk.num_files
    write_all = private_files._write_all

    def full_write(fd: int, data: Any) -> None:
        # a partial write first, as a real full disk leaves one
        write_all(fd, b"partial")
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(private_files, "_write_all", full_write)
    for _ in range(2):
        for prompt, ref in zip(PROMPTS, reference):
            assert engine.generate(prompt, greedy())[0].token_ids == ref
    engine.tiers.sync()
    d = engine.tiers.disk.counters
    assert d["write_errors"] > 0, d
    assert engine.tiers.disk.num_files == files_before  # nothing half-written got indexed
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # nor left behind
    assert_whole(engine)
    engine.tiers.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 48 KiB tmpfs (about 20 page files of the tiny model); skip where mounting is denied."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=48k,mode=0700", "tmpfs", str(mnt)],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def test_disk_really_full_tmpfs(small_tmpfs: Path) -> None:
    """A real ENOSPC: the store believes it has 1 MiB, the filesystem holds 48 KiB."""
    engine = tiny_engine(disk_cache_dir=str(small_tmpfs), disk_cache_bytes=1 << 20)
    reference = {}
    for i in range(12):  # distinct prompts: far more pages than the filesystem holds
        prompt = f"{i:02d} " + PROMPTS[i % 3]
        reference[prompt] = engine.generate(prompt, greedy())[0].token_ids
    engine.tiers.sync()
    for prompt, ref in reference.items():
        assert engine.generate(prompt, greedy())[0].token_ids == ref
    engine.tiers.sync()
    d = engine.tiers.disk.counters
    assert d["write_errors"] > 0, d  # the filesystem filled up
    assert d["writes"] > 0, d  # until then the tier worked
    assert not [n for n in os.listdir(small_tmpfs) if n.endswith(".tmp")]
    assert_whole(engine)
    engine.tiers.close()


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_disk_file_damaged_between_write_and_read(tmp_path: Path, damage: str) -> None:
    engine = tiny_engine(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)
    reference = engine.generate(PROMPTS[0], greedy())[0].token_ids
    for other in PROMPTS[1:]:
        engine.generate(other, greedy())
    engine.tiers.sync()
    files = sorted(tmp_path.glob("*.kv"))
    assert files
    for f in files:  # damage every file on disk
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            f.write_bytes(bytes(data[: len(data) // 2]))
        else:
            data[-7] ^= 0x10  # one bit in the payload
            f.write_bytes(bytes(data))
    out = engine.generate(PROMPTS[0], greedy())[0]
    assert out.token_ids == reference  # recomputed, never read from a damaged file
    assert out.cached_tokens_by_tier.get("disk", 0) == 0
    counters = engine.tiers.disk.counters
    reason = "truncated" if damage == "truncate" else "checksum"
    assert counters[f"corrupt_{reason}"] > 0, counters
    assert_whole(engine)
    engine.tiers.close()


# ---------------------------------------------------------------------------------- engine step


def inject_sampling_fault(engine: Any, top_k: int = 7) -> None:
    """Requests with this ``top_k`` make the sampler raise (the fault is the point)."""
    original = engine.sampler.candidates

    def faulty(rows: Any, top: Any, inv_t: Any, params: Any, width: int) -> Any:
        if any(p.top_k == top_k for p in params):
            raise RuntimeError("injected sampling fault")
        return original(rows, top, inv_t, params, width)

    engine.sampler.candidates = faulty


def test_sampling_fault_fails_only_its_request() -> None:
    engine = tiny_engine(kv_cache_tokens=512)
    ids = [TOK.encode(p) for p in PROMPTS]
    reference = [engine.generate(i, greedy(10))[0].token_ids for i in ids]
    inject_sampling_fault(engine)
    engine.add_request("good-0", ids[0], greedy(10))
    engine.add_request("bad", ids[1], SamplingParams(max_tokens=10, temperature=1.0, top_k=7, n=2))
    engine.add_request("good-2", ids[2], greedy(10))
    engine.add_request("good-n", ids[0], SamplingParams(max_tokens=10, temperature=0.0, n=3))
    with_logprobs = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    engine.add_request("good-lp", ids[2], with_logprobs)
    outs = run_to_end(engine)
    bad = outs["bad"]
    assert bad and all(o.finished and o.finish_reason == "error" for o in bad), bad
    assert "injected sampling fault" in (bad[0].error or "")
    assert not any(o.new_token_ids for o in bad)
    assert tokens_of(outs["good-0"]) == reference[0]
    assert tokens_of(outs["good-2"]) == reference[2]
    for i in range(3):
        assert tokens_of(outs["good-n"], i) == reference[0]
    # rows sampled one by one keep their logprobs: each token's dict, greedy so its top-1
    assert tokens_of(outs["good-lp"]) == reference[2]
    for o in outs["good-lp"]:
        (tok,) = o.new_token_ids
        assert o.logprobs is not None and list(o.logprobs[0]) == [tok], o.logprobs
        assert o.logprobs[0][tok].rank == 1
    assert engine.counters["failed_requests"] == 1
    assert_whole(engine)


def test_sampling_fault_over_http_fails_only_its_request() -> None:
    engine = tiny_engine(kv_cache_tokens=512)
    inject_sampling_fault(engine)
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with ServerThread(create_app(engine, model_name=MODEL)) as srv:
        url = f"{srv.base_url}/v1/completions"

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as http:
                return await asyncio.gather(
                    http.post(url, json={**body, "prompt": PROMPTS[0]}),
                    http.post(url, json={**body, "prompt": PROMPTS[1], "stream": True}),
                    http.post(
                        url,
                        json={**body, "prompt": PROMPTS[2], "top_k": 7, "temperature": 1, "n": 2},
                    ),
                    http.post(url, json={**body, "prompt": PROMPTS[0], "n": 2}),
                )

        ok, stream, bad, ok_n = asyncio.run(scenario())
        assert bad.status_code == 500, bad.text
        err = bad.json()["error"]
        assert err["type"] == "server_error" and "internal error (id " in err["message"]
        assert "injected" not in err["message"]  # the detail is in the server log only
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 24
        assert ok_n.status_code == 200 and ok_n.json()["usage"]["completion_tokens"] == 48
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in stream.text
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
        metrics = httpx.get(f"{srv.base_url}/metrics").text
        assert 'radixkv_requests_total{finish_reason="error"} 1.0' in metrics
        srv.app.state.engine_loop.call_sync(assert_whole)


# ---------------------------------------------------------------------------------- limits


def test_context_limits_refused_while_others_stream() -> None:
    engine = tiny_engine(kv_cache_tokens=1024, max_model_len=128)
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("long", [5] * 200, greedy(4))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("big", [5] * 20, greedy(120))
    assert not engine.has_unfinished()
    long_prompt = "x" * 200
    with ServerThread(create_app(engine, model_name=MODEL)) as srv:
        base = srv.base_url

        async def scenario() -> tuple[str, list[httpx.Response]]:
            async with httpx.AsyncClient(timeout=60) as http:
                streamed: list[str] = []

                async def stream() -> None:
                    body = {
                        "model": MODEL,
                        "prompt": PROMPTS[0],
                        "max_tokens": 40,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                    }
                    async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            streamed.append(line)

                task = asyncio.create_task(stream())
                await asyncio.sleep(0.05)
                bad = [
                    await http.post(
                        f"{base}/v1/completions",
                        json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1},
                    ),
                    await http.post(
                        f"{base}/v1/completions",
                        json={"model": MODEL, "prompt": "short", "max_tokens": 500},
                    ),
                    await http.post(
                        f"{base}/generate",
                        json={"input_ids": [5] * 130, "sampling_params": {"max_new_tokens": 1}},
                    ),
                    await http.post(
                        f"{base}/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "messages": [{"role": "user", "content": long_prompt}],
                        },
                    ),
                ]
                await task
                return "\n".join(streamed), bad

        text, bad = asyncio.run(scenario())
        for r in bad:
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and "128" in err["message"], err
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        assert text.count('"finish_reason":"length"') == 1
        srv.app.state.engine_loop.call_sync(assert_whole)
