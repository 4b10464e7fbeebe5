"""``logit_bias`` and ``min_tokens``: the batched processors, their validation, the stop-string
hold-off in the detokenizer, and the engine end to end on the tiny random model."""

from __future__ import annotations

import pytest
import torch

from radixkv import Engine, SamplingParams
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.logits_processors import apply_logits_processors
from radixkv.engine.sampler import Sampler, SequenceState

VOCAB = 64
EOS = 2


def _logits(b: int = 4, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, VOCAB, generator=gen) * 3


def _state(output_ids: tuple[int, ...] = (), **kw) -> SequenceState:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 32)
    return SequenceState(SamplingParams(**kw).validate(), (1, 5), output_ids)


def test_no_row_uses_them_returns_the_same_tensor() -> None:
    logits = _logits()
    rows = [_state(), _state(temperature=0.7, top_k=5), _state(min_tokens=2, output_ids=(4, 4))]
    assert apply_logits_processors(logits, rows[:2], {EOS}) is logits
    assert apply_logits_processors(logits, rows, {EOS}) is logits  # min_tokens already reached


def test_bias_is_added_exactly_and_only_where_asked() -> None:
    logits = _logits()
    before = logits.clone()
    rows = [_state(logit_bias={3: 1.5, 7: -2.25}), _state(), _state(logit_bias={0: 100})]
    rows.append(_state())
    out = apply_logits_processors(logits, rows, {EOS})
    assert torch.equal(logits, before)  # the raw logits (logprobs read them) are left alone
    want = before.clone()
    want[0, 3] = before[0, 3] + torch.tensor(1.5)
    want[0, 7] = before[0, 7] + torch.tensor(-2.25)
    want[2, 0] = before[2, 0] + torch.tensor(100.0)
    assert torch.equal(out, want)  # float32 adds, bit for bit; rows 1 and 3 untouched


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = _logits()
    rows = [
        _state(min_tokens=3, output_ids=(9, 9), stop_token_ids=[11]),  # short: masked
        _state(min_tokens=3, output_ids=(9, 9, 9), stop_token_ids=[11]),  # reached
        _state(min_tokens=3, ignore_eos=True, stop_token_ids=[11, 10_000]),  # no EOS; id > vocab
        _state(),
    ]
    out = apply_logits_processors(logits, rows, {EOS, 5})
    inf = float("-inf")
    assert out[0, EOS] == inf and out[0, 5] == inf and out[0, 11] == inf
    assert torch.isfinite(out[0]).sum() == VOCAB - 3
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])
    assert out[2, 11] == inf and torch.isfinite(out[2]).sum() == VOCAB - 1


def test_bias_forces_or_bans_a_token_greedy_and_sampled() -> None:
    logits = _logits()
    best = logits.argmax(-1).tolist()
    sampler = Sampler(eos_token_ids={EOS})
    forced = [_state(logit_bias={13: 100}) for _ in range(4)]
    assert sampler.sample(logits, forced).token_ids == [13] * 4
    banned = [_state(logit_bias={best[i]: -100}) for i in range(4)]
    for i, tok in enumerate(sampler.sample(logits, banned).token_ids):
        assert tok != best[i]
        assert tok == logits[i].clone().index_fill_(0, torch.tensor([best[i]]), -1e9).argmax()
    hot = [_state(temperature=1.0, seed=i, logit_bias={21: 100}) for i in range(4)]
    assert sampler.sample(logits, hot).token_ids == [21] * 4  # exp(-100 + spread) never drawn


def test_rows_without_them_sample_as_alone() -> None:
    logits = _logits(6, seed=3)
    sampler = Sampler(eos_token_ids={EOS})
    plain = [_state(), _state(temperature=0.9, seed=7), _state(repetition_penalty=1.3)]
    alone = [
        sampler.sample(logits[r : r + 1], [plain[i]]).token_ids[0] for i, r in enumerate([0, 2, 4])
    ]
    plain[1] = _state(temperature=0.9, seed=7)  # a fresh generator for the batched run
    mixed = [
        plain[0],
        _state(logit_bias={1: 50, 2: -30}),
        plain[1],
        _state(min_tokens=4, output_ids=(1,)),
        plain[2],
        _state(temperature=0.8, seed=1, logit_bias={4: 5}),
    ]
    got = sampler.sample(logits, mixed).token_ids
    assert [got[0], got[2], got[4]] == alone


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = _logits(1)
    sampler = Sampler()
    out = sampler.sample(logits, [_state(logit_bias={13: 100}, logprobs=0)])
    assert out.token_ids == [13]
    raw = torch.log_softmax(logits[0], -1)[13].item()
    assert out.logprobs[0] == pytest.approx(raw, abs=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {3: 100.5}}, "logit_bias"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": [3, 1.0]}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2.5}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"min_tokens": 2, "use_beam_search": True, "n": 2}, "min_tokens"),
        ({"logit_bias": {1: 1.0}, "use_beam_search": True, "n": 2}, "logit_bias"),
    ],
)
def test_bad_values_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()


def test_min_tokens_equal_to_max_tokens_is_valid() -> None:
    SamplingParams(min_tokens=16, max_tokens=16, logit_bias={5: -100, 6: 100.0}).validate()


class _Chars:
    """One character per token: id = code point."""

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(map(chr, ids))


@pytest.mark.parametrize("min_tokens", [0, 3, 5, 6])
def test_stop_strings_wait_for_min_tokens(min_tokens: int) -> None:
    """ "ab" ends at tokens 2 and 7 ("abxyzab..."): with min_tokens 3 to 6 the first is not
    honoured (a stop string must end after the first min_tokens tokens), the second is."""
    ids = [ord(c) for c in "abxyzabqq"]
    detok = IncrementalDetokenizer(_Chars(), ["ab"], min_tokens=min_tokens)
    for n in range(1, len(ids) + 1):
        _delta, stopped = detok.update(ids[:n], final=False)
        if stopped:
            break
    assert stopped
    assert (n, detok.text) == ((2, "") if min_tokens < 2 else (7, "abxyz"))


def test_a_stop_string_straddling_min_tokens_counts() -> None:
    ids = [ord(c) for c in "xyabq"]
    detok = IncrementalDetokenizer(_Chars(), ["ab"], min_tokens=3)  # "a" is token 3, "b" 4
    stops = [detok.update(ids[:n], final=False)[1] for n in range(1, 5)]
    assert stops == [False, False, False, True] and detok.text == "xy"


# -- the engine, end to end (tiny random Llama; EOS id 2) --------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model) -> Engine:
    return Engine(tiny_model, page_size=4, dtype="float32", kv_cache_tokens=1024)


def test_engine_logit_bias_forces_a_token(engine: Engine) -> None:
    p = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={77: 100})
    (out,) = engine.generate([[10, 20, 30]], p)
    assert out.outputs[0].token_ids == [77] * 6


def test_engine_min_tokens_keeps_eos_out(engine: Engine) -> None:
    eager = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={EOS: 100})
    (out,) = engine.generate([[10, 20, 30]], eager)
    assert out.outputs[0].token_ids == [EOS] and out.outputs[0].finish_reason == "stop"
    held = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={EOS: 100}, min_tokens=5)
    plain = SamplingParams(temperature=0.0, max_tokens=5)
    outs = engine.generate([[10, 20, 30], [10, 20, 30]], [held, plain])
    tokens = outs[0].outputs[0].token_ids
    assert len(tokens) == 6 and EOS not in tokens[:5] and tokens[5] == EOS
    assert outs[0].outputs[0].finish_reason == "stop"
    (alone,) = engine.generate([[10, 20, 30]], plain)  # the batch neighbour is unaffected
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_engine_refuses_a_bias_outside_the_vocabulary(engine: Engine) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("r", [1, 2], SamplingParams(logit_bias={engine.vocab_size: 1.0}))


def test_min_tokens_with_structured_outputs_is_refused_naming_both() -> None:
    """A finished grammar allows only its stop token, which min_tokens would mask: the pair is a
    clear error, not a row with no token left."""
    from radixkv import StructuredOutputs

    params = SamplingParams(min_tokens=2, structured_outputs=StructuredOutputs(regex="a+"))
    with pytest.raises(ValueError, match="min_tokens is not supported with structured_outputs"):
        params.validate()
    SamplingParams(min_tokens=2).validate()
    SamplingParams(structured_outputs=StructuredOutputs(regex="a+")).validate()
