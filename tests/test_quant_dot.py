"""radixkv's int8-activation GEMM over GGML block-quantized weights
(radixkv/model/csrc/cpu_quant_dot.cpp: ``quant_gemm_q8_into``) against float64 oracles, on every
ISA level this host runs (the AVX2 maddubs path and the portable build's scalar integer dots).

Two oracles, both over ``Wdeq = gguf.quants.dequantize(w)``:

* the model's own product ``y64 = x.double() @ Wdeq.double().T``, within the bound derived in
  cpu_quant_dot.cpp's header: ``sum_b (d_b / 2) sum_{k in b} |w_k|`` (x's quantization to int8,
  d_b = amax_b / 127 its block's scale) ``+ K eps32 sum_k mu_k (|x_k| + d_b / 2)`` (float32
  sums; ``mu_k = |d_w c_k| + |m_w|`` the size of the weight's decomposition, ``|w_k|`` for Q8_0
  and Q4_0). This is the contract a model on this path is held to.
* the product of x's quantized rows ``xhat = d_b q_k`` (quantized here in numpy as the kernel
  does: ``rint(x / d)`` in float32, half to even) with ``Wdeq``, within the float32 summation
  bound alone ``K eps32 sum_k mu_k |xhat_k|``: a wrong scale, code or block mapping moves an
  output by about ``|y| / K`` or more, far above that, so this check is the one with teeth (the
  first bound is worst-case in the quantization errors' signs and is loose by ~sqrt(K)).

With two terms (``terms=2``) x's rows are ``d1 q1 + d2 q2``, the second term the quantization of
what the first leaves (``x - d1 q1``, float32): the same two checks with ``xhat`` the two terms'
sum and ``d_b`` the second term's scale (``<= d1 / 254``, so x's error is ~254x int8's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from radixkv.model import native
from tests.test_quant_gemm import EPS32, dequantized, level_module, module, random_rows

__all__ = ["module"]  # the native module fixture, shared with test_quant_gemm

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's per-32-block scales ``d`` [M, K / 32] (float32 ``amax / 127``) and its quantized
    values ``d q`` [M, K] (float64), as the kernel computes them."""
    xs = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xs).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] > 0, np.rint(xs / d[..., None]), 0).clip(-127, 127)
    xhat = q.astype(np.float64) * d[..., None].astype(np.float64)
    return torch.from_numpy(d), torch.from_numpy(xhat.reshape(x.shape))


def magnitude(w: np.ndarray, qtype: T) -> torch.Tensor:
    """``mu_k = |d_w c_k| + |m_w|`` per weight (float64 [N, K]): Q4_1's rows dequantized with
    both fp16 fields' sign bits cleared; ``|Wdeq|`` for the signed-code formats."""
    if qtype != T.Q4_1:
        return dequantized(w, qtype).double().abs()
    n = w.shape[0]
    blocks = w.reshape(n, -1, 20).copy()
    blocks[:, :, 1] &= 0x7F
    blocks[:, :, 3] &= 0x7F
    return dequantized(blocks.reshape(n, -1), qtype).double()


def quantize_x2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two terms: the second term's scales and both terms' sum ``d1 q1 + d2 q2`` (float64)."""
    _, xhat1 = quantize_x(x)
    d2, xhat2 = quantize_x((x.double() - xhat1).float())  # x - d1 q1, rounded once to float32
    return d2, xhat1 + xhat2


def check(
    y: torch.Tensor, x: torch.Tensor, w: np.ndarray, qtype: T, what: str, terms: int = 1
) -> None:
    """``y`` against both oracles of the module docstring."""
    k = x.shape[1]
    wd = dequantized(w, qtype).double()
    mu = magnitude(w, qtype)
    d, xhat = quantize_x(x) if terms == 1 else quantize_x2(x)
    half_d = torch.repeat_interleave(d.double() / 2, 32, dim=1)
    ref = x.double() @ wd.T
    bound = half_d @ wd.abs().T + k * EPS32 * ((x.double().abs() + half_d) @ mu.T)
    err = (y.double() - ref).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds the int8-activation bound by {worst:.3g}"
    tight = (y.double() - xhat @ wd.T).abs() - k * EPS32 * (xhat.abs() @ mu.T)
    assert tight.max().item() <= 0, f"{what}: off the quantized rows' product by {tight.max():.3g}"


def rows_of_x(m: int, k: int, seed: int) -> torch.Tensor:
    """Normal rows with a few large outliers (a block's amax far above its other values, as
    activations have) and one all-zero block (scale 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 7] *= 40.0
    x[0, 32:64] = 0.0
    return x


def test_types(module):
    assert sorted(module.quant_dot_types()) == [2, 3, 8]
    assert module.quant_dot_max_rows() == 8


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("level", native.ISAS)
def test_within_the_int8_activation_bound(level, qtype):
    m = level_module(level)
    for k in (256, 576, 1536):
        for n in (8, 33, 192):
            w = random_rows(qtype, n, k, seed=k + n + int(qtype))
            wt = torch.from_numpy(w)
            for rows in (1, 2, 3, 5, 8):
                x = rows_of_x(rows, k, seed=k * rows + n)
                y = torch.full((rows, n), float("nan"))
                m.quant_gemm_q8_into(x, wt, int(qtype), y)
                check(y, x, w, qtype, f"{level} {qtype.name} M={rows} N={n} K={k}")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("level", native.ISAS)
def test_two_terms_within_their_bound(level, qtype):
    """terms=2 at 1-4 rows: within the two-term bounds, and its error against the float64
    product at most a tenth of one term's on the same rows (the second term is used; not
    1/254: on some random rows the float32 sums' own error is the larger part)."""
    m = level_module(level)
    for k in (256, 576, 1536):
        for n in (8, 33, 192):
            w = random_rows(qtype, n, k, seed=k + n + int(qtype))
            wt = torch.from_numpy(w)
            ref = None
            for rows in (1, 2, 3, 4):
                x = rows_of_x(rows, k, seed=k * rows + n)
                y = {}
                for terms in (1, 2):
                    y[terms] = torch.full((rows, n), float("nan"))
                    m.quant_gemm_q8_into(x, wt, int(qtype), y[terms], terms)
                what = f"{level} {qtype.name} two terms M={rows} N={n} K={k}"
                check(y[2], x, w, qtype, what, terms=2)
                ref = x.double() @ dequantized(w, qtype).double().T
                one, two = ((y[t].double() - ref).abs().max().item() for t in (1, 2))
                assert two <= one / 10, f"{what}: error {two:.3g}, one term's {one:.3g}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_from_ggufs_quantizer(module, qtype):
    """Rows as gguf-py's quantizer writes them (the files' own encoder), not only random bytes."""
    rng = np.random.default_rng(int(qtype))
    w = quants.quantize(rng.standard_normal((40, 576)).astype(np.float32), qtype)
    x = rows_of_x(3, 576, seed=5)
    y = torch.empty(3, 40)
    module.quant_gemm_q8_into(x, torch.from_numpy(w), int(qtype), y)
    check(y, x, w, qtype, "gguf-py rows")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_out_slice_of_a_wider_tensor(module, rows, qtype):
    """Writes out[:, :N] through out's row stride and leaves other columns alone; the result does
    not depend on the thread count (workers own whole groups of 8 output rows, the 33rd row
    alone)."""
    w = random_rows(qtype, 33, 512, seed=1)
    wt = torch.from_numpy(w)
    x = rows_of_x(rows, 512, seed=2)
    wide = torch.full((rows, 50), 7.0)
    module.quant_gemm_q8_into(x, wt, int(qtype), wide[:, 5:38])
    assert (wide[:, :5] == 7).all() and (wide[:, 38:] == 7).all()
    check(wide[:, 5:38], x, w, qtype, "slice")
    threads = torch.get_num_threads()
    one = torch.empty(rows, 33)
    try:
        torch.set_num_threads(1)
        module.quant_gemm_q8_into(x, wt, int(qtype), one)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, wide[:, 5:38])


def test_bad_inputs_raise_naming_the_problem(module):
    q41 = torch.from_numpy(random_rows(T.Q4_1, 8, 64, seed=4))  # 2 blocks: 40 bytes a row
    x = torch.randn(2, 64)
    out = torch.empty(2, 8)
    call = module.quant_gemm_q8_into
    cases = [
        (lambda: call(x, q41, 12, out), "GGML type 12 is not supported"),
        (lambda: call(x, q41[:, :39].contiguous(), 3, out), "whole blocks of 20 bytes"),
        (lambda: call(torch.randn(2, 96), q41, 3, out), "x has K = 96 inputs"),
        (lambda: call(x.bfloat16(), q41, 3, out), "float32"),
        (lambda: call(torch.randn(64, 2).T, q41, 3, out), "x must be contiguous"),
        (lambda: call(torch.randn(9, 64), q41, 3, torch.empty(9, 8)), "at most 8 rows"),
        (lambda: call(torch.randn(5, 64), q41, 3, torch.empty(5, 8), 2), "at most 4 rows"),
        (lambda: call(x, q41, 3, out, 3), "terms is 1"),
        (lambda: call(x, q41.float(), 3, out), "uint8"),
        (lambda: call(x, q41, 3, torch.empty(2, 7)), "out must be [M, >= N]"),
        (lambda: call(x, q41, 3, out.bfloat16()), "out must be float32"),
        (lambda: call(x, q41, 3, torch.empty(8, 2).T), "last stride"),
    ]
    for fn, message in cases:
        with pytest.raises(RuntimeError, match=message.replace("[", r"\[")):
            fn()
    call(x[:0], q41, 3, out[:0])  # no rows: nothing to do
