"""The float32-math native paged-attention kernel with shared-prefix groups
(radixkv/model/csrc/cpu_attention_f32.cpp), its backend, and the per-ISA builds, against torch
oracles. The host's own ISA level is always tested; levels it cannot run are skipped naming the
missing instructions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from native_pages import Case
from oracle import FP32, check_rows

from radixkv.model import native
from radixkv.model.attention.base import ForwardBatch
from radixkv.model.attention.native_backend import (
    NATIVE_MAX_GROUPED_EXTEND,
    NativeAttentionBackend,
    NativeCascadeBackend,
    native_paged_attention_f32,
)
from radixkv.model.attention.prefix_groups import PrefixGroup, shared_prefix_groups
from radixkv.model.runner import ModelRunner, RequestSlice


@pytest.fixture(scope="module")
def module():
    m = native.load()
    # the host path is never skipped: a build failure is a defect to see
    assert m is not None, f"native kernels failed to build: {native.build_error()}"
    return m


# fresh prompts, decodes, extends after a cached prefix; lengths on and off page boundaries
MIXED = [(0, 37), (100, 1), (63, 5), (16, 1), (0, 1), (200, 70), (5, 130), (64, 64)]
TOL = {torch.float32: 2e-5, torch.bfloat16: 5e-5, torch.float16: 5e-5}


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("d", [64, 128, 80])  # 80: the generic (non-tiled) path
def test_mixed_batch_matches_oracle(module, page, hq, hkv, d):
    case = Case(page, hq, hkv, d, MIXED, seed=page + hq + d)
    out = case.run()
    assert out.dtype == torch.float32 and out.shape == case.q.shape
    err = (out.double() - case.reference()).abs().max().item()
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 80])
def test_half_precision_pages(module, dtype, d):
    """bf16/fp16 pages are converted in registers: the result is the float32 attention over the
    rounded K/V (the oracle reads the same rounded values)."""
    reqs = [(40, 1), (40, 9), (0, 20), (130, 1)]
    case = Case(16, 9, 3, d, reqs, groups=[([0, 1, 3], 40)], dtype=dtype, seed=3)
    err = (case.run().double() - case.reference()).abs().max().item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("size", [2, 5, 64])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_shared_group_equals_ungrouped_and_oracle(module, size, page):
    shared = 130  # mid-page for 16 and 64
    reqs = [(shared + 7 * b % 23, 1 + (b % 3) * 4) for b in range(size)]
    case = Case(page, 9, 3, 64, reqs, groups=[(range(size), shared)], seed=size + page)
    grouped, plain = case.run(), case.run(groups=[])
    ref = case.reference()
    assert (grouped.double() - ref).abs().max().item() < 2e-5
    assert (grouped - plain).abs().max().item() < 2e-5


def test_single_member_group_is_exact(module):
    case = Case(16, 8, 2, 128, [(70, 3)], groups=[([0], 64)], seed=11)
    assert (case.run().double() - case.reference()).abs().max().item() < 2e-5


def test_long_shared_prefix_decode_burst(module):
    """The W1 shape in small: many decodes over a 1,024-token shared prefix (16 key blocks of the
    online softmax, row blocks split across work items) plus each request's own suffix."""
    reqs = [(1024 + 20 + b, 1) for b in range(48)]
    case = Case(16, 9, 3, 64, reqs, groups=[(range(48), 1024)], seed=5)
    assert (case.run().double() - case.reference()).abs().max().item() < 2e-5


# decodes and short extends over key counts around the vector width (8 and 16 lanes) and the
# 64-key block: the few-rows path scores VW keys at a time and masks the rest of the last group
FEW_ROWS = [(0, 1), (6, 1), (7, 1), (8, 1), (14, 1), (15, 1), (16, 1), (31, 2), (62, 1), (63, 1)]
FEW_ROWS += [(64, 1), (70, 3), (100, 1), (127, 2), (128, 1), (200, 5)]


@pytest.mark.parametrize("level", native.ISAS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 2), (4, 4)])
def test_few_rows_match_the_oracle_on_every_level(level, d, hq, hkv):
    """The few-rows path (a decode's query heads of one KV head: scores as dot products with K's
    rows, VW keys' lane sums at a time) of each ISA build this host runs, against float64, over
    float32 and bf16 pages, with and without a shared-prefix group."""
    missing = native.missing_instructions(level)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the {level} build cannot run here")
    m = native.load(level)
    assert m is not None and m.kernel_isa() == level, native.build_error()
    groups = [([6, 7, 8, 9, 10, 11, 12, 15], 16)]
    for dtype in (torch.float32, torch.bfloat16):
        case = Case(16, hq, hkv, d, FEW_ROWS, groups=groups, dtype=dtype, seed=d + hq)
        ref = case.reference()
        for gr in (None, []):
            err = (case.run(gr, m).double() - ref).abs().max().item()
            assert err < TOL[dtype], (level, dtype, gr is None, err)


def test_two_groups_and_ungrouped_requests(module):
    reqs = [(96, 1), (96, 4), (50, 1), (200, 1), (210, 12), (0, 9), (33, 2)]
    groups = [([0, 1], 96), ([3, 4, 6], 33)]
    # request 6's prefix is only 33 tokens: the shared part may be all of it
    case = Case(16, 9, 3, 64, reqs, groups=groups, seed=8)
    assert (case.run().double() - case.reference()).abs().max().item() < 2e-5


@pytest.mark.parametrize(
    "members, new",
    [(50, 1), (64, 1), (43, 1), (5, 40), (3, 47)],
    ids=["150-rows", "192-rows", "129-rows", "600-rows", "423-rows"],
)
def test_a_groups_rows_split_into_several_items(module, members, new):
    """A group's stacked rows (members x new tokens x 3 query heads a KV head) past one work
    item's 128 split into several equal items on token boundaries (decodes of a batch-64 burst,
    prefill chunks over a shared prefix), every row attending to the whole shared part once."""
    reqs = [(100 + 3 * i, new) for i in range(members)]
    case = Case(16, 9, 3, 64, reqs, groups=[(list(range(members)), 96)], seed=members + new)
    out = case.run()
    assert (out.double() - case.reference()).abs().max().item() < 2e-5
    assert (out - case.run(groups=[])).abs().max().item() < 2e-5


def test_fork_copy_on_write_tables(module):
    """Forked children share the parent's full pages; each has its own copy of the partial last
    page (copy-on-write) with different new tokens, then its own suffix."""
    page = 16
    case = Case(page, 9, 3, 64, [(40, 1), (40, 1), (40, 1)], groups=[([0, 1, 2], 32)], seed=9)
    parent_last = int(case.table[0, 2])
    for b in (1, 2):  # the copied partial page: same first 8 tokens, then each child's own
        child = int(case.table[b, 2])
        for cache in (case.k_cache, case.v_cache):
            cache[child, :8] = cache[parent_last, :8]
    out = case.run()
    assert (out.double() - case.reference()).abs().max().item() < 2e-5
    assert (out - case.run(groups=[])).abs().max().item() < 2e-5


def test_peaked_scores_stay_finite(module):
    case = Case(16, 4, 4, 64, [(300, 2), (300, 1)], groups=[([0, 1], 288)], seed=1)
    case.q *= 40
    out = case.run()
    assert torch.isfinite(out).all()
    assert (out.double() - case.reference()).abs().max().item() < 1e-4


def test_bad_inputs_raise_clear_errors(module):
    case = Case(16, 4, 4, 64, [(40, 1), (40, 1), (20, 1)], groups=[([0, 1], 32)], seed=2)
    with pytest.raises(RuntimeError, match="do not share"):
        case.run(groups=[PrefixGroup([0, 2], 16)])
    with pytest.raises(RuntimeError, match="two groups"):
        case.run(groups=[PrefixGroup([0, 1], 32), PrefixGroup([1], 16)])
    with pytest.raises(RuntimeError, match="shorter than the shared part"):
        case.run(groups=[PrefixGroup([0, 1], 48)])
    bad = case.table.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="outside the pool"):
        native_paged_attention_f32(
            case.q, case.k_cache, case.v_cache, bad, case.prefix, case.ext, case.starts, 0.1
        )
    with pytest.raises(RuntimeError, match="dtypes differ"):
        native_paged_attention_f32(
            case.q,
            case.k_cache,
            case.v_cache.half(),
            case.table,
            case.prefix,
            case.ext,
            case.starts,
            0.1,
        )
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        native_paged_attention_f32(
            case.q,
            case.k_cache.double(),
            case.v_cache.double(),
            case.table,
            case.prefix,
            case.ext,
            case.starts,
            0.1,
        )
    # the wrapper casts q to float32; the kernel itself rejects any other dtype
    for dtype in (torch.float64, torch.bfloat16):
        with pytest.raises(RuntimeError, match="q must be float32"):
            module.paged_attention_f32(
                case.q.to(dtype),
                case.k_cache,
                case.v_cache,
                case.table,
                case.prefix,
                case.ext,
                case.starts,
                0.1,
                [],
                [],
                [],
            )


# -- prefix groups ------------------------------------------------------------------------------


def test_shared_prefix_groups():
    pages = [
        [1, 2, 3, 4],  # 0: group with 1 (3 common pages) and 4
        [1, 2, 3, 9],
        [5, 6, 7],  # 2: alone on its first page
        [1, 2, 3, 4],  # 3: no new tokens -> not a member
        [1, 2, 8],  # 4: limits the group to 2 pages
        [10, 11],  # 5, 6: prefix below min_tokens
        [10, 11],
    ]
    prefix = [64, 60, 48, 64, 40, 15, 15]
    ext = [1, 3, 1, 0, 1, 1, 1]
    groups = shared_prefix_groups(pages, prefix, ext, 16, min_tokens=16)
    assert groups == [PrefixGroup([0, 1, 4], 32)]
    for grp in groups:  # the invariants the kernels rely on
        assert grp.shared % 16 == 0 and all(prefix[i] >= grp.shared for i in grp.members)
        assert len({tuple(pages[i][: grp.shared // 16]) for i in grp.members}) == 1
    # request 4's 40-token prefix is below 48: without it, 0 and 1 share 3 pages (request 1's
    # 60-token prefix caps it at 3 whole pages)
    assert shared_prefix_groups(pages, prefix, ext, 16, min_tokens=48) == [PrefixGroup([0, 1], 48)]
    assert shared_prefix_groups(pages, prefix, ext, 16, min_tokens=64) == []  # a singleton
    # request 1's 3 new tokens are over max_extend=2: 0 and 4 share 2 pages
    assert shared_prefix_groups(pages, prefix, ext, 16, 16, max_extend=2) == [
        PrefixGroup([0, 4], 32)
    ]


# -- the backend inside the model -----------------------------------------------------------------


def test_backend_in_model_matches_plain_fp32(tiny_llama, tiny_oracle, monkeypatch):
    """Whole-model fp32 logits of steps with a shared prefix: the native backend (groups in use)
    and the plain backend (transformers' arithmetic), each within the float32 contract of the
    float64 oracle (tests/oracle.py)."""
    page = 16
    runner = ModelRunner(tiny_llama, num_pages=64, page_size=page, dtype=torch.float32)
    assert isinstance(runner.backend, NativeCascadeBackend)
    monkeypatch.setenv("RADIXKV_FP32_ATTENTION", "plain")
    plain = ModelRunner(tiny_llama, num_pages=64, page_size=page, dtype=torch.float32)
    assert not isinstance(plain.backend, NativeCascadeBackend)
    system = [(7 * i) % 200 + 3 for i in range(70)]
    shared_pages = [1, 2, 3, 4, 5]
    first = [RequestSlice(system, 0, shared_pages)]
    users = [list(range(10 + i, 26 + i)) for i in range(3)]  # 16 new tokens: grouped
    own = [[6, 7], [8, 9], [10, 11]]
    second = [RequestSlice(u, 64, shared_pages[:4] + o) for u, o in zip(users, own)]
    batch = runner.build_batch(second)
    meta = runner.backend.prepare(batch, torch.float32)
    assert meta.groups == [PrefixGroup([0, 1, 2], 64)]
    seqs = [system] + [system[:64] + u for u in users]
    truth, refs = tiny_oracle.last_rows(seqs, torch.float32)
    for label, r in (("native-groups", runner), ("plain", plain)):
        got = torch.cat([r.forward(r.build_batch(step)) for step in (first, second)])
        check_rows(got, truth, refs, FP32, label, "last logits")


def test_prepare_without_groups_on_fresh_prompts(module):
    batch = ForwardBatch(
        input_ids=torch.zeros(5, dtype=torch.long),
        positions=torch.arange(5),
        extend_lens=[3, 2],
        prefix_lens=[0, 0],
        page_table=torch.tensor([[1], [2]], dtype=torch.int32),
        out_slots=torch.arange(5),
        page_size=16,
    )
    assert NativeCascadeBackend().prepare(batch, torch.float32).groups == []


def test_prepare_groups_decodes_and_short_extends_but_not_long_ones(module):
    """Requests with more than NATIVE_MAX_GROUPED_EXTEND new tokens attend per request (their
    rows fill the tiles; the group's split would cost more than the prefix read it saves)."""
    for ext, grouped in ((1, True), (NATIVE_MAX_GROUPED_EXTEND, True), (17, False), (64, False)):
        batch = ForwardBatch(
            input_ids=torch.zeros(2 * ext, dtype=torch.long),
            positions=torch.arange(2 * ext),
            extend_lens=[ext, ext],
            prefix_lens=[32, 32],
            page_table=torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 9, 10]], dtype=torch.int32),
            out_slots=torch.arange(2 * ext),
            page_size=16,
        )
        want = [PrefixGroup([0, 1], 32)] if grouped else []
        for backend in (NativeAttentionBackend(), NativeCascadeBackend()):
            assert backend.prepare(batch, torch.float32).groups == want, (ext, backend)


# -- ISA levels -----------------------------------------------------------------------------------

PROBE = textwrap.dedent(
    """
    import torch
    from radixkv.model import native
    from radixkv.model.attention.native_backend import native_paged_attention_f32
    from radixkv.model.attention.prefix_groups import PrefixGroup
    m = native.load()
    assert m is not None, native.build_error()
    assert native.kernel_isa() == m.kernel_isa() == {level!r}, (native.kernel_isa(), m.kernel_isa())
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 16, 2, 64, generator=g), torch.randn(6, 16, 2, 64, generator=g)
    table = torch.tensor([[0, 1, 2], [0, 1, 3]], dtype=torch.int32)
    q = torch.randn(2, 4, 64, generator=g)
    out = native_paged_attention_f32(q, kc, vc, table, [40, 35], [1, 1], [0, 1], 0.125,
                                     [PrefixGroup([0, 1], 32)])
    for b, n in enumerate((41, 36)):
        pages = table[b].long()
        k = kc[pages].reshape(-1, 2, 64)[:n].repeat_interleave(2, 1)
        v = vc[pages].reshape(-1, 2, 64)[:n].repeat_interleave(2, 1)
        p = (torch.einsum("hd,khd->hk", q[b], k) * 0.125).softmax(-1)
        ref = torch.einsum("hk,khd->hd", p, v)
        assert (out[b] - ref).abs().max() < 1e-5
    print("OK", m.kernel_isa())
    """
)


@pytest.mark.parametrize("level", native.ISAS)
def test_each_isa_level_builds_and_matches(level):
    missing = native.missing_instructions(level)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the {level} build cannot run here")
    env = dict(os.environ, RADIXKV_ISA=level)
    res = subprocess.run(
        [sys.executable, "-c", PROBE.format(level=level)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0 and f"OK {level}" in res.stdout, res.stderr[-3000:]


def test_host_level_is_runnable_and_loaded(module):
    level = native.host_isa()
    assert native.missing_instructions(level) == []
    assert native.kernel_isa() in native.ISAS
    assert native.ISAS.index(native.kernel_isa()) >= native.ISAS.index(level)


def test_forcing_a_level_the_host_lacks_names_the_flags(monkeypatch):
    from radixkv.model import host_cpu

    monkeypatch.setattr(host_cpu, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv("RADIXKV_ISA", "avx512_bf16")
    with pytest.raises(ValueError, match="avx512f.*avx512bw.*avx512_bf16"):
        native._target_isa()
    monkeypatch.setenv("RADIXKV_ISA", "sse9")
    with pytest.raises(ValueError, match="unknown ISA"):
        native._target_isa()


def test_build_names_are_keyed_by_level():
    names = {level: native._build_name(level) for level in native.ISAS}
    assert len(set(names.values())) == len(native.ISAS)
    for level, name in names.items():
        assert name.startswith(f"radixkv_cpu_{level}_")


@pytest.mark.parametrize("level", native.ISAS)
def test_each_isa_level_compiles(level, tmp_path):
    """The kernel sources compile with the flags of every level this host cannot run (a compile
    error there would silently drop such hosts to the pure-torch paths). Levels the host runs are
    built and run by test_each_isa_level_builds_and_matches."""
    import shutil
    import sysconfig

    from torch.utils import cpp_extension

    if not native.missing_instructions(level):
        pytest.skip(f"{level} runs here: built and run by test_each_isa_level_builds_and_matches")
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler, "no C++ compiler on this host"
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(native._CSRC)]
    # bindings.cpp has no ISA-specific code
    sources = [src for src in native._SOURCES if src.name != "bindings.cpp"]
    procs = [
        (
            src,
            subprocess.Popen(
                [
                    compiler,
                    "-fsyntax-only",
                    "-std=c++20",
                    "-fopenmp",
                    *native.ISA_FLAGS[level],
                    f"-DRADIXKV_ISA_NAME={level}",
                    *(f"-I{path}" for path in includes),
                    str(src),
                ],
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp_path,
            ),
        )
        for src in sources
    ]
    for src, proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{src.name} for {level}:\n{err[-3000:]}"
