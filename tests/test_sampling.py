"""SamplingParams validation and the batched Sampler."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixkv.engine.sampler import Sampler, SequenceState
from radixkv.engine.sampling import SamplingParams
from radixkv.model import native

VOCAB = 50

#: How the sampler draws its plain rows: the torch ops, and the native ``sample_rows`` of every
#: ISA level this host runs (levels it lacks are not collected).
DRAW_PATHS = ["torch", *(f"native-{isa}" for isa in native.runnable_isas())]


def _sampler(path: str) -> Sampler:
    if path == "torch":
        return Sampler(kernels=None)
    module = native.load(path.removeprefix("native-"))
    if module is None:
        pytest.skip(f"the native build of {path} failed here: {native.build_error()}")
    return Sampler(kernels=module)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("n", 0),
        ("max_tokens", 0),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("logprobs", -1),
        ("logprobs", 100),
        ("seed", "abc"),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_defaults_and_edge_values_are_valid():
    assert SamplingParams().validate() == SamplingParams()
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, logprobs=0, stop="x").validate()
    assert SamplingParams(temperature=0.0).is_greedy


def _logits(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_for_the_whole_batch():
    logits = _logits(7)
    seqs = [SequenceState(SamplingParams(temperature=0)) for _ in range(7)]
    out = Sampler().sample(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist()


def _draw(
    params: SamplingParams, logits: torch.Tensor, n: int, sampler: Sampler | None = None
) -> list[int]:
    sampler = sampler or Sampler()
    state = SequenceState(params, generator=Sampler.make_generator(params.seed))
    return [sampler.sample(logits[None], [state]).token_ids[0] for _ in range(n)]


@pytest.mark.parametrize("path", DRAW_PATHS)
def test_same_seed_same_tokens_and_different_seed_differs(path):
    logits = _logits(1)[0] / 3  # flatter, so draws vary
    sampler = _sampler(path)
    a = _draw(SamplingParams(temperature=1.0, seed=7), logits, 40, sampler)
    b = _draw(SamplingParams(temperature=1.0, seed=7), logits, 40, sampler)
    c = _draw(SamplingParams(temperature=1.0, seed=8), logits, 40, sampler)
    assert a == b
    assert a != c
    assert len(set(a)) > 5


@pytest.mark.parametrize("path", DRAW_PATHS)
def test_seeded_rows_are_independent_of_batch_neighbours(path):
    logits = _logits(3) / 3
    p = SamplingParams(temperature=1.0, seed=11)
    sampler = _sampler(path)
    alone = sampler.sample(logits[1:2], [SequenceState(p)]).token_ids[0]
    batch = [SequenceState(SamplingParams(temperature=0.7, seed=i)) for i in (1, 2)]
    mixed = [batch[0], SequenceState(p), batch[1]]
    assert sampler.sample(logits, mixed).token_ids[1] == alone


def test_top_k_restricts_support():
    logits = _logits(1, seed=2)[0] / 4
    allowed = set(torch.topk(logits, 3).indices.tolist())
    got = set(_draw(SamplingParams(temperature=1.0, top_k=3, seed=0), logits, 300))
    assert got == allowed


def test_top_p_restricts_support():
    logits = torch.full((VOCAB,), -10.0)
    logits[[4, 9, 17]] = torch.tensor([2.0, 1.5, 1.0])
    probs = torch.softmax(logits, -1)
    # top_p just above p(4) keeps tokens 4 and 9 only
    top_p = float(probs[4]) + 0.01
    got = set(_draw(SamplingParams(temperature=1.0, top_p=top_p, seed=1), logits, 300))
    assert got == {4, 9}
    # top_p below p(4): only the top token
    got = set(_draw(SamplingParams(temperature=1.0, top_p=0.05, seed=1), logits, 50))
    assert got == {4}


def test_min_p_restricts_support():
    logits = torch.full((VOCAB,), -10.0)
    logits[[3, 5, 8]] = torch.tensor([2.0, 1.8, 0.0])  # p(8)/p(3) = e^-2 ~ 0.135
    got = set(_draw(SamplingParams(temperature=1.0, min_p=0.2, seed=3), logits, 300))
    assert got == {3, 5}
    got = set(_draw(SamplingParams(temperature=1.0, min_p=0.1, seed=3), logits, 600))
    assert got == {3, 5, 8}


TEMPERATURES = (0.5, 1.0, 2.0)


def _temperature_case() -> tuple[torch.Tensor, list[int]]:
    """Logits whose top token has a very different probability at each of TEMPERATURES (0.67,
    0.25, 0.08), and the outcome classes counted: token 7, token 12, any other."""
    logits = torch.zeros(VOCAB)
    logits[[7, 12]] = torch.tensor([3.0, 2.5])
    return logits, [7, 12]


def _class_probs(logits: torch.Tensor, tokens: list[int], temperature: float) -> list[float]:
    p = torch.softmax(logits.double() / temperature, -1)
    return [float(p[t]) for t in tokens] + [1.0 - float(p[tokens].sum())]


def _within_binomial(counts: list[int], probs: list[float], n: int, z: float = 5.0) -> bool:
    """Every class count within ``z`` binomial standard deviations of ``n * p``."""
    return all(abs(c - n * p) <= z * (n * p * (1 - p)) ** 0.5 for c, p in zip(counts, probs))


@pytest.mark.parametrize("path", DRAW_PATHS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_temperature_samples_softmax_of_logits_over_t(temperature, path):
    """The draws at temperature T follow softmax(logits / T) (every class count within 5 sigma
    of it, 4000 seeded draws) and are rejected by the distribution of each other temperature,
    so a sampler that ignored or misapplied T would fail; on every draw path."""
    logits, tokens = _temperature_case()
    n = 4000
    draws = _draw(SamplingParams(temperature=temperature, seed=5), logits, n, _sampler(path))
    counts = [draws.count(t) for t in tokens]
    counts.append(n - sum(counts))
    assert _within_binomial(counts, _class_probs(logits, tokens, temperature), n), counts
    for other in TEMPERATURES:
        if other != temperature:
            assert not _within_binomial(counts, _class_probs(logits, tokens, other), n), other


def test_temperature_near_zero_is_nearly_greedy():
    logits, tokens = _temperature_case()
    cold = _draw(SamplingParams(temperature=0.05, seed=5), logits, 200)
    assert cold.count(tokens[0]) >= 199  # p(7) = 1 - 5e-5


def test_penalties_change_logits_as_defined():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    prompt, output = [0, 1], [2, 2, 3]
    p = SamplingParams(repetition_penalty=2.0)
    out = Sampler.apply_penalties(logits, p, prompt, output)
    torch.testing.assert_close(out, torch.tensor([1.0, -2.0, 0.25, 1.5, 0.0]))
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = Sampler.apply_penalties(logits, p, prompt, output)
    # counts in output: token 2 -> 2, token 3 -> 1; the prompt does not count
    torch.testing.assert_close(
        out, torch.tensor([2.0, -1.0, 0.5 - 1.0 - 0.25, 3.0 - 0.5 - 0.25, 0.0])
    )
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0]))  # input untouched
    # a greedy request with a penalty picks the penalised argmax
    seq = SequenceState(SamplingParams(temperature=0, repetition_penalty=3.0), [3], [])
    assert Sampler().sample(logits[None], [seq]).token_ids == [0]


def test_logprobs_of_chosen_token():
    logits = _logits(2, seed=6)
    seqs = [
        SequenceState(SamplingParams(temperature=0, logprobs=0)),
        SequenceState(SamplingParams(temperature=0)),
    ]
    out = Sampler().sample(logits, seqs)
    expect = torch.log_softmax(logits[0], -1).max().item()
    assert out.logprobs[0] == pytest.approx(expect, abs=1e-5)
    assert out.logprobs[1] is None


# -- the batched sampler: every row as if alone, exact filtered distributions -----------------
MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, seed=2),
    SamplingParams(temperature=1.3, top_k=5, seed=3),
    SamplingParams(temperature=0.9, min_p=0.05, seed=4),
    SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.3),
    SamplingParams(temperature=1.0, presence_penalty=0.8, top_k=40, top_p=0.8, seed=6),
    SamplingParams(temperature=0.5, repetition_penalty=0.7, seed=7),
]


def _states(params: list[SamplingParams]) -> list[SequenceState]:
    return [
        SequenceState(p, prompt_ids=[1, 2, 3, i], output_ids=[5, 5, 9, i + 20], generator=None)
        for i, p in enumerate(params)
    ]


def test_batched_rows_sample_as_each_row_alone():
    """A batch of mixed settings (greedy, plain, top-p, top-k, min-p, penalties, combined) gives
    each row the tokens it gets sampled alone with the same seed, step after step."""
    logits = [_logits(len(MIXED), seed=s) / 2 for s in range(12)]
    batch, alone = _states(MIXED), _states(MIXED)
    sampler = Sampler()
    for step in logits:
        got = sampler.sample(step, batch).token_ids
        want = [sampler.sample(step[i : i + 1], [alone[i]]).token_ids[0] for i in range(len(MIXED))]
        assert got == want
    assert len({tuple(sampler.sample(logits[0], _states(MIXED)).token_ids)}) == 1


def test_batched_penalties_equal_the_definition_row_by_row():
    logits = _logits(len(MIXED), seed=9)
    states = _states(MIXED)
    got = Sampler.penalize(logits, states)
    for i, s in enumerate(states):
        want = logits[i].clone()
        p = s.params
        seen = sorted(set(s.prompt_ids) | set(s.output_ids))
        if p.repetition_penalty != 1.0:
            v = want[seen]
            want[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        for tok in set(s.output_ids):
            n = list(s.output_ids).count(tok)
            want[tok] -= p.frequency_penalty * n + p.presence_penalty
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=3, seed=21),
        SamplingParams(temperature=1.0, top_p=0.7, seed=22),
        SamplingParams(temperature=1.0, min_p=0.2, seed=23),
        SamplingParams(temperature=1.5, seed=24),
    ],
    ids=["top-k", "top-p", "min-p", "plain"],
)
def test_draws_follow_the_filtered_distribution(params):
    """4000 draws (a batch of 4 rows with the same settings and their own seeds) against the filtered
    distribution computed in float64 by hand: every kept token's count within 5 sigma, no
    removed token drawn."""
    logits = torch.full((VOCAB,), -4.0)
    logits[[3, 8, 13, 21, 34]] = torch.tensor([2.0, 1.6, 1.2, 0.9, 0.2])
    probs = torch.softmax(logits.double() / params.temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    for rank, tok in enumerate(order.tolist()):
        before = probs[order[:rank]].sum()
        if params.top_k > 0 and rank >= params.top_k:
            break
        if params.top_p < 1.0 and rank > 0 and before >= params.top_p:
            break
        if probs[tok] < params.min_p * probs[order[0]]:
            break
        keep[tok] = True
    want = torch.where(keep, probs, 0.0)
    want = want / want.sum()
    states = [SequenceState(dataclasses.replace(params, seed=params.seed + i)) for i in range(4)]
    sampler, batch = Sampler(), logits.expand(4, VOCAB).contiguous()
    draws = [t for _ in range(1000) for t in sampler.sample(batch, states).token_ids]
    counts = torch.bincount(torch.tensor(draws), minlength=VOCAB).double()
    assert counts[~keep].sum() == 0
    n = len(draws)
    sigma = (n * want * (1 - want)).sqrt()
    assert ((counts - n * want).abs() <= 5 * sigma + 1e-9)[keep].all(), (counts[keep], want[keep])
    assert keep.sum() >= 2 or params.top_p < 1.0  # the case really samples among several


@pytest.mark.parametrize("path", DRAW_PATHS)
def test_plain_bf16_batches_pick_what_their_float32_copy_does(path):
    """The engine hands a bf16 model's logits over as they are: a plain batch (greedy rows and
    temperature-only rows) is read in bf16 by the native kernels, any other batch gets a float32
    copy. Either way each row's token is the one its float32 copy gives, rows with NaN or +inf
    included (tamed by the full path with the uniform the row drew), and the generators advance
    alike (the next step's tokens agree too)."""
    sampler = _sampler(path)
    logits = (_logits(12, seed=8) * 3).to(torch.bfloat16)
    logits[5, 3] = float("nan")
    logits[6, 9] = float("inf")

    def batch(extra: dict) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0.0 if i % 4 == 0 else 0.7 + 0.1 * i, seed=i, **extra)
            for i in range(12)
        ]

    for extra in ({}, {"top_k": 20}, {"repetition_penalty": 1.3}):
        a = [SequenceState(p, prompt_ids=[1, 2], output_ids=[3]) for p in batch(extra)]
        b = [SequenceState(p, prompt_ids=[1, 2], output_ids=[3]) for p in batch(extra)]
        for _ in range(2):
            got = sampler.sample(logits, a).token_ids
            want = sampler.sample(logits.float(), b).token_ids
            assert got == want, (extra, got, want)
    plain = [SequenceState(p) for p in batch({})]
    assert (sampler.plain_tokens(logits, plain) is None) == (path == "torch")
    assert sampler.plain_tokens(logits, [SequenceState(p) for p in batch({"top_k": 20})]) is None


def test_overflowing_rows_fall_back_to_the_best_raw_logit():
    logits = _logits(3, seed=4)
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[2, 11] = 5.0
    states = [SequenceState(SamplingParams(temperature=1e-4, seed=i)) for i in range(3)]
    tokens = Sampler().sample(logits, states).token_ids
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == int(torch.nan_to_num(logits[1], nan=float("-inf")).argmax())
    assert tokens[2] == 11


def test_stop_conditions_are_bounded_with_a_message_that_says_the_limit() -> None:
    """Every output token is checked against each stop string and id: a request cannot make that
    check unbounded (many, or very long, stop strings; a huge id list)."""
    from radixkv.engine.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    SamplingParams(
        stop=["x"] * MAX_STOP_STRINGS, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS
    ).validate()
    SamplingParams(stop="y" * MAX_STOP_CHARS).validate()
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} strings"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1)).validate()
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop="y" * (MAX_STOP_CHARS + 1)).validate()
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_TOKEN_IDS} ids"):
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)).validate()
