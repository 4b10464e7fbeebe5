"""AMX items of the bf16 native kernel (radixkv/model/csrc/cpu_attention.cpp, run_item_amx):
on hosts whose oneDNN packs bf16 for AMX, items with 16 or more query rows per KV head (prefill
and extend blocks, a group's stacked rows) run both products on AMX tiles. Checked against
the float64 oracle and against the vector path on the same calls, with groups whose phase A and
phase B run on different paths (the running state is handed over in the vector path's lane
order). Hosts without AMX check that it cannot be switched on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from native_pages import BF16_MAX_ERR, BF16_MEAN_ERR, bf16_case, bf16_errors

from radixkv.model import native


@pytest.fixture(scope="module")
def module():
    if "avx512_bf16" not in native.runnable_isas():
        pytest.skip("no AVX512-BF16 build on this host")
    m = native.load("avx512_bf16")
    assert m is not None, f"native kernels failed to build: {native.build_error()}"
    return m


@pytest.fixture
def amx(module):
    if not module.amx_attention_available():
        pytest.skip("this host has no AMX-BF16 (or no tile state for this process)")
    before = module.set_amx_attention(True)
    yield module
    module.set_amx_attention(before)


def both_paths(module, case, groups=None):
    """(AMX output, vector-path output, AMX items the first call ran)."""
    module.set_amx_attention(True)
    n0 = module.amx_attention_items()
    with_amx = case.run_bf16(module, groups)
    items = module.amx_attention_items() - n0
    module.set_amx_attention(False)
    vector = case.run_bf16(module, groups)
    module.set_amx_attention(True)
    return with_amx, vector, items


CASES = {
    # (prefix, extend) per request; groups: (members, shared tokens)
    "fresh prefills": ([(0, 300), (0, 17), (0, 700)], []),
    "extends on cached prefixes": ([(1000, 100), (37, 64), (255, 16)], []),
    "a burst on one prompt": ([(0, 832)] + [(768, 64)] * 6, []),
    "grouped decodes (phase A on AMX, B on vectors)": ([(130 + b, 1) for b in range(24)], [130]),
    "grouped extends (both phases on AMX)": ([(130 + 5 * b, 40) for b in range(6)], [130]),
    # 64-token items; a last block under 32 tokens joins the one before (73 = one item of 73,
    # 845 = 12 x 64 + 77), one of 32 or more stays its own (100 = 64 + 36)
    "70 grouped decodes (phase A's items: 64 + 6 members -> one of 70)": (
        [(130 + b % 7, 1) for b in range(70)],
        [130],
    ),
    "extends and a prefill with a short last block": (
        [(832, 73), (773, 72), (0, 845), (832, 100)],
        [],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("d", [64, 128])
def test_amx_items_match_the_oracle_and_the_vector_path(amx, name, page, d):
    reqs, shared = CASES[name]
    groups = [(range(len(reqs)), shared[0])] if shared else []
    case = bf16_case(page, 9, 3, d, reqs, groups, seed=len(name) + page + d)
    with_amx, vector, items = both_paths(amx, case)
    assert items > 0, "no item ran on AMX"
    a_max, a_mean = bf16_errors(with_amx, case)
    v_max, _ = bf16_errors(vector, case)
    assert a_max < BF16_MAX_ERR and a_mean < BF16_MEAN_ERR, (a_max, a_mean)
    assert a_max <= 1.5 * v_max + 1e-3, (a_max, v_max)


def test_decodes_alone_stay_on_the_vector_path(amx):
    """A decode's item has G = 3 rows per KV head: too few for a tile, never on AMX."""
    case = bf16_case(16, 9, 3, 64, [(200 + b, 1) for b in range(8)], [], seed=3)
    n0 = amx.amx_attention_items()
    case.run_bf16(amx)
    assert amx.amx_attention_items() == n0


def test_amx_cannot_be_switched_on_without_it(module):
    if module.amx_attention_available():
        assert module.set_amx_attention(True) in (True, False)
        return
    assert module.set_amx_attention(False) is False
    with pytest.raises(RuntimeError, match="no AMX-BF16"):
        module.set_amx_attention(True)


def test_quantized_pools_stay_on_the_vector_path(amx):
    """int8 pages keep the vector path (it reads the codes itself), and still compute the
    attention of their dequantized rows."""
    from radixkv.model.kv_quant import dequantize, quantize

    case = bf16_case(16, 9, 3, 64, [(0, 300), (100, 40)], [], seed=9)
    case.k_cache = quantize(case.k_cache, torch.int8)
    case.v_cache = quantize(case.v_cache, torch.int8)
    n0 = amx.amx_attention_items()
    out = case.run_bf16(amx)
    assert amx.amx_attention_items() == n0
    case.k_cache = dequantize(case.k_cache, torch.bfloat16)
    case.v_cache = dequantize(case.v_cache, torch.bfloat16)
    a_max, a_mean = bf16_errors(out, case)
    assert a_max < BF16_MAX_ERR and a_mean < BF16_MEAN_ERR, (a_max, a_mean)


def test_environment_switch_turns_amx_off_at_load(amx):
    """``RADIXKV_AMX_ATTENTION=0`` is read when the build is first loaded in a process."""
    code = (
        "from radixkv.model import native; m = native.load('avx512_bf16'); "
        "print(m.set_amx_attention(True))"
    )
    for env, before in (("0", "False"), ("1", "True")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "RADIXKV_AMX_ATTENTION": env},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip().splitlines()[-1] == before, (env, out.stdout, out.stderr)


def test_atens_own_amx_kernels_are_unharmed_by_the_tile_code(amx):
    """The tile code loads its own tile configuration on torch's worker threads and hands the
    tile state back through ATen's release (which also drops ATen's note of the configuration
    it loaded). ATen's own AMX users on those threads (bf16 SDPA, which runs brgemm on AMX hosts
    and configures its tiles per call, and oneDNN's bf16 linear) give the same bits before and
    after AMX attention ran."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 9, 200, 64, generator=g).bfloat16() for _ in range(3))
    x = torch.randn(77, 576, generator=g).bfloat16()
    w = torch.randn(1536, 576, generator=g).bfloat16()

    def aten_ops():
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return sdpa, torch.nn.functional.linear(x, w)

    before = aten_ops()
    case = bf16_case(16, 9, 3, 64, [(0, 300), (37, 64), (255, 100)], [], seed=11)
    for _ in range(3):
        n0 = amx.amx_attention_items()
        case.run_bf16(amx)
        assert amx.amx_attention_items() > n0
        after = aten_ops()
        for a, b in zip(before, after):
            assert torch.equal(a, b)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True
    )
    assert (before[0].double() - ref).abs().max() < 0.05
