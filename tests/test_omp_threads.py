"""release_omp_workers frees the calling thread's OpenMP workers (libgomp), so the engine
thread's pool is the only one (radixkv.model.omp_threads)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, time, torch
    from radixkv.model.omp_threads import release_omp_workers, _libgomp_path

    def tasks():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    a = torch.randn(1 << 22)
    before = tasks()
    for _ in range(20):
        torch.add(a, 1.0)  # a parallel region on this (main) thread: it gets a worker pool
    with_pool = tasks()
    released = release_omp_workers()
    deadline = time.monotonic() + 5
    while tasks() >= with_pool and time.monotonic() < deadline:
        time.sleep(0.01)
    after = tasks()
    torch.add(a, 1.0)  # a new region on this thread still runs (a new pool)
    print(_libgomp_path() is not None, released, before, with_pool, after, tasks())
    """
)


def test_release_frees_the_calling_threads_openmp_workers() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    has_gomp, released = out[0] == "True", out[1] == "True"
    before, with_pool, after, again = map(int, out[2:])
    if not has_gomp:  # another OpenMP runtime: nothing to release, and nothing is touched
        assert not released
        return
    assert released
    assert with_pool > before, "the parallel region started no worker thread"
    assert after < with_pool, f"the workers did not exit: {before} {with_pool} {after}"
    assert again >= after
