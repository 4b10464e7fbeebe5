"""The native draw of the sampler's plain rows (``csrc/cpu_sample.cpp``) against a float64
inverse CDF, at every ISA level this host runs."""

from __future__ import annotations

import pytest
import torch

from radixkv.engine.sampler import Sampler, SequenceState
from radixkv.engine.sampling import SamplingParams
from radixkv.model import native

ISAS = native.runnable_isas()


def _module(isa: str):  # noqa: ANN202
    module = native.load(isa)
    if module is None:
        pytest.skip(f"the native {isa} build failed here: {native.build_error()}")
    return module


def _oracle(logits: torch.Tensor, inv_t: torch.Tensor, u: torch.Tensor):  # noqa: ANN202
    """Float64 weights' CDF per row, the target ``u * total`` and the inverse-CDF token."""
    x = logits.double()
    w = torch.exp((x - x.amax(-1, keepdim=True)) * inv_t.double()[:, None])
    cdf = w.cumsum(-1)
    target = u * cdf[:, -1]
    return cdf, target, torch.searchsorted(cdf, target[:, None], right=True)[:, 0]


@pytest.mark.parametrize("isa", ISAS)
def test_native_draw_is_the_float64_inverse_cdf(isa):
    """Every row's token is the float64 oracle's, unless the target lies within float32 rounding
    (1e-5 of the total) of the CDF boundary between the two tokens; rows with -inf logits, a vocab
    that is no multiple of the vector width, hot and cold temperatures, u = 0 and u near 1."""
    module = _module(isa)
    gen = torch.Generator().manual_seed(3)
    b, vocab = 96, 5003
    logits = torch.randn(b, vocab, generator=gen) * 4
    logits[0, 40:] = float("-inf")  # a row whose support is a prefix
    logits[1, :-1] = float("-inf")  # only the last token is possible
    logits[2, ::2] = float("-inf")
    inv_t = torch.empty(b).uniform_(0.3, 5.0, generator=gen)
    u = torch.rand(b, dtype=torch.float64, generator=gen)
    u[3], u[4] = 0.0, 1.0 - 2**-53
    got = module.sample_rows(logits, inv_t, u)
    cdf, target, want = _oracle(logits, inv_t, u)
    assert got[1] == vocab - 1 and got[0] < 40 and got[2] % 2 == 1
    assert bool(torch.isfinite(logits.gather(1, got[:, None])).all()), "drew a -inf logit"
    for row in (got != want).nonzero()[:, 0].tolist():
        lo, hi = sorted((int(got[row]), int(want[row])))
        boundary = cdf[row, lo:hi]
        gap = float((boundary - target[row]).abs().min())
        assert gap <= 1e-5 * float(cdf[row, -1]), (row, int(got[row]), int(want[row]), gap)
    assert int((got != want).sum()) <= 2  # boundary hits are rare, not the rule


@pytest.mark.parametrize("isa", ISAS)
def test_native_and_torch_draws_pick_the_same_tokens_for_the_same_seeds(isa):
    """Sampler(kernels=native) and Sampler(kernels=None) on 64 seeded rows of a real-sized
    vocabulary: the same tokens (both are the inverse CDF of the same uniforms), bar a float
    rounding at a CDF boundary, which a row at most may show."""
    module = _module(isa)
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(9)) * 3
    params = [SamplingParams(temperature=0.5 + (i % 4) * 0.5, seed=i) for i in range(64)]
    fast = Sampler(kernels=module).sample(logits, [SequenceState(p) for p in params]).token_ids
    slow = Sampler(kernels=None).sample(logits, [SequenceState(p) for p in params]).token_ids
    assert sum(a != b for a, b in zip(fast, slow)) <= 1, (fast, slow)
    assert len(set(fast)) > 32  # the rows really sample


@pytest.mark.parametrize("isa", ISAS)
def test_native_kernels_read_bf16_rows_as_their_float32_values(isa):
    """``sample_rows`` and ``argmax_rows`` on bf16 logits pick exactly what they pick on the
    float32 copy (the widening is exact), with -inf segments, ties and a vocab that is no multiple
    of the vector width; ``sample_rows`` leaves rows with a NaN, a +inf or nothing above -inf to
    its caller (-1) in both dtypes."""
    module = _module(isa)
    gen = torch.Generator().manual_seed(21)
    b, vocab = 40, 5003
    logits = (torch.randn(b, vocab, generator=gen) * 4).to(torch.bfloat16)
    logits[0, 40:] = float("-inf")
    logits[1, 7] = logits[1, 4000] = 60.0  # a tie for argmax
    logits[2, vocab - 1] = 60.0  # in the scalar tail
    logits[3, 11] = float("nan")
    logits[4, 12] = float("inf")
    logits[5] = float("-inf")
    inv_t = torch.empty(b).uniform_(0.3, 5.0, generator=gen)
    u = torch.rand(b, dtype=torch.float64, generator=gen)
    as_f32 = logits.float()
    got = module.sample_rows(logits, inv_t, u)
    assert torch.equal(got, module.sample_rows(as_f32, inv_t, u))
    assert got[3:6].tolist() == [-1, -1, -1] and bool((got[6:] >= 0).all()) and got[0] < 40
    assert torch.equal(module.argmax_rows(logits), as_f32.argmax(-1))
    assert module.argmax_rows(logits)[1:3].tolist() == [7, vocab - 1]
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        module.argmax_rows(logits.half())


@pytest.mark.parametrize("isa", ISAS)
def test_native_draw_rejects_bad_inputs_with_a_message(isa):
    module = _module(isa)
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="float32"):
        module.sample_rows(x.double(), torch.ones(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="uniforms"):
        module.sample_rows(x, torch.ones(2), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab", [49152, 5003, 40])
def test_native_grammar_mask_equals_xgrammars_apply(isa, vocab):
    """``apply_token_bitmask_`` (the structured-output masks) against xgrammar's own CPU apply:
    all-allowed, all-disallowed and mixed words, a vocab that ends inside a word, only some
    rows; and its refusals."""
    xgr = pytest.importorskip("xgrammar")
    module = _module(isa)
    gen = torch.Generator().manual_seed(vocab)
    b, words = 12, (vocab + 31) // 32
    logits = torch.randn(b, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (b, words), dtype=torch.int32, generator=gen)
    bitmask[:, : words // 3] = -1
    bitmask[:, words // 3 : words // 2] = 0
    rows = [0, 3, 4, 11]
    want, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=rows)
    module.apply_token_bitmask_(got, bitmask, torch.tensor(rows))
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1])  # a row not listed is untouched
    with pytest.raises(RuntimeError, match="outside"):
        module.apply_token_bitmask_(got, bitmask, torch.tensor([b]))
    with pytest.raises(RuntimeError, match="narrower"):
        module.apply_token_bitmask_(got, bitmask[:, :1].contiguous(), torch.tensor(rows))


@pytest.mark.parametrize("isa", ISAS)
def test_native_argmax_is_torchs_argmax(isa):
    """``argmax_rows`` returns torch.argmax's index on every row: ties (the first wins), the
    maximum in the scalar tail or the last block, rows of -inf, +inf, NaN (the first NaN wins,
    as in torch), and a vocab that is no multiple of the vector width."""
    module = _module(isa)
    gen = torch.Generator().manual_seed(5)
    b, vocab = 40, 5003
    logits = torch.randn(b, vocab, generator=gen) * 3
    logits[0, 7] = logits[0, 4000] = 50.0  # a tie: the first index
    logits[1, vocab - 1] = 50.0  # in the tail past the last whole vector
    logits[2, vocab - 70] = 50.0  # in the last blocks
    logits[3] = float("-inf")  # all -inf: index 0
    logits[4, 100] = float("inf")
    logits[5, 300] = float("nan")
    logits[5, 200] = float("inf")
    logits[6, 9] = logits[6, 4999] = float("nan")
    logits[7, :] = 1.0
    got = module.argmax_rows(logits)
    assert torch.equal(got, logits.argmax(-1))
    assert got[:8].tolist() == [7, vocab - 1, vocab - 70, 0, 100, 300, 9, 0]
    sampler = Sampler(kernels=module)
    assert sampler.argmax(logits) == logits.argmax(-1).tolist()
    assert sampler.argmax(logits[:, :-3]) == logits[:, :-3].argmax(-1).tolist()  # not contiguous
