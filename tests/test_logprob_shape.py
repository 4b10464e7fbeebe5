"""vLLM's logprob shape without a model: exact ranks (ties included) from the sampler and the
prompt path, the order of a position's dict, and the server reading the top-K back out of it."""

from __future__ import annotations

import math

import pytest
import torch

from radixkv import Logprob, SamplingParams
from radixkv.engine.logprobs import TokenTexts, chosen_and_top
from radixkv.engine.sampler import Sampler, SequenceState
from radixkv.server.logprob_format import (
    chat_logprobs,
    completion_logprobs,
    sglang_top_logprobs,
    vllm_prompt_logprobs,
)

#: one row; log_softmax keeps the order: 3.0 (ids 1 and 2, tied), 2.0, 1.0, 0.0
ROW = torch.tensor([[2.0, 3.0, 3.0, 0.0, 1.0]])
#: the same without the tie: 3.5, 3.0, 2.0, 1.0, 0.0
UNTIED = torch.tensor([[2.0, 3.5, 3.0, 0.0, 1.0]])


class Chars:
    """A tokenizer whose token ``i`` is the letter ``"abcde"[i]``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("abcde"[i] for i in ids)


def test_ranks_count_the_strictly_more_likely_tokens() -> None:
    lp = torch.log_softmax(ROW, -1)[0].tolist()
    vals, ranks, tops = chosen_and_top(ROW.repeat(5, 1), [0, 1, 2, 3, 4], [2] * 5)
    assert ranks == [3, 1, 1, 5, 4]  # ties share the better rank
    assert vals == pytest.approx(lp)
    assert sorted(t for t, _ in tops[0]) == [1, 2]


def test_sampler_rows_that_ask_get_the_rank_of_their_token() -> None:
    logits = torch.cat([ROW, ROW])
    banned = SamplingParams(temperature=0, logprobs=1, logit_bias={1: -100, 2: -100})
    seqs = [SequenceState(banned), SequenceState(SamplingParams(temperature=0))]
    out = Sampler().sample(logits, seqs)
    # row 0 picks token 0 (1 and 2 biased away); ranks are over the raw logits
    assert out.token_ids[0] == 0 and out.ranks == [3, None]
    assert out.top_logprobs[0] is not None and [t for t, _ in out.top_logprobs[0]] in ([1], [2])


def test_a_position_holds_the_top_k_then_its_token() -> None:
    texts = TokenTexts(Chars())
    lp = torch.log_softmax(ROW, -1)[0].tolist()
    vals, ranks, tops = chosen_and_top(ROW, [3], [3])
    pos = texts.logprobs(3, vals[0], ranks[0], tops[0])
    # the top-3 (most likely first; 1 and 2 tie), then the token: k + 1 entries
    assert sorted(list(pos)[:2]) == [1, 2] and list(pos)[2:] == [0, 3]
    assert pos[3] == Logprob(lp[3], 5, "d")
    assert [pos[t].rank for t in (1, 2, 0)] == [1, 1, 3]
    assert pos[0] == Logprob(lp[0], 3, "a")
    # the token among the top-K: k entries, its own rank
    vals, ranks, tops = chosen_and_top(ROW, [0], [3])
    assert list(texts.logprobs(0, vals[0], ranks[0], tops[0]))[2:] == [0]
    assert len(texts.logprobs(0, vals[0], ranks[0], tops[0])) == 3
    assert texts.logprobs(0, None, None, None) is None  # logprobs not asked
    assert TokenTexts(None).logprobs(3, -1.0, 2, [])[3] == Logprob(-1.0, 2, None)


def test_the_server_reads_the_top_k_and_the_token_back() -> None:
    """A sampled token outside the top-K (a k + 1 dict): the JSON's top-K leaves it out and its
    own logprob is still its."""
    texts = TokenTexts(Chars())
    vals, ranks, tops = chosen_and_top(UNTIED, [3], [2])
    pos = texts.logprobs(3, vals[0], ranks[0], tops[0])
    assert list(pos) == [1, 2, 3] and pos[3].rank == 5
    lp = torch.log_softmax(UNTIED, -1)[0].tolist()

    def token_str(t: int) -> str:
        return "abcde"[t]

    comp = completion_logprobs([3], [pos], 2, token_str, 0)
    assert comp["token_logprobs"] == [lp[3]]
    assert comp["top_logprobs"] == [{"b": lp[1], "c": lp[2]}]
    chat = chat_logprobs([3], [pos], 2, token_str)["content"][0]
    assert chat["logprob"] == lp[3] and [t["token"] for t in chat["top_logprobs"]] == ["b", "c"]
    assert sglang_top_logprobs([None, pos], 2, token_str, True) == [
        None,
        [[lp[1], 1, "b"], [lp[2], 2, "c"]],
    ]
    prompt = vllm_prompt_logprobs([0, 3], [None, pos], 2, token_str)
    assert prompt is not None and prompt[0] is None
    assert prompt[1] == {
        "3": {"logprob": lp[3], "rank": None, "decoded_token": "d"},
        "1": {"logprob": lp[1], "rank": 1, "decoded_token": "b"},
        "2": {"logprob": lp[2], "rank": 2, "decoded_token": "c"},
    }
    assert all(math.isfinite(v) for v in comp["top_logprobs"][0].values())
