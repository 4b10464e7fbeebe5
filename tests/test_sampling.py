"""SamplingParams validation and the batched Sampler."""

from __future__ import annotations

import pytest
import torch

from radixkv.engine.sampling import Sampler, SamplingParams, SequenceState

VOCAB = 50


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


def _draw(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    sampler = Sampler()
    state = SequenceState(params, generator=Sampler.make_generator(params.seed))
    return [sampler.sample(logits[None], [state]).token_ids[0] for _ in range(n)]


def test_same_seed_same_tokens_and_different_seed_differs():
    logits = _logits(1)[0] / 3  # flatter, so draws vary
    a = _draw(SamplingParams(temperature=1.0, seed=7), logits, 40)
    b = _draw(SamplingParams(temperature=1.0, seed=7), logits, 40)
    c = _draw(SamplingParams(temperature=1.0, seed=8), logits, 40)
    assert a == b
    assert a != c
    assert len(set(a)) > 5


def test_seeded_rows_are_independent_of_batch_neighbours():
    logits = _logits(3) / 3
    p = SamplingParams(temperature=1.0, seed=11)
    alone = Sampler().sample(logits[1:2], [SequenceState(p)]).token_ids[0]
    batch = [SequenceState(SamplingParams(temperature=0.7, seed=i)) for i in (1, 2)]
    mixed = [batch[0], SequenceState(p), batch[1]]
    assert Sampler().sample(logits, mixed).token_ids[1] == alone


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


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_temperature_samples_softmax_of_logits_over_t(temperature):
    """The draws at temperature T follow softmax(logits / T) (every class count within 5 sigma
    of it, 4000 seeded draws) and are rejected by the distribution of each other temperature,
    so a sampler that ignored or misapplied T would fail."""
    logits, tokens = _temperature_case()
    n = 4000
    draws = _draw(SamplingParams(temperature=temperature, seed=5), logits, n)
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
