"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer (byte-level BPE).

Its tokens split multi-byte UTF-8 characters (an emoji or a CJK character can take two to four
tokens; a prefix of them decodes to U+FFFD) and carry leading spaces (``" the"``), which a byte
tokenizer never exercises. Checked: the deltas add up to the full decode and are never
retracted; a stop string is found wherever it starts (the very first characters included) and
whatever token boundaries it spans, the text ends right before it and generation stops at the
token that completed it.
"""

from __future__ import annotations

import pytest

from radixkv import Engine, SamplingParams
from radixkv.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.real_model

TEXTS = [
    "Héllo wörld 你好 🎉 naïve café",
    " the cat\n\n  sat on   the mat.",
    "∑ → ≠ 日本語のテキスト 🎉🎉 ok",
    "Paris is the capital of France. Ünïcödé ends here: 👍🏽",
]


@pytest.fixture(scope="module")
def tok(real_model):
    return real_model.tokenizer


def full_decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def feed(tok, ids: list[int], stop: list[str] | None = None, final_at_end: bool = True):
    """Run the detokenizer token by token: (deltas, tokens fed when it stopped or None)."""
    detok = IncrementalDetokenizer(tok, stop)
    deltas = []
    for k in range(1, len(ids) + 1):
        delta, stopped = detok.update(ids[:k], final=final_at_end and k == len(ids))
        deltas.append(delta)
        if stopped:
            return deltas, k
    return deltas, None


def test_cases_exercise_split_characters_and_space_prefixed_tokens(tok) -> None:
    """The texts below really have tokens that split a character and tokens with a space."""
    split = spaced = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert full_decode(tok, ids) == text
        split += sum(full_decode(tok, ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
        spaced += sum(full_decode(tok, [i]).startswith(" ") for i in ids)
    assert split >= 10 and spaced >= 10, (split, spaced)


@pytest.mark.parametrize("stop", [None, ["never-in-these-texts"]], ids=["no-stop", "held-tail"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_full_decode(tok, text: str, stop) -> None:
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    deltas, stopped_at = feed(tok, ids, stop)
    assert stopped_at is None
    assert "".join(deltas) == full_decode(tok, ids) == text  # EOS adds no text
    # never a partial character, and every delta extends the text (nothing retracted)
    assert not any("\ufffd" in d for d in deltas)
    so_far = ""
    for d in deltas:
        so_far += d
        assert text.startswith(so_far)
    if stop is None:  # nothing to hold back but split characters: text as soon as it is whole
        for k in range(1, len(ids) + 1):
            whole = full_decode(tok, ids[:k]).rstrip("\ufffd")
            assert "".join(deltas[:k]) == whole


def stop_cases(text: str, ids: list[int], tok) -> list[str]:
    """Stop strings in ``text``: its first character, its first two, one across each of the
    first few token boundaries (last character of a token + first of the next), one inside a
    run of split characters, its last three characters."""
    cases = [text[:1], text[:2], text[-3:]]
    ends = [len(full_decode(tok, ids[:k]).rstrip("\ufffd")) for k in range(1, len(ids))]
    cases += [text[e - 1 : e + 1] for e in sorted(set(ends))[:6] if 0 < e < len(text)]
    multi = [i for i, c in enumerate(text) if len(c.encode()) > 1]
    if len(multi) >= 2:
        cases.append(text[multi[0] : multi[1] + 1])
    return cases


@pytest.mark.parametrize("text", TEXTS)
def test_stop_string_anywhere_across_token_boundaries(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    for stop in stop_cases(text, ids, tok):
        cut = text.find(stop)
        assert cut >= 0
        done = next(k for k in range(1, len(ids) + 1) if stop in full_decode(tok, ids[:k]))
        deltas, stopped_at = feed(tok, ids, [stop])
        assert stopped_at == done, (stop, stopped_at, done)
        assert "".join(deltas) == text[:cut], stop  # the stop string itself is not output
    # two stop strings: the one that appears first in the text wins, whichever is listed first
    a, b = text[4:7], text[-4:-1]
    deltas, _ = feed(tok, ids, [b, a])
    assert "".join(deltas) == text[: min(text.find(a), text.find(b))]


# -- the engine: greedy SmolLM2 output cut by stop strings -------------------------------------
@pytest.fixture(scope="module")
def engine(real_model) -> Engine:
    return Engine(real_model, dtype="float32")


CONV = [
    {"role": "system", "content": "You are a concise travel assistant."},
    {"role": "user", "content": "Where is the Louvre? Answer in one sentence."},
]
GREEDY = dict(max_tokens=20, temperature=0.0, ignore_eos=True)


def test_engine_stops_on_strings_in_real_output(engine: Engine) -> None:
    (free,) = engine.chat(CONV, SamplingParams(**GREEDY))
    tok = engine.tokenizer
    ids, text = free.token_ids, free.text
    assert free.finish_reason == "length" and len(ids) == 20
    assert text == full_decode(tok, ids) and len(text) > 20
    pieces = [full_decode(tok, [i]) for i in ids]
    assert sum(p.startswith(" ") for p in pieces) >= 3  # space-prefixed tokens in play
    b1 = len(pieces[0])  # end of the first token's text
    b5 = len(full_decode(tok, ids[:5]))  # a later token boundary
    assert len(pieces[5]) > 3  # token 5 (" Paris") is long enough to hold a stop inside it
    cases = [
        text[:1],  # the very first character
        text[: b1 + 1],  # from the start across the first boundary
        text[b5 - 2 : b5 + 2],  # across a later boundary
        text[b5 + 1 : b5 + 3],  # inside token 5: the text before it in that token is kept
        text[-2:],  # the last characters
    ]
    for stop in cases:
        (out,) = engine.chat(CONV, SamplingParams(**GREEDY, stop=[stop]))
        done = next(k for k in range(1, len(ids) + 1) if stop in full_decode(tok, ids[:k]))
        assert out.finish_reason == "stop", stop
        assert out.text == text[: text.find(stop)], stop  # excluded, what precedes kept
        assert out.token_ids == ids[:done], stop  # ends with the token completing the stop
    # a stop token id: the token is the last one kept, and with it its text
    (out,) = engine.chat(CONV, SamplingParams(**GREEDY, stop_token_ids=[ids[3]]))
    first = ids.index(ids[3])
    assert out.finish_reason == "stop" and out.token_ids == ids[: first + 1]
    assert out.text == full_decode(tok, ids[: first + 1])
    engine.check_integrity()


def test_engine_detokenizes_split_characters_like_a_full_decode(engine: Engine) -> None:
    """Output with split characters (emoji / CJK asked for), decoded step by step by the engine,
    equals one decode of all its tokens; stopping on a multi-byte character works too."""
    conv = [{"role": "user", "content": "Repeat exactly: 你好世界 🎉🎉 こんにちは 👍"}]
    params = dict(GREEDY, max_tokens=24)
    (free,) = engine.chat(conv, SamplingParams(**params))
    tok = engine.tokenizer
    ids = free.token_ids
    assert free.text == full_decode(tok, ids)
    splits = sum(full_decode(tok, ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
    assert splits >= 2, (free.text, splits)  # the output really splits characters
    streamed = []
    engine.add_request("s", engine.apply_chat_template(conv), SamplingParams(**params))
    while engine.has_unfinished():
        streamed += [o.new_text for o in engine.step() if o.request_id == "s"]
    assert "".join(streamed) == free.text and not any("\ufffd" in d for d in streamed)
    multi = next(c for c in free.text if len(c.encode()) > 1)
    (out,) = engine.chat(conv, SamplingParams(**params, stop=[multi]))
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.find(multi)]


def test_work_per_token_does_not_grow_with_the_output(tok) -> None:
    """Each update decodes a window of a few tokens, not the whole output: decoding 3,000 tokens
    one at a time touches O(n) token ids (it was O(n^2): 4.5 million here), and the deltas still
    add up to the full decode, stop strings included."""
    ids = tok.encode(" ".join(TEXTS) * 40, add_special_tokens=False)[:3000]
    decoded = 0

    class Counting:
        def decode(self, xs, **kw):
            nonlocal decoded
            decoded += len(xs)
            return tok.decode(xs, **kw)

    for stop in (None, ["never-in-these-texts", "x"]):
        decoded = 0
        detok = IncrementalDetokenizer(Counting(), stop)
        out = "".join(detok.update(ids[:k], final=k == len(ids))[0] for k in range(1, len(ids) + 1))
        assert out == full_decode(tok, ids)
        assert decoded <= 12 * len(ids), decoded


def test_special_tokens_shown_when_asked_and_stop_strings_kept(tok) -> None:
    """skip_special_tokens=False keeps special tokens' text (e.g. ``<|im_end|>``);
    include_stop keeps the stop string; stop_reason names it."""
    ids = tok.encode("Hello there", add_special_tokens=False) + [tok.eos_token_id]
    special = tok.decode([tok.eos_token_id], skip_special_tokens=False)
    assert special  # the EOS token has a text when not skipped
    shown = IncrementalDetokenizer(tok, None, skip_special_tokens=False)
    text = "".join(shown.update(ids[:k], final=k == len(ids))[0] for k in range(1, len(ids) + 1))
    assert text == "Hello there" + special
    kept = IncrementalDetokenizer(tok, [" the"], include_stop=True)
    deltas, stopped_at = [], None
    for k in range(1, len(ids) + 1):
        delta, stopped = kept.update(ids[:k], final=k == len(ids))
        deltas.append(delta)
        if stopped:
            stopped_at = k
            break
    assert stopped_at is not None and "".join(deltas) == "Hello the"
    assert kept.stop_reason == " the"
