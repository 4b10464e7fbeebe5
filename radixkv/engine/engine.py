"""The engine: requests in, tokens out, over a radix-tree prefix cache and a paged KV pool.

``add_request`` -> ``step`` (schedule, forward, sample, publish to the tree) -> ``StepOutput``s.
``generate`` and ``chat`` are the offline API built on those steps.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq
from typing import Any

import torch

from radixkv.config import EngineConfig
from radixkv.engine.assembly import assemble
from radixkv.engine.beam_runner import BeamRunner, beam_request_output
from radixkv.engine.beam_search import BeamSearchParams
from radixkv.engine.chat_template import render_chat
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.grammar import StructuredRuntime
from radixkv.engine.integrity_report import check_engine_integrity, integrity_report
from radixkv.engine.lifecycle import SequenceLifecycle, finish_reason
from radixkv.engine.lifetime import track, untrack
from radixkv.engine.logits_fields import check_token_ids
from radixkv.engine.logprobs import TokenTexts, collect_prompt_logprobs
from radixkv.engine.outputs import engine_stats, request_output, step_output, with_prompt_logprobs
from radixkv.engine.pinning import check_fits_beside_pins, pin_prompt
from radixkv.engine.request import Prompt, RequestOutput, Sequence, StepOutput, now
from radixkv.engine.sampler import SamplerOutput, SequenceState
from radixkv.engine.sampling import SamplingParams
from radixkv.model.runner import RequestSlice

Params = SamplingParams | BeamSearchParams
logger = logging.getLogger(__name__)


class Engine:
    """An LLM engine whose KV cache is a prefix store.

    ``Engine(model="smollm2", page_size=16, kv_cache_tokens=None, enable_prefix_cache=True,
    schedule_policy="lpm", eviction_policy="lru", chunked_prefill_tokens=2048,
    mixed_prefill_tokens=2048, mixed_prefill_min_tokens=512, max_running_requests=128,
    dtype=None, ...)`` — see :class:`~radixkv.config.EngineConfig` for every knob. ``model`` may
    also be an already loaded :class:`~radixkv.model.loader.LoadedModel` (tests use a tiny random
    Llama that way). Not thread-safe: one thread drives it (the server has a loop thread).
    """

    def __init__(self, model: Any = "smollm2", **knobs: Any) -> None:
        unknown = set(knobs) - set(EngineConfig.knob_names())
        if unknown:
            raise TypeError(
                f"unknown Engine option(s) {sorted(unknown)}; "
                f"valid options: {', '.join(EngineConfig.knob_names())}"
            )
        self.config = EngineConfig(model=model if isinstance(model, str) else "custom", **knobs)
        self.config.validate()
        p = assemble(self.config, model)  # every collaborator, built and wired there
        self.model_name, self.tokenizer, self.runner = p.model_name, p.tokenizer, p.runner
        self.sampler, self.page_size, self.chat_template = p.sampler, p.page_size, p.chat_template
        self.allocator, self.tree, self.kv = p.allocator, p.tree, p.kv
        self.virtual_layout, self.tiers, self.scheduler = p.virtual_layout, p.tiers, p.scheduler
        self.max_model_len, self.kv_capacity_tokens = p.max_model_len, p.kv_capacity_tokens
        self.eos_token_ids, self.vocab_size = p.eos_token_ids, p.vocab_size
        cfg = self.config
        self.max_running_requests = cfg.max_running_requests
        self.lifecycle = SequenceLifecycle(self.scheduler, self.kv, self.tokenizer)
        self.token_texts = TokenTexts(self.tokenizer)
        self.grammars = StructuredRuntime(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._pending: list[StepOutput] = []
        self._ids = itertools.count()
        self._rng = torch.Generator().manual_seed(cfg.seed)
        names = ("requests", "prompt_tokens", "cached_tokens", "generated_tokens", "steps")
        self.counters = dict.fromkeys((*names, "forward_tokens"), 0)
        self.beams = BeamRunner(
            self.lifecycle,
            self.eos_token_ids,
            self.token_texts,
            self.counters,
            self.page_size,
            self.runner.num_pages,
            cfg.enable_prefix_cache,
        )
        self.cached_by_tier = {"device": 0, "host": 0, "disk": 0}
        if cfg.remote_cache_url:
            self.cached_by_tier["remote"] = 0
        self.closed = False
        track(self)  # closed at interpreter exit (weakly: tracking keeps no engine alive)

    # -- lifetime ----------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> dict[str, Any]:
        """Make the disk tier durable and stop the tiers' writer threads (idempotent; also
        ``with Engine(...) as e:`` and at interpreter exit). Every cached page (device or host)
        not yet on disk is written and queued writes drained, within ``timeout`` seconds
        (default ``radixkv.cache.tiers.CLOSE_TIMEOUT_S``); pages, bytes and seconds are logged
        and returned. Call it when no step is running (the server stops its loop first)."""
        if getattr(self, "closed", True):
            return {}
        self.closed = True
        untrack(self)
        if self.tiers is None:
            return {}
        return self.tiers.shutdown(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("a prompt is a string or a list of integer token ids")
        return list(prompt)

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | BeamSearchParams | None = None,
        salt: str | None = None, owner: str | None = None,
    ) -> None:  # fmt: skip
        """Validate and queue a request; raises ``ValueError`` saying what to fix. ``owner``:
        the caller's key, for per-key bounds (``CompileQueueFullError`` past them)."""
        if isinstance(params, BeamSearchParams):
            params = params.to_sampling_params()
        params = params or SamplingParams()
        params.validate()
        if request_id in self.lifecycle:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {self.vocab_size})")
        check_token_ids(params, self.vocab_size)  # logit_bias keys
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context length of {self.max_model_len} tokens"
            )
        if total > self.kv_capacity_tokens:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the KV cache ({self.kv_capacity_tokens} tokens): raise kv_cache_tokens"
            )
        if params.use_beam_search:
            self.beams.check_capacity(len(ids), params)
        if salt is not None and not isinstance(salt, str):
            raise ValueError("salt must be a string")
        check_fits_beside_pins(self, ids, total, salt)
        grammar = self.grammars.start(params, owner, ids)  # compiles off-thread, unscheduled
        seq = Sequence(
            request_id=request_id,
            index=0,
            prompt_ids=ids,
            params=params,
            salt=salt,
            arrival=now(),
            detok=IncrementalDetokenizer.for_params(self.tokenizer, params),
            generator=self._generator(params, 0),
            fork_children=0 if params.use_beam_search else params.n - 1,
            grammar=grammar,
        )
        if params.prompt_logprobs is not None:  # computed, not read from the cache
            seq.skip_cache_read = True
            seq.prompt_logprobs = [None] * len(ids)
        self.counters["requests"] += 1
        self.lifecycle.admit(seq)
        if params.use_beam_search:
            self.beams.start(seq)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator().manual_seed(params.seed + index)

    def abort(self, request_id: str) -> bool:
        """Stop a request; its pages go back (computed full pages stay cached). False if unknown."""
        if request_id in self.beams.searches:
            self._pending.extend(self.beams.abort(request_id))
            return True
        if request_id not in self.lifecycle:
            return False
        ended = self.lifecycle.end_request(request_id, "abort")
        self._pending.extend(step_output(seq, [], "", None) for seq in ended)
        return True

    def fail_request(self, request_id: str, message: str) -> bool:
        """Fail one request alone (an error inside a step that only it caused): like
        :meth:`abort`, but its sequences finish with reason ``"error"`` and an output carrying
        ``message``. Its pages go back; the other requests are untouched. False if unknown."""
        if request_id not in self.lifecycle:
            return False
        seqs = self.lifecycle.live(request_id)
        self.counters["failed_requests"] = self.counters.get("failed_requests", 0) + 1
        self.abort(request_id)
        for out in self._pending:
            if out.request_id == request_id and out.finish_reason == "abort":
                out.finish_reason = "error"
                out.error = message
        for seq in seqs:
            if seq.finish_reason == "abort":
                seq.finish_reason = "error"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def next_request_id(self, prefix: str) -> str:
        """A request id of the engine's own making, ``PREFIX-N`` (N counts up)."""
        return f"{prefix}-{next(self._ids)}"

    def defer_outputs(self, outputs: list[StepOutput]) -> None:
        """Hand ``outputs`` back: the next :meth:`step` returns them first."""
        self._pending[:0] = outputs

    def drop_outputs(self, request_id: str) -> list[StepOutput]:
        """Take ``request_id``'s outputs out of those the next :meth:`step` returns."""
        mine = [o for o in self._pending if o.request_id == request_id]
        self._pending = [o for o in self._pending if o.request_id != request_id]
        return mine

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one batch: schedule, forward, sample, publish. Returns what each sequence made."""
        self.grammars.fail_broken(self.scheduler.waiting, self.fail_request)
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch.entries:
            if self.grammars.wait_pending(self.scheduler.waiting):
                return outputs  # only grammars still compiling: nothing is stuck
            stuck = self.scheduler.running or self.scheduler.waiting
            if stuck:
                # Work exists but nothing could be scheduled: no page can be freed (pinned
                # prefixes hold the rest of the pool), so no later step would differ. Fail the
                # oldest request rather than spin forever.
                seq = stuck[0]
                logger.warning(
                    "request %s cannot fit in the KV cache (%d tokens pinned); aborting it",
                    seq.request_id,
                    self.tree.protected_size,
                )
                self.abort(seq.request_id)
                outputs.extend(self._pending)
                self._pending = []
            return outputs
        self.counters["steps"] += 1
        self.counters["forward_tokens"] += batch.num_tokens
        for seq, _ in batch.entries:
            if not seq.accounted:
                self._account_admission(seq)
        all_rows = any(seq.skip_cache_read for seq, _ in batch.entries)
        fb = self.runner.build_batch(
            [
                RequestSlice(
                    seq.tokens[seq.num_computed : seq.num_computed + n],
                    seq.num_computed,
                    seq.pages,
                )
                for seq, n in batch.entries
            ]
        )
        if self.virtual_layout is not None:
            self.virtual_layout.before_forward(fb, [seq for seq, _ in batch.entries])
        self.grammars.prefetch(  # the rows that sample this step, unless the last step began it
            (
                seq
                for seq, n in batch.entries
                if seq.num_computed + n >= seq.num_tokens and seq.gang is None
            ),
            keep_started=True,
        )
        logits = self.runner.forward(fb, return_all_logits=all_rows, float_logits=all_rows)
        if all_rows:  # some prompt wants its logprobs: every row was computed
            logits = collect_prompt_logprobs(logits, batch.entries, self.token_texts)
        rows: list[int] = []
        to_sample: list[Sequence] = []
        for row, (seq, n) in enumerate(batch.entries):
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:  # a prefill chunk that is not the last
                self.kv.publish(seq)
                continue
            if len(seq.output_ids) == 0 and seq.num_tokens == len(seq.prompt_ids):
                self.kv.publish(seq)  # the whole prompt is computed: share it now
                for child in self._fork(seq):
                    rows.append(row)
                    to_sample.append(child)
            if seq.gang is not None:  # a beam: its search picks the next tokens
                self.beams.offer(seq, logits[row].float())
                continue
            rows.append(row)
            to_sample.append(seq)
        if to_sample:
            self._sample_and_advance(logits, rows, to_sample, outputs)
        self.beams.advance_ready(outputs)
        if self.virtual_layout is not None:
            self.virtual_layout.after_step(self.scheduler.running)
        # the next step's bitmasks for the decoding rows: filled while this step's outputs are
        # published and the next one is scheduled (single-threaded work) and its forward runs
        self.grammars.prefetch(
            s for s in self.scheduler.running if not s.in_prefill and s.gang is None
        )
        return outputs

    def _account_admission(self, seq: Sequence) -> None:
        seq.accounted = True
        self.counters["prompt_tokens"] += len(seq.prompt_ids)
        self.counters["cached_tokens"] += seq.cached_tokens or 0
        by_tier = seq.cached_by_tier or {"device": seq.cached_tokens or 0}
        seq.cached_by_tier = by_tier
        for tier, n in by_tier.items():
            self.cached_by_tier[tier] = self.cached_by_tier.get(tier, 0) + n

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: n - 1 siblings share the parent's prompt pages (copy-on-write)."""
        children = [
            self.lifecycle.fork(parent, index, self._generator(parent.params, index))
            for index in range(1, parent.fork_children + 1)
        ]
        parent.fork_children = 0
        return children

    def _sample_and_advance(
        self,
        logits: torch.Tensor,
        rows: list[int],
        seqs: list[Sequence],
        outputs: list[StepOutput],
    ) -> None:
        if rows != list(range(logits.shape[0])):
            logits = logits.index_select(
                0, torch.tensor(rows, dtype=torch.long, device=logits.device)
            )
        picked = self.grammars.mask(logits, seqs)
        states = [
            SequenceState(s.params, s.prompt_ids, s.output_ids, s.generator or self._rng)
            for s in seqs
        ]
        failed: dict[str, str] = {}  # request id -> why (an error only that request caused)
        try:
            sampled = self.sampler.sample(picked, states)
        except Exception:  # find the rows that raise, sample the others
            n = len(seqs)
            sampled = SamplerOutput([-1] * n, [None] * n, [None] * n, [None] * n)
            for i, (seq, state) in enumerate(zip(seqs, states)):
                try:
                    one = self.sampler.sample(picked[i : i + 1], [state])
                    sampled.token_ids[i], sampled.logprobs[i] = one.token_ids[0], one.logprobs[0]
                    sampled.ranks[i], sampled.top_logprobs[i] = one.ranks[0], one.top_logprobs[0]
                except Exception as exc:
                    logger.exception("sampling failed for request %s", seq.request_id)
                    failed.setdefault(seq.request_id, f"sampling failed: {exc}")
        t = now()
        per_row = zip(sampled.token_ids, sampled.logprobs, sampled.ranks, sampled.top_logprobs)
        for seq, (token, logprob, rank, top) in zip(seqs, per_row):
            if seq.request_id in failed:
                continue
            try:
                if seq.first_token_time is None:
                    seq.first_token_time = t
                seq.output_ids.append(token)
                entry = self.token_texts.logprobs(token, logprob, rank, top)  # None: not asked
                if entry is not None:
                    seq.output_logprobs.append(entry)
                self.counters["generated_tokens"] += 1
                reason = finish_reason(seq, token, self.eos_token_ids, self.max_model_len)
                delta, stopped = seq.detok.update(seq.output_ids, final=reason is not None)
                if stopped:
                    reason, seq.stop_reason = "stop", seq.detok.stop_reason
                if reason is not None:
                    self.lifecycle.finish(seq, reason)
            except Exception as exc:
                logger.exception("output processing failed for request %s", seq.request_id)
                failed.setdefault(seq.request_id, f"{type(exc).__name__}: {exc}")
                continue
            out = step_output(seq, [token], delta, None if entry is None else [entry])
            outputs.append(with_prompt_logprobs(out, seq))
        for request_id, why in failed.items():
            outputs[:] = [o for o in outputs if o.request_id != request_id]
            self.fail_request(request_id, why)
            outputs.extend(self.drop_outputs(request_id))

    # -- offline API -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: Params | Seq[Params] | None = None,
        salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token id lists) and return outputs in order.

        ``use_beam_search`` requests (or :class:`BeamSearchParams`) return their ``n`` best beams
        with their ``score`` and ``cumulative_logprob``."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, (SamplingParams, BeamSearchParams)):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
        self.grammars.wait_all(params_list)  # a constraint that does not compile: ValueError
        ids = [self.next_request_id("gen") for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p, salt=salt)
        seqs = {rid: self.lifecycle.live(rid) for rid in ids}
        beam_outs: dict[str, list[StepOutput]] = {r: [] for r in ids if r in self.beams.searches}
        while any(rid in self.lifecycle for rid in ids):
            for out in self.step():
                if out.request_id in beam_outs:
                    beam_outs[out.request_id].append(out)
            for rid in ids:  # forked siblings appear after the prompt's prefill
                seqs[rid] = self.lifecycle.requests.get(rid, seqs[rid])
        return [
            beam_request_output(rid, prompt, seqs[rid][0], beam_outs[rid])
            if rid in beam_outs
            else request_output(rid, prompt, seqs[rid])
            for rid, prompt in zip(ids, prompts)
        ]

    def apply_chat_template(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """Token ids of a conversation ready to answer; ``options``: :func:`~radixkv.engine.
        chat_template.render_chat`'s (``chat_template`` defaults to the engine's knob)."""
        options.setdefault("chat_template", self.chat_template)
        return render_chat(self.tokenizer, messages, **options)

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        salt: str | None = None,
        **options: Any,
    ) -> list[RequestOutput]:
        """:meth:`generate` for conversations; ``options``: :meth:`apply_chat_template`'s."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.apply_chat_template(c, **options) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, salt=salt)

    # -- cache administration ----------------------------------------------------------------
    def flush_cache(self, drop_pins: bool = False) -> bool:
        """Drop every cached prefix but the pinned ones (``drop_pins``: those too). Refused
        (False, nothing done) while requests are in flight."""
        if self.scheduler.has_work():
            return False
        if drop_pins:
            self.tree.unpin_all()
        self.tree.reset()
        if self.tiers is not None:
            self.tiers.flush()
        return True

    def pin_prefix(
        self,
        prompt: Prompt,
        salt: str | None = None,
        ttl: float | None = None,
        *,
        budget: int | None = None,
        namespace_budget: int | None = None,
        compute: bool = True,
    ) -> int:
        """Pin the cached part of ``prompt`` so it is never evicted (until ``ttl`` seconds pass).

        The prompt is computed first when it is not cached yet (unless ``compute`` is False:
        then only what is cached is pinned). Returns the tokens pinned. A pin past ``budget`` /
        ``namespace_budget`` tokens raises :class:`~radixkv.cache.pins.PinBudgetError` (see
        :meth:`RadixTree.pin`).
        """
        return pin_prompt(self, prompt, salt, ttl, budget, namespace_budget, compute)

    def unpin_prefix(self, prompt: Prompt, salt: str | None = None) -> int:
        """Remove every pin on the cached path of ``prompt``; returns the pins removed."""
        return self.tree.unpin(self.tokenize(prompt), salt=salt)

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Queue lengths, page occupancy, cache sizes and running totals (see
        :func:`~radixkv.engine.outputs.engine_stats` for the keys)."""
        return engine_stats(self)

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the tree, allocator or page tables is broken."""
        check_engine_integrity(self)

    def integrity_report(self) -> dict[str, Any]:
        """:meth:`check_integrity` and the pages nobody owns, as a report (never raises; see
        :func:`~radixkv.engine.integrity_report.integrity_report`)."""
        return integrity_report(self)
