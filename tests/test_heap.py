"""The C heap tuning of CPU serving processes (radixkv/model/heap.py): freed activation buffers
are reused instead of being faulted in afresh, only where it applies, and engines on the CPU
apply it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from radixkv.model import heap

# A fresh process: touch a 25 MB float32 buffer (a 2,048-token step's gate/up output), free it,
# then count the page faults of a second one (heap tuning is process-wide, so each case needs
# its own process).
PROBE = textwrap.dedent(
    """
    import resource, sys, torch
    from radixkv.model.heap import tune_heap
    applied = tune_heap()
    def faults_of_one_buffer():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(2048, 3072)
        x.fill_(1.0)
        del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults_of_one_buffer()
    print(int(applied), faults_of_one_buffer())
    """
)


def _probe(tuning: str) -> tuple[bool, int]:
    env = dict(os.environ, RADIXKV_HEAP_TUNING=tuning)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    applied, faults = out.stdout.split()
    return applied == "1", int(faults)


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or "glibc" not in " ".join(os.confstr("CS_GNU_LIBC_VERSION").split()[:1]),
    reason="the heap tuning is glibc's mallopt",
)
def test_tuned_heap_reuses_a_freed_activation_buffer() -> None:
    """With the tuning a second 25 MB buffer reuses the first one's memory (a few faults, not
    one per 4 KiB page); without it (``RADIXKV_HEAP_TUNING=0``) glibc hands the memory back and
    the second buffer faults in afresh."""
    pages = 2048 * 3072 * 4 // 4096
    applied, tuned = _probe("1")
    assert applied
    assert tuned < pages // 10, (tuned, pages)
    applied, default = _probe("0")
    assert not applied
    assert default > pages // 2, (default, pages)


def test_tuning_applies_once_and_engines_on_the_cpu_ask_for_it(monkeypatch) -> None:
    from bench.tiny_model import tiny_loaded_model
    from radixkv import Engine

    calls = []
    monkeypatch.setattr(heap, "tune_heap", lambda: calls.append(1) or True)
    Engine(tiny_loaded_model(), device="cpu", kv_cache_tokens=256)
    assert calls == [1]
    monkeypatch.undo()
    first = heap.tune_heap()
    assert heap.tune_heap() is first  # idempotent: the second call changes nothing
