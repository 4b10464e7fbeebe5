"""Structured outputs (xgrammar) in the engine, on the real SmolLM2-135M-Instruct, greedy.

* JSON schemas (24: nested objects, arrays, enums, required fields, ranges, patterns): every
  output finishes, parses and validates (``jsonschema``), with and without free whitespace;
* regexes full-match, choices are one of the choices;
* unconstrained requests batched with constrained ones give the tokens they give alone, and a
  constrained request gives the same tokens alone, in a batch, from the prefix cache, with
  chunked prefill, and through preemption and recompute on a tiny KV pool;
* ``n > 1`` sequences each follow the grammar; stop strings and aborts compose;
* bad constraints are a ``ValueError`` naming the problem; beam search with one is refused.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import torch
from structured_cases import CHOICES, REGEXES, SCHEMAS

from radixkv import Engine, SamplingParams, StructuredOutputs

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(real_model: Any) -> Engine:
    return Engine(real_model, page_size=16, dtype="float32", kv_cache_tokens=8192)


def chat(engine: Engine, question: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": question}])


def greedy(spec: StructuredOutputs | None, max_tokens: int = 80, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=spec, **kw)


@pytest.mark.parametrize("compact", [False, True], ids=["any-whitespace", "compact"])
def test_json_schemas_parse_and_validate(engine: Engine, compact: bool) -> None:
    assert len(SCHEMAS) >= 20
    prompts = [chat(engine, q + " Answer in JSON.") for q, _ in SCHEMAS]
    params = [greedy(StructuredOutputs(json=s, disable_any_whitespace=compact)) for _, s in SCHEMAS]
    outs = engine.generate(prompts, params)
    for (question, schema), out in zip(SCHEMAS, outs):
        assert out.finish_reason == "stop", (question, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        if compact:
            assert "\n" not in out.text
    engine.check_integrity()


def test_json_object_regex_and_choice(engine: Engine) -> None:
    cases: list[tuple[str, StructuredOutputs]] = [
        ("Give a JSON object with the key ok set to true.", StructuredOutputs(json_object=True)),
        *((q, StructuredOutputs(regex=r)) for q, r in REGEXES),
        *((q, StructuredOutputs(choice=c)) for q, c in CHOICES),
    ]
    outs = engine.generate([chat(engine, q) for q, _ in cases], [greedy(s, 40) for _, s in cases])
    obj = json.loads(outs[0].text)
    assert isinstance(obj, dict) and outs[0].finish_reason == "stop"
    for (_, spec), out in list(zip(cases, outs))[1:]:
        assert out.finish_reason == "stop", out.text
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, out.text), (spec.regex, out.text)
        else:
            assert out.text in (spec.choice or []), out.text


def test_unconstrained_rows_untouched_and_constrained_rows_batch_invariant(
    engine: Engine,
) -> None:
    free_prompts = [chat(engine, q) for q in ("Name a river.", "What is a cloud?")]
    free = greedy(None, 12, ignore_eos=True)
    alone = [o.token_ids for o in engine.generate(free_prompts, free)]
    spec = StructuredOutputs(json=SCHEMAS[0][1])
    (json_alone,) = engine.generate([chat(engine, SCHEMAS[0][0])], greedy(spec))
    mixed = engine.generate(
        [free_prompts[0], chat(engine, SCHEMAS[0][0]), free_prompts[1]],
        [free, greedy(spec), free],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert mixed[1].token_ids == json_alone.token_ids
    # the second time the prompt is served from the prefix cache: same tokens
    (again,) = engine.generate([chat(engine, SCHEMAS[0][0])], greedy(spec))
    assert again.cached_tokens > 0 and again.token_ids == json_alone.token_ids


def test_preemption_recompute_and_chunked_prefill_keep_constrained_outputs(
    real_model: Any, engine: Engine
) -> None:
    cases = SCHEMAS[:6]
    prompts = [chat(engine, q + " Answer in JSON.") for q, _ in cases]
    params = [greedy(StructuredOutputs(json=s), 60) for _, s in cases]
    want = [o.token_ids for o in engine.generate(prompts, params)]
    tight = Engine(
        real_model, page_size=16, dtype="float32", kv_cache_tokens=160, chunked_prefill_tokens=32
    )
    tokens: dict[str, list[int]] = {f"pre-{i}": [] for i in range(len(prompts))}
    for rid, prompt, p in zip(tokens, prompts, params):
        tight.add_request(rid, prompt, p)
    while tight.has_unfinished():
        for out in tight.step():
            tokens[out.request_id] += out.new_token_ids
        for seq in (*tight.scheduler.running, *tight.scheduler.waiting):
            # the matcher has accepted exactly the outputs, preempted or not
            assert seq.grammar.accepted == len(seq.output_ids), seq.request_id
    assert tight.stats()["preemptions_total"] > 0, "the tiny pool was meant to force preemption"
    assert list(tokens.values()) == want
    for (_, schema), ids in zip(cases, tokens.values()):
        text = tight.tokenizer.decode(ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)
    tight.check_integrity()


def test_parallel_samples_each_follow_the_grammar(engine: Engine) -> None:
    spec = StructuredOutputs(regex=r"[a-z]{2,6}-[0-9]{2}")
    params = SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=7, structured_outputs=spec)
    (out,) = engine.generate([chat(engine, "Make up a product code.")], params)
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert re.fullmatch(spec.regex or "", c.text), c.text
        assert c.finish_reason == "stop"


def test_stop_string_and_max_tokens_cut_a_constrained_output(engine: Engine) -> None:
    spec = StructuredOutputs(json=SCHEMAS[0][1], disable_any_whitespace=True)
    prompt = chat(engine, SCHEMAS[0][0])
    (full,) = engine.generate([prompt], greedy(spec))
    (cut,) = engine.generate([prompt], greedy(spec, stop=['"age"']))
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index('"age"')]
    (short,) = engine.generate([prompt], greedy(spec, 3))
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:3]


def test_abort_of_a_constrained_request_releases_everything(engine: Engine) -> None:
    engine.add_request(
        "so-abort", chat(engine, "JSON please."), greedy(StructuredOutputs(json_object=True), 50)
    )
    for _ in range(4):
        engine.step()
    assert engine.abort("so-abort")
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert engine.stats()["running"] == 0


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (StructuredOutputs(regex="(ab"), "regex"),
        (StructuredOutputs(json={"type": "frobnicate"}), "frobnicate"),
        (StructuredOutputs(grammar="root ::= missing_rule"), "missing_rule"),
        (StructuredOutputs(json="{not json"), "not valid JSON"),
        (StructuredOutputs(regex="a", choice=["a"]), "exactly one"),
        (StructuredOutputs(), "exactly one"),
    ],
)
def test_bad_constraints_raise_value_error(engine: Engine, spec: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        engine.generate("hi", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert not engine.has_unfinished()


def test_beam_search_with_a_grammar_is_refused(engine: Engine) -> None:
    params = SamplingParams(
        n=2, use_beam_search=True, temperature=0.0, structured_outputs=StructuredOutputs(regex="a")
    )
    with pytest.raises(ValueError, match="use_beam_search"):
        engine.generate("hi", params)


def test_a_compiling_grammar_holds_only_its_own_request(engine: Engine) -> None:
    """Both compile workers busy: the constrained request waits unscheduled while a free one
    runs to the end; released, it runs too. Past its deadline a compile fails its request."""
    import threading

    pool = engine.grammars.pool
    gate = threading.Event()
    blockers = [pool._pool.submit(gate.wait) for _ in range(2)]  # occupy both workers
    try:
        spec = StructuredOutputs(regex=r"held-[0-9]{2}")
        engine.add_request("so-held", chat(engine, "A code."), greedy(spec, 12))
        engine.add_request("so-free", chat(engine, "Hi."), greedy(None, 4, ignore_eos=True))
        done: set[str] = set()
        for _ in range(10):
            done |= {o.request_id for o in engine.step() if o.finished}
        # (an earlier test's abort may report here too: only these two requests are judged)
        assert "so-free" in done and "so-held" not in done
        (held,) = engine.scheduler.waiting
        assert held.request_id == "so-held" and not held.grammar.ready
    finally:
        gate.set()
    text = ""
    while engine.has_unfinished():
        text += "".join(o.new_text for o in engine.step() if o.request_id == "so-held")
    assert re.fullmatch(r"held-[0-9]{2}", text), text
    gate.clear()
    blockers = [pool._pool.submit(gate.wait) for _ in range(2)]
    engine.grammars.timeout_s = 0.2
    try:
        engine.add_request("so-late", "hi", greedy(StructuredOutputs(regex=r"late[0-9]"), 4))
        outs: list[Any] = []
        while engine.has_unfinished():
            outs.extend(engine.step())
    finally:
        engine.grammars.timeout_s = 10.0
        gate.set()
    assert outs[-1].finish_reason == "error" and "did not compile within 0.2 s" in outs[-1].error
    for b in blockers:
        b.result(5)
    engine.check_integrity()


def test_compile_cache_is_bounded_by_entries_and_bytes(engine: Engine) -> None:
    from radixkv.engine.grammar import GrammarCompilerPool

    specs = [StructuredOutputs(regex=f"[0-9]{{{i}}}") for i in range(1, 5)]
    pool = GrammarCompilerPool(engine.tokenizer, engine.vocab_size, [2], cache_size=2)
    futures = [pool.submit(s) for s in specs]
    for f in futures:
        f.result(10)
    assert pool.submit(specs[-1]) is futures[-1]  # kept: the newest two
    assert pool.submit(specs[0]) is not futures[0]  # dropped: compiled again
    assert pool.misses == 5 and pool.hits == 1
    small = GrammarCompilerPool(engine.tokenizer, engine.vocab_size, [2], cache_bytes=1)
    for s in specs:
        small.compile(s)
    assert small.cached_bytes > 0 and len(small._cache) == 1  # only the newest fits
    pool.close()
    small.close()


def test_compile_cache_and_a_failed_compile_in_the_engine_queue(engine: Engine) -> None:
    pool = engine.grammars.pool
    spec = StructuredOutputs(regex=r"[0-9]{4}")
    first = pool.submit(spec)
    assert pool.submit(StructuredOutputs(regex=r"[0-9]{4}")) is first  # cached by key
    # a bad constraint added straight to the engine (no pre-compile) fails that request alone
    bad = StructuredOutputs(regex=r"(unclosed")
    engine.add_request("so-bad", "hi", greedy(bad, 4))
    engine.add_request("so-good", "hi", greedy(spec, 8))
    outs: list[Any] = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    failed = [o for o in outs if o.request_id == "so-bad"]
    assert failed and failed[-1].finish_reason == "error" and "parenthesis" in failed[-1].error
    text = "".join(o.new_text for o in outs if o.request_id == "so-good")
    assert re.fullmatch(r"[0-9]{4}", text), text
    engine.check_integrity()


def test_bitmask_fill_ahead_serves_unmoved_rows_and_refills_moved_ones(engine: Engine) -> None:
    """The step's bitmask fill runs during the forward (``prefetch``); ``mask`` must take only
    rows whose matcher has not moved since and fill the rest itself."""
    rt = engine.grammars
    spec = StructuredOutputs(json=SCHEMAS[0][1])
    seqs = [SimpleNamespace(grammar=rt.start(greedy(spec))) for _ in range(3)]
    for s in seqs:
        s.grammar.future.result()
    zeros = torch.zeros(3, engine.vocab_size)
    fresh = rt.mask(zeros.clone(), seqs)  # no fill-ahead: filled here
    rt.prefetch(seqs)
    rt._ahead.future.result()
    rt._ahead.bitmask[0] = 0  # a marker: row 0 must come from the fill-ahead (all masked)
    assert not seqs[1].grammar.accept(int(fresh[1].argmax()))  # row 1 moves after the prefetch
    ahead = rt.mask(zeros.clone(), seqs)
    assert torch.isinf(ahead[0]).all()
    assert torch.equal(ahead[2], fresh[2])
    refilled = rt.mask(zeros.clone(), seqs)  # row 1 at its new state, filled here
    assert torch.equal(ahead[1], refilled[1]) and not torch.equal(ahead[1], fresh[1])
    assert rt._ahead is None


THINK = ("<think>", "</think>")


def test_a_constraint_after_reasoning_waits_for_the_end_marker(engine: Engine) -> None:
    """``after_reasoning``: while the reasoning block is open the row is neither masked nor
    matched (tokens the grammar forbids are taken); the token that completes the end marker
    opens the gate, and from the next token on the grammar masks and matches."""
    rt, tok = engine.grammars, engine.tokenizer
    spec = StructuredOutputs(choice=["yes", "no"], after_reasoning=THINK)
    state = rt.start(greedy(spec), None, prompt_ids=chat(engine, "Yes or no?"))
    state.future.result()
    assert not state.active
    row = SimpleNamespace(grammar=state)
    logits = torch.randn(1, engine.vocab_size)
    outputs: list[int] = []
    for token in tok.encode("maybe, let me see", add_special_tokens=False):
        outputs.append(token)
        assert state.accept(token, outputs) is False  # the grammar would reject these
        assert torch.equal(rt.mask(logits.clone(), [row]), logits)  # untouched while open
    end = tok.encode("</think>", add_special_tokens=False)
    for token in end:
        outputs.append(token)
        assert state.accept(token, outputs) is False
    assert state.active and state.offset == len(outputs) and state.accepted == 0
    masked = rt.mask(logits.clone(), [row])
    maybe = tok.encode("maybe", add_special_tokens=False)[0]
    yes = tok.encode("yes", add_special_tokens=False)[0]
    assert masked[0, maybe] == float("-inf") and masked[0, yes] == logits[0, yes]
    with pytest.raises(ValueError, match="does not allow"):
        state.accept(maybe, [*outputs, maybe])
    # the prompt decides where the block stands: closed (its last end after its last start)
    closed = chat(engine, "Yes or no?") + tok.encode("<think>ok</think>", add_special_tokens=False)
    assert rt.start(greedy(spec), None, prompt_ids=closed).active
    reopened = closed + tok.encode("<think>", add_special_tokens=False)
    assert not rt.start(greedy(spec), None, prompt_ids=reopened).active


def test_generation_is_free_while_reasoning_and_constrained_after(engine: Engine) -> None:
    """Greedy, through the engine: a prompt that opened a reasoning block gives the
    unconstrained tokens (the block never ends within max_tokens here); one whose block is
    closed answers one of the choices."""
    tok = engine.tokenizer
    question = chat(engine, "Is the sky blue? Think first.")
    opened = question + tok.encode("<think>", add_special_tokens=False)
    spec = StructuredOutputs(choice=["yes", "no"], after_reasoning=THINK)
    (free,) = engine.generate([opened], greedy(None, 12, ignore_eos=True))
    assert "</think>" not in free.text  # the premise: SmolLM2 does not close it so soon
    (gated,) = engine.generate([opened], greedy(spec, 12, ignore_eos=True))
    assert gated.token_ids == free.token_ids
    closed = opened + tok.encode("It is.</think>", add_special_tokens=False)
    (answer,) = engine.generate([closed], greedy(spec, 12))
    assert answer.text in ("yes", "no") and answer.finish_reason == "stop"
    with pytest.raises(ValueError, match="after_reasoning"):
        StructuredOutputs(regex="a", after_reasoning=("<think>", "")).validate()
    engine.check_integrity()
