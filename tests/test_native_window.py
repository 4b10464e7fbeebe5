"""Sliding-window attention inside the native kernels (csrc/cpu_attention_f32.cpp,
csrc/cpu_attention.cpp), against float64: windows shorter than the context, decodes, extends
after a cached prefix (a cache hit mid-prompt, a chunked prefill's later chunks), fresh prompts
and shared-prefix groups in one batch, every head dim of the common models (64, 80, 96, 128,
256), on every ISA level this host runs (``RADIXKV_ISA``'s levels; the others are compiled by
tests/test_native_f32.py's ``test_each_isa_level_compiles``).

The window is transformers' (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W``,
with the causal ``kv_idx <= q_idx``): the query at position ``p`` sees keys ``p - W + 1 .. p``.
"""

from __future__ import annotations

import pytest
import torch
from native_pages import BF16_MAX_ERR, BF16_MEAN_ERR, Case, bf16_case

from radixkv.model import native

HEAD_DIMS = [64, 80, 96, 128, 256]
# fresh prompts, decodes, extends after a cached prefix (a chunked prefill's second chunk, a
# cache hit mid-prompt), all longer than the windows below; lengths on and off page boundaries
WINDOWED = [(0, 150), (300, 1), (77, 1), (130, 40), (16, 1), (0, 5), (200, 70), (64, 64)]
WINDOWS = [1, 7, 64, 100]


def poison_outside_windows(case, window):
    """NaN in every page that lies wholly before the window of each request's first new token
    (so outside every window of the request): a kernel that read one of them for a windowed
    layer would return NaN. Returns how many pages were poisoned."""
    page = case.k_cache.shape[1]
    poisoned = 0
    for b, p in enumerate(case.prefix):
        first_key = max(0, p - window + 1)
        for i in range(first_key // page):
            pid = int(case.table[b, i])
            if any(
                int(case.table[o, j]) == pid
                for o in range(len(case.prefix))
                for j in range(-(-(case.prefix[o] + case.ext[o]) // page))
                if o != b and j >= max(0, case.prefix[o] - window + 1) // page
            ):
                continue  # another request's window still reads it (a shared page)
            case.k_cache[pid] = float("nan")
            case.v_cache[pid] = float("nan")
            poisoned += 1
    return poisoned


def level_module(level):
    missing = native.missing_instructions(level)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the {level} build cannot run here")
    m = native.load(level)
    assert m is not None and m.kernel_isa() == level, native.build_error()
    return m


@pytest.mark.parametrize("level", native.ISAS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_f32_kernel_windows_match_float64(level, d):
    """Every window, a mixed batch (prefills, decodes, extends), GQA, float32 and bf16 pages,
    page sizes 1 and 16: within the float32 kernel's bounds of tests/test_native_f32.py."""
    m = level_module(level)
    for page, dtype, hq, hkv in ((16, torch.float32, 8, 2), (1, torch.bfloat16, 9, 3)):
        case = Case(page, hq, hkv, d, WINDOWED, dtype=dtype, seed=d + page)
        tol = 2e-5 if dtype == torch.float32 else 5e-5
        for window in WINDOWS:
            got = case.run([], m, window)
            err = (got.double() - case.reference(window)).abs().max().item()
            assert err < tol, (level, d, page, dtype, window, err)


@pytest.mark.parametrize("level", native.ISAS)
def test_f32_kernel_window_with_shared_prefix_groups(level):
    """Grouped requests (decodes and short extends on one shared prefix, rows stacked in the
    tiled path) under windows that start before, inside and past the shared part: each row
    sees only its window of the shared keys, and the grouped answer is the ungrouped one."""
    m = level_module(level)
    shared = 130
    reqs = [(shared + 9 * b, 1 + (b % 3) * 5) for b in range(24)] + [(0, 40), (400, 1)]
    case = Case(16, 9, 3, 64, reqs, groups=[(range(24), shared)], seed=4)
    for window in (8, 64, 150, 250, 10_000):
        grouped = case.run(module=m, window=window)
        ref = case.reference(window)
        assert (grouped.double() - ref).abs().max().item() < 2e-5, window
        assert (grouped - case.run([], m, window)).abs().max().item() < 2e-5, window


@pytest.mark.parametrize("level", native.ISAS)
@pytest.mark.parametrize("d", [64, 96, 256])
def test_f32_kernel_reads_no_page_outside_the_windows(level, d):
    """Pages wholly outside every window are never read: NaN there leaves every output finite
    and equal to the oracle over the window (full attention would read them and return NaN)."""
    m = level_module(level)
    window = 40
    case = Case(16, 8, 2, d, WINDOWED, seed=d)
    ref = case.reference(window)  # before the poison: float64 0 * NaN is NaN
    assert poison_outside_windows(case, window) > 10
    got = case.run([], m, window)
    assert torch.isfinite(got).all()
    assert (got.double() - ref).abs().max().item() < 2e-5
    assert not torch.isfinite(case.run([], m, 0)).all()  # the control: full attention reads them


@pytest.mark.parametrize("level", native.ISAS)
def test_f32_kernel_window_past_the_context_is_full_attention(level):
    m = level_module(level)
    case = Case(16, 8, 2, 64, WINDOWED, seed=2)
    full = case.run([], m, 0)
    assert torch.equal(case.run([], m, 471), full)  # the longest request: 470 keys
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        case.run([], m, -1)


@pytest.mark.parametrize("level", native.ISAS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_bf16_kernel_windows_match_float64(level, d):
    """The bf16 kernel (its AVX512-BF16 path where the level has it and the head dim is fast,
    else the portable path) under every window, with the bounds of tests/test_native.py."""
    m = level_module(level)
    case = bf16_case(16, 9, 3, d, WINDOWED, seed=d)
    for window in WINDOWS:
        got = case.run_bf16(m, [], window)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        err = (got.double() - case.reference(window)).abs()
        assert err.max().item() < BF16_MAX_ERR, (level, d, window, err.max().item())
        assert err.mean().item() < BF16_MEAN_ERR, (level, d, window, err.mean().item())


@pytest.mark.parametrize("level", native.ISAS)
def test_bf16_kernel_window_with_groups_and_poisoned_pages(level):
    """Grouped rows under a window (phase A's rows see their window's part of the shared keys,
    or none), and no page outside every window read (NaN there stays out of the output)."""
    m = level_module(level)
    shared = 130
    reqs = [(shared + 9 * b, 1 + (b % 3) * 5) for b in range(12)] + [(0, 40), (400, 1)]
    for window in (8, 64, 150):
        case = bf16_case(16, 9, 3, 128, reqs, [(range(12), shared)], seed=window)
        ref = case.reference(window)
        poison_outside_windows(case, window)
        got = case.run_bf16(m, window=window)
        assert torch.isfinite(got).all(), window
        err = (got.double() - ref).abs()
        assert err.max().item() < BF16_MAX_ERR and err.mean().item() < BF16_MEAN_ERR, (
            window,
            err.max(),
        )
