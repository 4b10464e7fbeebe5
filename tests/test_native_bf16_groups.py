"""Shared-prefix groups in the bf16 native kernel (radixkv/model/csrc/cpu_attention.cpp): phase A
reads each group's shared keys once for its members' stacked rows, phase B continues each request
over its own keys. Checked against the float64 oracle and against the same call without groups.
On a build without the AVX512-BF16 path the kernel ignores the groups (the portable path), which
these tests check too (the answers must not change)."""

from __future__ import annotations

import pytest
import torch
from native_pages import BF16_MAX_ERR, BF16_MEAN_ERR, bf16_case, bf16_errors

from radixkv.model import native
from radixkv.model.attention.native_backend import native_paged_attention
from radixkv.model.attention.prefix_groups import PrefixGroup


@pytest.fixture(scope="module")
def module():
    m = native.load()
    assert m is not None, f"native kernels failed to build: {native.build_error()}"
    return m


@pytest.mark.parametrize("size", [2, 5, 48])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("d", [64, 128, 80])  # 80: the portable path (groups ignored)
def test_grouped_decodes_and_extends_match_the_oracle(module, size, page, d):
    shared = 130  # mid-page for 16 and 64, not a multiple of the 64-key block
    reqs = [(shared + 7 * b % 23, 1 + (b % 3) * 4) for b in range(size)]
    case = bf16_case(page, 9, 3, d, reqs, [(range(size), shared)], seed=size + page + d)
    grouped, plain = case.run_bf16(module), case.run_bf16(module, groups=[])
    g_max, g_mean = bf16_errors(grouped, case)
    p_max, _ = bf16_errors(plain, case)
    assert g_max < BF16_MAX_ERR and g_mean < BF16_MEAN_ERR, (g_max, g_mean)
    assert g_max <= 1.5 * p_max + 1e-3, (g_max, p_max)


@pytest.fixture
def vector_path(module):
    """The vector path only: on AMX hosts phase A's stacked rows would run on AMX, in 256-key
    blocks (tests/test_native_amx.py checks those)."""
    on = getattr(module, "amx_attention_available", lambda: False)()
    before = module.set_amx_attention(False) if on else False
    yield module
    if on:
        module.set_amx_attention(before)


def test_block_aligned_shared_part_is_the_ungrouped_answer_to_float32_rounding(vector_path):
    """With the shared part a multiple of the kernel's 64-key block, phase A + B visit the same
    key blocks in the same order as one pass per request. Phase A's 150 rows take the GEMM-form
    scores (16 rows along the lanes) where a decode's 3 rows sum each dot product across lanes,
    so the scores differ by float32 summation order alone: a few outputs move by a flipped bf16
    rounding (of P or of the output), nothing more, and both are as close to the oracle."""
    module = vector_path
    reqs = [(1024 + 20 + b, 1) for b in range(48)] + [(1024, 7), (1100, 30)]
    case = bf16_case(16, 9, 3, 64, reqs, [(range(50), 1024)], seed=5)
    grouped, plain = case.run_bf16(module), case.run_bf16(module, groups=[])
    diff = (grouped.float() - plain.float()).abs()
    big = torch.maximum(grouped.float().abs(), plain.float().abs())
    v_max = case.v_cache.float().abs().max().item()
    assert (diff <= big * 2**-7 + v_max * 2**-8).all()
    assert (diff > 0).float().mean().item() < 0.01
    (g_max, g_mean), (p_max, p_mean) = bf16_errors(grouped, case), bf16_errors(plain, case)
    assert g_max < BF16_MAX_ERR and g_max <= p_max * 1.05 and g_mean <= p_mean * 1.02


def test_two_groups_ungrouped_requests_and_a_prefix_that_is_all_shared(module):
    reqs = [(96, 1), (96, 4), (50, 1), (200, 1), (210, 12), (0, 9), (33, 2), (300, 120)]
    groups = [([0, 1], 96), ([3, 4, 6, 7], 33)]
    case = bf16_case(16, 9, 3, 64, reqs, groups, seed=8)
    g_max, g_mean = bf16_errors(case.run_bf16(module), case)
    assert g_max < BF16_MAX_ERR and g_mean < BF16_MEAN_ERR, (g_max, g_mean)


def test_peaked_scores_stay_finite_across_the_merge(module):
    """The shared part's running max must carry into the own part (a key there may dominate)."""
    case = bf16_case(16, 4, 4, 64, [(300, 2), (300, 1)], [([0, 1], 288)], seed=1)
    case.q = (case.q.float() * 40).to(torch.bfloat16)
    out = case.run_bf16(module)
    assert torch.isfinite(out).all()
    assert bf16_errors(out, case)[0] < 3e-2


def test_bad_groups_raise_clear_errors(module):
    case = bf16_case(16, 4, 4, 64, [(40, 1), (40, 1), (20, 1)], [([0, 1], 32)], seed=2)
    with pytest.raises(RuntimeError, match="paged_attention: group 0 members do not share"):
        case.run_bf16(module, groups=[PrefixGroup([0, 2], 16)])
    with pytest.raises(RuntimeError, match="two groups"):
        case.run_bf16(module, groups=[PrefixGroup([0, 1], 32), PrefixGroup([1], 16)])
    with pytest.raises(RuntimeError, match="shorter than the shared part"):
        case.run_bf16(module, groups=[PrefixGroup([0, 1], 48)])
    bad = case.table.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="outside the pool"):
        native_paged_attention(
            case.q, case.k_cache, case.v_cache, bad, case.prefix, case.ext, case.starts, 0.1
        )


@pytest.mark.parametrize("amx", [False, True])
def test_items_whose_last_block_is_short_match_the_oracle(module, amx):
    """A request's new tokens are cut into items of a fixed count of tokens (32 on the vector
    path, 64 on AMX); a last block under half of that joins the item before it, so some items
    hold up to 1.5 times the count. Checked at the counts around those edges, against float64,
    on every path this host runs."""
    if amx and not module.amx_attention_available():
        pytest.skip("this host or build has no AMX-BF16 tiles")
    ext = [15, 16, 47, 48, 73, 95, 96, 100]
    case = bf16_case(
        16, 9, 3, 64, [(300 + 7 * i, n) for i, n in enumerate(ext)] + [(0, 845)], [], seed=21
    )
    before = module.set_amx_attention(amx) if amx or module.amx_attention_available() else None
    try:
        got = case.run_bf16(module)
    finally:
        if before is not None:
            module.set_amx_attention(before)
    max_err, mean_err = bf16_errors(got, case)
    assert max_err < BF16_MAX_ERR and mean_err < BF16_MEAN_ERR, (max_err, mean_err)


@pytest.mark.parametrize("amx", [False, True])
def test_q_as_a_view_of_fused_qkv_rows_gives_the_contiguous_answer(module, amx):
    """The model passes q as a view of the fused QKV projection's rows (each token's [Hq, D]
    contiguous, tokens a row apart): the kernel reads it in place, with no copy, and must give
    bit for bit the answer of the same q made contiguous, on every path this host runs."""
    if amx and not module.amx_attention_available():
        pytest.skip("this host or build has no AMX-BF16 brgemm")
    reqs = [(96, 1), (96, 4), (0, 40), (200, 1), (210, 12), (300, 70)]
    case = bf16_case(16, 9, 3, 64, reqs, [([0, 1], 96), ([3, 4], 200)], seed=9)
    t, hq, d = case.q.shape
    rows = torch.randn(t, (hq + 6) * d).to(torch.bfloat16)
    rows[:, : hq * d] = case.q.reshape(t, hq * d)
    view = rows[:, : hq * d].view(t, hq, d)
    assert not view.is_contiguous()
    before = module.set_amx_attention(amx) if amx or module.amx_attention_available() else None
    try:
        got = case.run_bf16(module)
        case.q = view
        assert torch.equal(case.run_bf16(module), got)
    finally:
        if before is not None:
            module.set_amx_attention(before)
    assert bf16_errors(got, case)[0] < BF16_MAX_ERR
    bad_q = rows[:, : hq * d].view(t, d, hq).transpose(1, 2)  # heads strided within a token
    pages = (case.k_cache, case.v_cache, case.table, case.prefix, case.ext, case.starts)
    with pytest.raises(RuntimeError, match=r"each token's \[Hq, D\] row"):
        module.paged_attention(bad_q, *pages, 0.1, [], [], [])


GIL_PROBE = r"""
import sys, threading, time
import torch
sys.path.insert(0, {tests!r})
from native_pages import bf16_case
from radixkv.model import native
m = native.load()
# head dim 80: the portable path, slow enough (a 2,048-token causal prefill) to watch
case = bf16_case(16, 4, 4, 80, [(0, 2048)], [], seed=3)
# A short switch interval: when the kernel returns, its thread waits for the GIL while this one
# ticks on until asked to drop it; at the default 5 ms (and a busy host) those ticks landed
# inside the watched window of a ~50 ms call, as if the held GIL had let them run.
sys.setswitchinterval(1e-4)
args = (case.q.contiguous(), case.k_cache, case.v_cache, case.table.to(torch.int32).contiguous(),
        list(case.prefix), list(case.ext), list(case.starts), float(case.scale), [], [], [])
span, ticks = [], []
def kernel():
    span.append(time.perf_counter()); m.paged_attention(*args); span.append(time.perf_counter())
t = threading.Thread(target=kernel); t.start()
while t.is_alive():
    ticks.append(time.perf_counter())
t.join()
t0, t1 = span
inside = [x for x in ticks if t0 + 0.2 * (t1 - t0) < x < t1 - 0.1 * (t1 - t0)]
print("RESULT", t1 - t0, len(inside))
"""


def test_kernels_run_without_the_gil_unless_asked_to_hold_it():
    """A server's other Python threads (HTTP, tokenization, streaming) must run while the engine
    thread is inside a native kernel, as during torch's ops: a thread spinning in Python ticks
    through the middle of a long kernel call. RADIXKV_NATIVE_GIL=hold keeps the GIL: at most a
    stray switch's worth of ticks there (under 5% of the released rate). Each mode in a fresh
    process: the setting is read once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    rate = {}
    for mode in ("release", "hold"):
        out = subprocess.run(
            [sys.executable, "-c", GIL_PROBE.format(tests=tests)],
            env={**os.environ, "RADIXKV_NATIVE_GIL": mode}, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
        seconds, inside = float(line.split()[1]), int(line.split()[2])
        assert seconds > 0.02, f"the kernel took {seconds:.3f} s: too short to tell"
        rate[mode] = inside / (0.7 * seconds)  # ticks a second in the watched 70% of the call
    assert rate["release"] > 0, "no Python thread ran during the kernel: the GIL was held"
    assert rate["hold"] < 0.05 * rate["release"], f"RADIXKV_NATIVE_GIL=hold let threads run: {rate}"
