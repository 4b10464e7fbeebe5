"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step shares one token budget (``chunked_prefill_tokens``) between decodes (one token each,
served first so they are never starved) and prefills (the uncached suffix of a prompt, in chunks
that fit the rest of the budget). A step with no decode keeps the whole budget. A step that
decodes gives prefill the waiting requests' share of it: with w requests waiting for a first
token (queued, or admitted and still in prefill) and d decodes, ``chunked_prefill_tokens`` x
w / (w + d) tokens, within [``mixed_prefill_min_tokens`` (512), ``mixed_prefill_tokens``
(2,048)] (:meth:`Scheduler.mixed_budget`). A burst's first steps, when nearly every request
waits, keep long chunks (fewer steps, its throughput); as first tokens come out the steps
shorten, so the requests still waiting finish in finer steps and the decodes wait less; once
what all of them still need (past their cached prefixes) fits in ``mixed_prefill_tokens``, one
step takes it all (a cold multi-turn burst's tail ran as four steps of ~500 tokens, each
carrying ~50 decodes, where a 2,048-row step costs ~0.6-0.7x as much per token in the
linears: AVX512-BF16/AMX host, docs/performance.md). (A
fixed 2,048 made the median request of a warm multi-turn burst, ~73 new tokens a prompt, wait
for the end of a second whole 2,048-token step; a fixed 512 cut that but split a cold burst's
prefill into many short steps, each with every decode in it: AVX512-BF16/AMX host, vLLM's
client, docs/performance.md.) A floor at or above the cap is a fixed budget. Pages come from the
free pool, then from evicting unlocked cache, then from preempting running sequences, newest
first, by recompute.

In-step prefix sharing: a waiting request that shares a prefix (at least ``DEDUPE_MIN_TOKENS``
and a page, not yet cached) with a prefill in this step's batch borrows that prefill's pages for
the shared whole pages (``KVManager.borrow``) and computes only the rest in the same step: every
backend writes a layer's new K/V for the whole batch before it attends, so the borrowed pages
hold the prefix when the borrower reads them. A burst of chats on one new system prompt thus
gets its first tokens one step after the prompt arrives, not two; under ``lpm``/``dfs-weight``
such borrowers are admitted right after the prefill they borrow from, before other prompts'
cold prefixes. When the sibling's chunk stops short of the shared pages, the request waits for
them to reach the tree (it never computes them twice).

A waiting sequence whose host/disk hit does not fit in the device pages the running sequences
leave waits for them (up to ``LOAD_WAIT_STEPS`` steps); with nothing running, or after that,
the longest prefix of the hit that fits is loaded and the rest recomputed (partial load-back).

A *gang* (``Sequence.gang``: a beam search's beams) is one unit for admission and preemption:
its waiting members are admitted all together or not at all, preempting any member preempts
all of them, and a gang with a member already scheduled this step is never a victim. Parked
members (every token computed, waiting for their siblings) are not scheduled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from radixkv.cache.prefix import common_prefix_len
from radixkv.config import EngineConfig
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import SeqStatus, Sequence, now

# A waiting request that shares at least this many not-yet-cached tokens with a request being
# prefilled waits for that prefill to reach the tree instead of computing the same tokens again.
DEDUPE_MIN_TOKENS = 32
# Longest-prefix-match ordering costs a tree match per waiting request; past this queue length
# the scheduler falls back to arrival order (as SGLang does).
LPM_MAX_QUEUE = 128
# A request whose host/disk hit does not fit in the device pages left by running requests waits
# for them to free pages (they finish or are preempted) for at most this many steps; then, or at
# once when nothing runs, the longest prefix that fits is loaded and the rest recomputed.
LOAD_WAIT_STEPS = 64


@dataclass
class ScheduledBatch:
    """The work of one step: ``(sequence, number of new tokens to feed)`` pairs, in batch order."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)


class Scheduler:
    """Owns the waiting queue and the running set; see the module docstring for the policy."""

    def __init__(self, config: EngineConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admit_counter = 0
        self.num_preemptions = 0
        self.num_load_waits = 0
        #: prompt tokens admitted sequences took from a sibling's prefill in the same step
        self.num_borrowed_tokens = 0
        self._load_waits: dict[tuple[str, int], int] = {}  # steps each sequence waited so far

    # -- queue -------------------------------------------------------------------------------
    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = SeqStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        self._load_waits.pop((seq.request_id, seq.index), None)
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def start_fork(self, parent: Sequence, child: Sequence) -> None:
        """Run ``child`` beside ``parent``: it shares the parent's pages (copy-on-write of the
        tail page, :meth:`KVManager.fork`) and joins the running set as the newest admission."""
        self.kv.fork(parent, child)
        child.status = SeqStatus.RUNNING
        self._admit_counter += 1
        child.admit_order = self._admit_counter
        self.running.append(child)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.chunked_prefill_tokens
        scheduled: set[int] = set()
        # 1. decodes, oldest first (a gang's decode-ready members at once); pages by eviction,
        #    then by preempting the newest.
        for seq in sorted(self.running, key=lambda s: s.admit_order):
            if not self._decode_ready(seq) or id(seq) in scheduled:
                continue
            unit = [m for m in members(seq) if self._decode_ready(m)]
            if not all(self._reserve(m, 1, batch, scheduled) for m in unit):
                continue  # the unit itself was preempted
            for m in unit:
                batch.entries.append((m, 1))
                scheduled.add(id(m))
            budget -= len(unit)
        if batch.entries:  # decodes run this step: their share of it (module docstring)
            budget = min(budget, self.mixed_budget(len(batch.entries)))
        # 2. prefills already under way (chunked), oldest first.
        for seq in sorted(self.running, key=lambda s: s.admit_order):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING or not seq.in_prefill or id(seq) in scheduled:
                continue
            want = min(budget, seq.num_tokens - seq.num_computed)
            chunk = self._fit_chunk(seq, want)
            while chunk == 0 and self._preempt_newer_than(seq, batch, scheduled):
                chunk = self._fit_chunk(seq, want)
            if chunk == 0:
                continue
            batch.entries.append((seq, chunk))
            scheduled.add(id(seq))
            budget -= chunk
        # 3. admit waiting sequences by policy while budget, slots and pages last.
        if budget > 0 and self.waiting and len(self.running) < self.config.max_running_requests:
            self._admit(batch, scheduled, budget)
        return batch

    def mixed_budget(self, decodes: int) -> int:
        """Prefill tokens a step with ``decodes`` decodes may carry: the step budget's share of
        the requests waiting for a first token (queued, or admitted and still in prefill) among
        them and the decodes, within [``mixed_prefill_min_tokens``, ``mixed_prefill_tokens``];
        all the step can carry when every such request's uncached rest fits in it
        (:meth:`_prefill_left`: a burst's tail in one step, not cut into floor-sized steps that
        each carry every decode)."""
        cap = self.config.mixed_prefill_tokens
        floor = min(self.config.mixed_prefill_min_tokens, cap)
        prefilling = [s for s in self.running if s.in_prefill]
        first = len(self.waiting) + len(prefilling)
        share = self.config.chunked_prefill_tokens * first // max(1, first + decodes)
        budget = max(floor, min(cap, share))
        whole = min(cap, self.config.chunked_prefill_tokens - decodes)  # all one step can carry
        if budget < whole and self._prefill_left(prefilling, whole) <= whole:
            return whole
        return budget

    def _prefill_left(self, prefilling: list[Sequence], limit: int) -> int:
        """Tokens still to compute before every waiting and prefilling request has its first
        token: each prefill's rest, each waiting request's prompt past its cached prefix
        (``KVManager.peek``; a prefix another request computes in this step counts as uncached,
        so this errs high). Stops counting past ``limit``; past ``LPM_MAX_QUEUE`` waiting
        requests it does not match them and returns more than ``limit``."""
        if len(self.waiting) > LPM_MAX_QUEUE:
            return limit + 1
        left = sum(s.num_tokens - s.num_computed for s in prefilling)
        for seq in self.waiting:
            if left > limit:
                break
            left += seq.num_tokens - self.kv.peek(seq)[0]
        return left

    @staticmethod
    def _decode_ready(seq: Sequence) -> bool:
        return seq.status is SeqStatus.RUNNING and not seq.in_prefill and not seq.is_parked

    def _admit(self, batch: ScheduledBatch, scheduled: set[int], budget: int) -> None:
        prefilling = [s for s in self.running if s.in_prefill]
        # how far each prefill in this step's batch will have computed when the step ends
        reach = {id(s): s.num_computed + n for s, n in batch.entries if s.in_prefill}
        deferred: list[Sequence] = []
        order = self._ordered_waiting()
        pos = 0
        while pos < len(order):
            seq = order[pos]
            pos += 1
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if seq.status is not SeqStatus.WAITING:
                continue  # admitted with its gang
            if seq.grammar is not None and not seq.grammar.ready:
                continue  # its grammar is still compiling (off this thread)
            if seq.gang is not None and len(seq.gang) > 1:
                budget = self._admit_gang(seq.gang, batch, scheduled, budget, prefilling)
                if budget is None:
                    break  # out of pages for the whole gang: try again next step
                continue
            sibling = self._prefilling_sibling(seq, prefilling)
            end = 0  # tokens of the sibling's prefix to borrow in this step
            if sibling is not None:
                owner, shared = sibling
                end = min(shared, seq.num_tokens - 1) // self.kv.page_size * self.kv.page_size
                if reach.get(id(owner), 0) < end or owner.gang is not None:
                    deferred.append(seq)  # wait for the sibling's prefill to reach the tree
                    continue
            key = (seq.request_id, seq.index)
            may_wait = bool(self.running) and self._load_waits.get(key, 0) < LOAD_WAIT_STEPS
            cached, unloaded = self.kv.admit(seq, partial=not may_wait)
            if may_wait and unloaded:
                # its cached KV does not fit beside the running requests: loading it once they
                # free pages beats recomputing it now
                self.kv.release(seq, publish=False)
                self._load_waits[key] = self._load_waits.get(key, 0) + 1
                self.num_load_waits += 1
                break
            borrowed = 0
            if sibling is not None:
                borrowed = self.kv.borrow(seq, sibling[0], end)
                if borrowed == 0:  # it stands on a copied partial page: wait as before
                    self.kv.release(seq, publish=False)
                    deferred.append(seq)
                    continue
            chunk = self._fit_chunk(seq, min(budget, seq.num_tokens - seq.num_computed))
            if chunk == 0:
                self.kv.release(seq, publish=False)
                break  # out of pages: keep arrival order, try again next step
            self._load_waits.pop(key, None)
            self.waiting.remove(seq)
            if seq.cached_tokens is None:
                seq.cached_tokens = cached + borrowed
                seq.scheduled_time = now()
            self.num_borrowed_tokens += borrowed
            seq.status = SeqStatus.RUNNING
            self._admit_counter += 1
            seq.admit_order = self._admit_counter
            self.running.append(seq)
            prefilling.append(seq)
            batch.entries.append((seq, chunk))
            scheduled.add(id(seq))
            reach[id(seq)] = seq.num_computed + chunk
            budget -= chunk
            if not borrowed and self.config.schedule_policy != "fcfs":
                order[pos:] = self._borrowers_first(seq, order[pos:])

    def _admit_gang(
        self,
        gang: list[Sequence],
        batch: ScheduledBatch,
        scheduled: set[int],
        budget: int,
        prefilling: list[Sequence],
    ) -> int | None:
        """Admit every waiting member of ``gang`` (each with a first chunk of at least one token,
        so the step budget may be overrun by the gang's size) or none; the budget left, or None
        when the pages were not there (nothing admitted)."""
        waiting = [m for m in gang if m.status is SeqStatus.WAITING]
        granted: list[tuple[Sequence, int, int]] = []
        left = budget
        for m in waiting:
            cached = self.kv.admit(m).cached_tokens
            chunk = self._fit_chunk(m, min(max(left, 1), m.num_tokens - m.num_computed))
            if chunk == 0:
                for g, _, _ in granted:
                    self.kv.release(g, publish=False)
                self.kv.release(m, publish=False)
                return None
            granted.append((m, chunk, cached))
            left -= chunk
        for m, chunk, cached in granted:
            self.waiting.remove(m)
            if m.cached_tokens is None:
                m.cached_tokens = cached
                m.scheduled_time = now()
            m.status = SeqStatus.RUNNING
            self._admit_counter += 1
            m.admit_order = self._admit_counter
            self.running.append(m)
            prefilling.append(m)
            batch.entries.append((m, chunk))
            scheduled.add(id(m))
        return left

    def _ordered_waiting(self) -> list[Sequence]:
        waiting = list(self.waiting)
        policy = self.config.schedule_policy
        if not self.kv.enable_prefix_cache or policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
            return waiting
        preempted = [s for s in waiting if s.preemptions]  # resumed work goes first
        rest = [s for s in waiting if not s.preemptions]
        if policy == "lpm":
            rest.sort(key=lambda s: -self.kv.peek(s)[0])  # stable: ties keep arrival order
        else:  # dfs-weight: heaviest subtrees (most waiting requests) first, deepest hits first
            rest = self._dfs_weight_order(rest)
        return preempted + rest

    def _dfs_weight_order(self, seqs: list[Sequence]) -> list[Sequence]:
        """SGLang's dfs-weight order: each sequence sits at the deepest tree node wholly inside
        its cached prefix (``peek``); a node's weight is the number of sequences in its subtree.
        Depth first from the root, a node's subtrees heaviest first (ties: the subtree whose
        earliest sequence arrived first), then the node's own sequences in arrival order; so
        the longest hits of the heaviest subtree go first and nothing-cached sequences (at the
        root) last, after every cache hit, which their pages could otherwise evict."""
        at_node: dict[int, list[Sequence]] = {}
        weight: dict[int, int] = {}
        children: dict[int, list[object]] = {}  # in the order they were first reached
        root = None
        for seq in seqs:
            node = self.kv.peek(seq)[1]
            at_node.setdefault(id(node), []).append(seq)
            while node is not None:
                key = id(node)
                first = key not in weight
                weight[key] = weight.get(key, 0) + 1
                parent = getattr(node, "parent", None)
                if parent is None:
                    root = node
                elif first:
                    children.setdefault(id(parent), []).append(node)
                node = parent
        if root is None:
            return seqs
        order: list[Sequence] = []
        stack: list[tuple[object, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:  # its subtrees are done: now its own sequences
                order.extend(at_node.get(id(node), []))
                continue
            stack.append((node, True))
            kids = sorted(children.get(id(node), []), key=lambda n: -weight[id(n)])  # stable
            stack.extend((kid, False) for kid in reversed(kids))  # heaviest popped first
        return order

    def _prefilling_sibling(
        self, seq: Sequence, prefilling: list[Sequence]
    ) -> tuple[Sequence, int] | None:
        """In-batch prefix dedupe: the running prefill sharing the most not-yet-cached tokens
        with ``seq`` (at least ``DEDUPE_MIN_TOKENS`` and a page), and the tokens shared; None
        when ``seq`` has no such sibling. ``seq`` then borrows that prefix's pages in the step
        the sibling computes them (:meth:`KVManager.borrow`) or waits for them to reach the tree;
        it never computes them a second time."""
        if not self.kv.enable_prefix_cache or not prefilling or seq.skip_cache_read:
            return None
        cached = self.kv.peek(seq)[0]
        tokens = seq.tokens
        need = cached + max(DEDUPE_MIN_TOKENS, self.kv.page_size)  # shared tokens, at least
        if len(tokens) < need:
            return None
        best: tuple[Sequence, int] | None = None
        for other in prefilling:
            if other.salt != seq.salt or not _may_share(tokens, other.tokens, need):
                continue
            shared = common_prefix_len(tokens, other.tokens)
            if shared >= need and (best is None or shared > best[1]):
                best = (other, shared)
        return best

    def _borrowers_first(self, owner: Sequence, rest: list[Sequence]) -> list[Sequence]:
        """``rest`` of the waiting order with the sequences that share at least
        ``DEDUPE_MIN_TOKENS`` (and a page) of ``owner``'s uncomputed prefix moved to the front,
        each group in its order: once ``owner``'s prefill is in the step they cost only their
        own suffix (they borrow the prefix in the same step), so they go before other prompts'
        cold prefixes — the longest-prefix-match idea, with the prefix computed this step."""
        if owner.gang is not None or not self.kv.enable_prefix_cache:
            return rest
        need = owner.num_computed + max(DEDUPE_MIN_TOKENS, self.kv.page_size)
        tokens = owner.tokens
        if len(tokens) < need:  # nothing left to compute that others could borrow
            return rest
        first, other = [], []
        for seq in rest:
            share = (
                seq.salt == owner.salt
                and _may_share(seq.tokens, tokens, need)
                and seq.tokens[:need] == tokens[:need]
            )
            (first if share else other).append(seq)
        return first + other if first else rest

    # -- pages -------------------------------------------------------------------------------
    def _fit_chunk(self, seq: Sequence, want: int) -> int:
        """Reserve pages for up to ``want`` new tokens of a prefill; returns the chunk granted."""
        P = self.kv.page_size
        while want > 0:
            need = self.kv.pages_needed(seq, want)
            if self.kv.ensure_free(need):
                self.kv.grow(seq, want)
                return want
            # shrink to what the free pool (after eviction) can hold
            room = self.kv.allocator.num_free * P + (-seq.num_computed % P)
            want = min(want - 1, room)
        return 0

    def _reserve(
        self, seq: Sequence, num_tokens: int, batch: ScheduledBatch, scheduled: set[int]
    ) -> bool:
        """Pages for a decode of ``seq``; preempts the newest unscheduled sequence when short.
        Returns False when ``seq`` itself had to be preempted."""
        while True:
            need = self.kv.pages_needed(seq, num_tokens)
            if self.kv.ensure_free(need):
                self.kv.grow(seq, num_tokens)
                return True
            victims = [s for s in self.running if self._can_preempt(s, scheduled)]
            if not victims:
                return False  # nothing may be preempted: seq waits for a later step
            victim = max(victims, key=lambda s: s.admit_order)
            batch.preempted.extend(self.preempt(victim))
            if seq.status is not SeqStatus.RUNNING:
                return False

    def _preempt_newer_than(
        self, seq: Sequence, batch: ScheduledBatch, scheduled: set[int]
    ) -> bool:
        """Preempt the newest unscheduled sequence admitted after ``seq``; False if none."""
        own = {id(m) for m in members(seq)}
        victims = [
            s
            for s in self.running
            if s.admit_order > seq.admit_order
            and id(s) not in own
            and self._can_preempt(s, scheduled)
        ]
        if not victims:
            return False
        victim = max(victims, key=lambda s: s.admit_order)
        batch.preempted.extend(self.preempt(victim))
        return True

    @staticmethod
    def _can_preempt(seq: Sequence, scheduled: set[int]) -> bool:
        """Running, and no member of its gang is in this step's batch."""
        return seq.status is SeqStatus.RUNNING and not any(id(m) in scheduled for m in members(seq))

    def preempt(self, seq: Sequence) -> list[Sequence]:
        """Preempt ``seq`` (its whole gang); returns the sequences preempted."""
        out = [m for m in members(seq) if m.status is SeqStatus.RUNNING]
        for m in out:
            self._preempt_one(m)
        return out

    def _preempt_one(self, seq: Sequence) -> None:
        """Recompute-style preemption: publish what was computed, free the rest, requeue first."""
        self.kv.release(seq, publish=True)
        self.running.remove(seq)
        seq.preemptions += 1
        self.num_preemptions += 1
        self.add(seq, front=True)


def _may_share(a: list[int], b: list[int], n: int) -> bool:
    """Whether ``a`` and ``b`` may share their first ``n`` tokens: both are that long and agree
    at the first and the n-th token (an O(1) test that rules out most unrelated prompts before a
    prefix comparison; the scheduler makes O(waiting x prefilling) of them a step)."""
    return len(a) >= n and len(b) >= n and a[0] == b[0] and a[n - 1] == b[n - 1]


def members(seq: Sequence) -> list[Sequence]:
    """The sequences scheduled together with ``seq``: its gang, or itself alone."""
    return seq.gang if seq.gang is not None else [seq]
