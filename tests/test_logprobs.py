"""Logprobs of generated and prompt tokens in vLLM's shape (one ``{token_id: Logprob}`` per
position) against the float64 oracle's log_softmax, within the float32 precision contract
(tests/oracle.py) row by row: values, ranks, the top-K and the decoded text."""

from __future__ import annotations

import pytest
import torch
from oracle import FP32, Oracle

from radixkv import Engine, Logprob, SamplingParams

pytestmark = pytest.mark.real_model

SYSTEM = "You are a concise assistant. Answer in one short sentence."


def oracle_rank(ref_row: torch.Tensor, token_id: int, slack: float) -> tuple[int, int]:
    """The range of ``token_id``'s rank (1 + the number of tokens strictly more likely) that
    float32 values within ``slack / 2`` of the oracle's can give: exact unless near a tie."""
    ref = ref_row[token_id].item()
    # the upper count takes in the token itself: it is the 1 of 1 + the others
    return 1 + int((ref_row > ref + slack).sum()), int((ref_row > ref - slack).sum())


def assert_position(got, own: int, k: int, ref_row: torch.Tensor, bound: float, tokenizer):
    """One position's dict against the oracle's row: it holds ``own`` (the sampled or prompt
    token) and the top ``k`` (most likely first, the oracle's top ids unless two are within
    ``2 * bound``, a tie float32 may flip), then ``own`` when it is not among them; every logprob
    within ``bound`` of the oracle's, every rank the oracle's, the text the tokenizer's."""
    assert isinstance(got, dict) and own in got, (own, got)
    items = list(got.items())
    assert len(items) in (k, k + 1), items
    top = items[:k]
    if len(items) == k + 1:  # the sampled token, outside the top-K, comes last
        assert items[-1][0] == own and own not in dict(top)
    vals, ids = ref_row.topk(k)
    for (tid, _), want_id, want in zip(top, ids.tolist(), vals.tolist()):
        assert tid == want_id or abs(ref_row[tid].item() - want) <= 2 * bound
    assert [lp.logprob for _, lp in top] == sorted((lp.logprob for _, lp in top), reverse=True)
    for tid, lp in items:
        assert isinstance(lp, Logprob)
        assert abs(lp.logprob - ref_row[tid].item()) <= bound, (tid, lp, ref_row[tid])
        lo, hi = oracle_rank(ref_row, tid, 2 * bound)
        assert lo <= lp.rank <= hi, (tid, lp, lo, hi)
        assert lp.decoded_token == tokenizer.decode([tid])


def judged_logprobs(oracle: Oracle, ids: list[int], at: slice, prefill: int | None):
    """The oracle's log_softmax rows at ``at`` and the float32 contract's bound per row."""
    truth, bound, _ = oracle.judged(ids, at, FP32, prefill=prefill, logprobs=True)
    return truth, bound.tolist()


@pytest.fixture(scope="module")
def engine(real_model) -> Engine:
    return Engine(
        real_model, page_size=16, dtype="float32", kv_cache_tokens=4096, chunked_prefill_tokens=12
    )


@pytest.mark.parametrize(
    "knobs",
    [dict(temperature=0.0), dict(temperature=0.8, seed=3, repetition_penalty=1.3, top_k=20)],
    ids=["greedy", "sampled-penalised"],
)
def test_logprobs_equal_transformers(real_oracle, engine, knobs):
    prompt = engine.tokenize("The capital of France is")
    params = SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True, **knobs)
    (out,) = engine.generate([prompt], params)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    # raw logprobs: before temperature and penalties, whatever the sampler did with them
    seq = prompt + c.token_ids[:-1]
    ref, bound = judged_logprobs(real_oracle, seq, slice(len(prompt) - 1, None), len(prompt))
    for i, (tok, pos) in enumerate(zip(c.token_ids, c.logprobs)):
        assert_position(pos, tok, 5, ref[i], bound[i], engine.tokenizer)
        if knobs["temperature"] == 0.0:  # greedy: the chosen token is the engine's own top
            assert pos[tok].rank == 1 and next(iter(pos)) == tok
    assert c.cumulative_logprob == pytest.approx(
        sum(pos[tok].logprob for tok, pos in zip(c.token_ids, c.logprobs)), abs=1e-9
    )
    truth = sum(ref[i, t].item() for i, t in enumerate(c.token_ids))
    assert abs(c.cumulative_logprob - truth) <= sum(bound)
    (plain,) = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.prompt_logprobs is None
    engine.check_integrity()


def test_beam_search_logprobs(real_oracle, engine):
    """Each beam's tokens carry their dict (its parent beam's top-K, then the token), and the
    beam's cumulative logprob is their sum."""
    prompt = engine.tokenize("The capital of France is")
    params = SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=4, logprobs=2)
    (out,) = engine.generate([prompt], params)
    assert len(out.outputs) == 2
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) > 0
        seq = prompt + c.token_ids[:-1]
        ref, bound = judged_logprobs(real_oracle, seq, slice(len(prompt) - 1, None), len(prompt))
        for i, (tok, pos) in enumerate(zip(c.token_ids, c.logprobs)):
            assert_position(pos, tok, 2, ref[i], bound[i], engine.tokenizer)
        own = sum(pos[tok].logprob for tok, pos in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(own, abs=1e-4)
    engine.check_integrity()


def test_prompt_logprobs_compute_the_whole_prompt(real_oracle, engine):
    prompt = engine.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is Rome?"}]
    )
    assert len(prompt) > 2 * 12  # several prefill chunks
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    (warm,) = engine.generate([prompt], greedy)
    (hit,) = engine.generate([prompt], greedy)
    assert hit.cached_tokens > 0
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, logprobs=0)
    (out,) = engine.generate([prompt], params)
    # a prompt-logprobs request does not read the cache: every position is computed
    assert out.cached_tokens == 0
    assert out.token_ids == warm.token_ids
    # logprobs=0: each token's dict holds the chosen token only (greedy: rank 1)
    c = out.outputs[0]
    assert [list(pos) for pos in c.logprobs] == [[t] for t in c.token_ids]
    assert [pos[t].rank for t, pos in zip(c.token_ids, c.logprobs)] == [1, 1]
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt)
    assert lps[0] is None
    ref, bound = judged_logprobs(real_oracle, prompt, slice(None), None)
    outside = 0  # prompt tokens outside their position's top-3 (their dict has 4 entries)
    for i in range(1, len(prompt)):
        assert_position(lps[i], prompt[i], 3, ref[i - 1], bound[i - 1], engine.tokenizer)
        outside += len(lps[i]) == 4
    assert outside > 0  # a chat prompt's tokens are not all predictable: that case is covered
    # its pages were still published: the next plain request hits the cache again
    (after,) = engine.generate([prompt], greedy)
    assert after.cached_tokens == hit.cached_tokens
    engine.check_integrity()
