"""radixkv's GEMM over GGML block-quantized weights (radixkv/model/csrc/cpu_quant_linear.cpp:
``quant_gemm``, ``quant_gemm_into``, ``quant_dequantize_rows``) against a float64 oracle, on
every ISA level this host runs (the register-decode AVX2 path for up to 8 rows, the panel path
above, and the portable build's scalar decoding).

The oracle is ``x.double() @ Wdeq.double().T`` with ``Wdeq = gguf.quants.dequantize(w)``, the
weight GGML itself would use. The kernel decodes each weight to exactly that float32 value (its
fused decode rounds products that are exact in float32, see the module's header), so the only
error is float32 summation: for a sum of K products in any order, each product and each partial
sum rounded once, ``|err| <= K * eps32 * sum_k |x_k w_k|`` (Higham's gamma_K bound, first order);
the tests allow twice that. A bf16 result is that sum rounded once more, ``|y| * 2^-9``; the
tests allow ``|y| * 2^-8``. One wrong weight moves an output by ``|x_k w_k|``, about
``sum / K``, which is above ``2 K eps32 sum`` for every K here (K <= 1536: 2 K eps32 < 1 / K),
so a decoding error cannot hide under the bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from radixkv.model import native

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K]
# byte offsets of each block's fp16 scale fields (the rest of a block is any bytes)
FP16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q6_K: [208]}
EPS32 = float(np.finfo(np.float32).eps)


def random_rows(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    """``n`` random valid rows of ``k`` weights in ``qtype``: every quant byte random (any nibble,
    any 6-bit scale, any sign), the fp16 scales finite, from 1e-5 (subnormal) to 0.1, either
    sign."""
    block, size = quants.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        mag = 10.0 ** rng.uniform(-5, -1, size=(n, k // block))
        d = (mag * rng.choice([-1.0, 1.0], size=mag.shape)).astype(np.float16)
        raw[:, :, off : off + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, k // block * size)


def dequantized(w: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(w, qtype).astype(np.float32))


def check(y: torch.Tensor, x: torch.Tensor, wdeq: torch.Tensor, what: str) -> None:
    """``y`` against the float64 oracle within the float32 summation bound (module docstring)."""
    xd, wd = x.double(), wdeq.double()
    ref = xd @ wd.T
    bound = 2 * x.shape[1] * EPS32 * (xd.abs() @ wd.abs().T)
    if y.dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8
    err = (y.double() - ref).abs()
    worst = (err - bound).max().item() if err.numel() else -1.0
    assert worst <= 0, f"{what}: error exceeds the float32 bound by {worst:.3g}"


def level_module(level: str):
    missing = native.missing_instructions(level)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the {level} build cannot run here")
    m = native.load(level)
    assert m is not None, native.build_error()
    assert m.kernel_isa() == level
    return m


@pytest.fixture(scope="module")
def module():
    m = native.load()
    assert m is not None, f"native kernels failed to build: {native.build_error()}"
    return m


def test_types(module):
    assert sorted(module.quant_gemm_types()) == [2, 3, 8, 12, 14]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("level", native.ISAS)
def test_matches_float64_oracle(level, qtype, dtype):
    """Every row count (the decode path's 1-8, the panel path's 17, 64), widths on and off the
    workers' 4-row units, K of 1-48 blocks."""
    m = level_module(level)
    block = quants.GGML_QUANT_SIZES[qtype][0]
    ks = [k for k in (256, 512, 576, 1536) if k % block == 0]
    g = torch.Generator().manual_seed(int(qtype))
    for k in ks:
        for n in (8, 33, 192):
            w = random_rows(qtype, n, k, seed=k + n + int(qtype))
            wdeq = dequantized(w, qtype)
            wt = torch.from_numpy(w)
            for rows in (1, 2, 3, 5, 8, 17, 64):
                x = torch.randn(rows, k, generator=g).to(dtype)
                y = m.quant_gemm(x, wt, int(qtype))
                assert y.dtype == dtype and y.shape == (rows, n)
                check(y, x, wdeq, f"{level} {qtype.name} {dtype} M={rows} N={n} K={k}")


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_rows_from_ggufs_quantizer(module, qtype):
    """Rows as gguf-py's quantizer writes them (the files' own encoder), not only random bytes."""
    rng = np.random.default_rng(int(qtype))
    w = quants.quantize(rng.standard_normal((40, 576)).astype(np.float32), qtype)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5))
    check(module.quant_gemm(x, torch.from_numpy(w), int(qtype)), x, dequantized(w, qtype), "q")


@pytest.mark.parametrize("rows", [1, 4, 8, 17])
def test_out_slice_of_a_wider_tensor(module, rows):
    """quant_gemm_into writes out[:, :N] through out's row stride and leaves other columns alone;
    float32 out for bf16 rows is allowed; the result does not depend on the thread count."""
    w = torch.from_numpy(random_rows(T.Q4_1, 33, 512, seed=1))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    wide = torch.full((rows, 50), 7.0)
    module.quant_gemm_into(x, w, int(T.Q4_1), wide[:, 5:38])
    assert (wide[:, :5] == 7).all() and (wide[:, 38:] == 7).all()
    check(wide[:, 5:38], x, dequantized(w.numpy(), T.Q4_1), "slice")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = module.quant_gemm(x.float(), w, int(T.Q4_1))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, module.quant_gemm(x.float(), w, int(T.Q4_1)))
    assert torch.equal(one, wide[:, 5:38])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("level", native.ISAS)
def test_dequantize_rows_is_exact(level, qtype):
    m = level_module(level)
    w = random_rows(qtype, 20, 512, seed=3)
    full = dequantized(w, qtype)
    ids = torch.tensor([3, 0, 19, 3, 7], dtype=torch.int64)
    got = m.quant_dequantize_rows(torch.from_numpy(w), int(qtype), ids, torch.float32)
    assert torch.equal(got, full[ids])
    got16 = m.quant_dequantize_rows(torch.from_numpy(w), int(qtype), ids, torch.bfloat16)
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, full[ids].to(torch.bfloat16))
    none = m.quant_dequantize_rows(torch.from_numpy(w), int(qtype), ids[:0], torch.float32)
    assert none.shape == (0, 512)


def test_bad_inputs_raise_naming_the_problem(module):
    q41 = torch.from_numpy(random_rows(T.Q4_1, 8, 64, seed=4))  # 2 blocks: 40 bytes a row
    q4k = torch.from_numpy(random_rows(T.Q4_K, 8, 512, seed=4))
    x = torch.randn(2, 64)
    cases = [
        (lambda: module.quant_gemm(x, q41, 1), "GGML type 1 is not supported"),
        (lambda: module.quant_gemm(x, q41[:, :39].contiguous(), 3), "whole blocks of 20 bytes"),
        (lambda: module.quant_gemm(torch.randn(2, 96), q41, 3), "x has K = 96 inputs"),
        (lambda: module.quant_gemm(torch.randn(2, 128), q41[:, :36].contiguous(), 2), "K = 128"),
        (lambda: module.quant_gemm(torch.randn(2, 576), q4k, 12), "not a multiple of Q4_K"),
        (lambda: module.quant_gemm(x.half(), q41, 3), "float32 or bfloat16"),
        (lambda: module.quant_gemm(x, q41.float(), 3), "uint8"),
        (lambda: module.quant_gemm_into(x, q41, 3, torch.empty(2, 7)), "out must be [M, >= N]"),
        (lambda: module.quant_gemm_into(x, q41, 3, torch.empty(2, 8).half()), "x's dtype"),
        (lambda: module.quant_gemm_into(x, q41, 3, torch.empty(8, 2).T), "last stride"),
        (
            lambda: module.quant_dequantize_rows(q41, 3, torch.tensor([8]), torch.float32),
            "out of range",
        ),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message.replace("[", r"\[")):
            call()
