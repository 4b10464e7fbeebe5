"""Deterministic synthetic workloads with shared prefixes (pure Python + numpy, no torch).

Every generator returns a list of request dicts (one JSONL line each, see :func:`write_jsonl`):

* ``id`` (int, position in the trace);
* ``input_ids`` (list of token ids drawn uniformly from ``vocab_range``) **or** ``text`` (words
  from a fixed, generated word list) when ``text=True``;
* ``output_len`` (tokens the request generates);
* ``output_ids`` / ``output_text`` (multi-turn only: the simulated answer that the next round's
  prompt contains, so a simulator can append exactly the same tokens);
* ``salt`` (only when ``num_salts > 0``): ``"tenant-<k>"``;
* ``arrival`` (seconds): a Poisson process with rate ``request_rate`` requests/s, else 0.

The same arguments and ``seed`` always give the same trace (numpy PCG64 streams).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "WORDS",
    "few_shot",
    "generated_shared_prefix",
    "multi_turn",
    "read_jsonl",
    "write_jsonl",
]

DEFAULT_VOCAB_RANGE = (1000, 40000)


def _make_words() -> list[str]:
    onsets = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
    vowels = ["a", "e", "i", "o", "u"]
    codas = ["", "n", "r", "s"]
    syllables = [o + v + c for o, v, c in itertools.product(onsets, vowels, codas)]
    words = syllables[:64] + [a + b for a, b in itertools.product(syllables[:40], syllables[:48])]
    return words


#: Deterministic word list used for ``text=True`` traces (1984 distinct lowercase words).
WORDS: list[str] = _make_words()


class _Gen:
    """Shared helpers: token/word sampling, salts and arrivals from one seeded generator."""

    def __init__(
        self,
        seed: int,
        text: bool,
        vocab_range: tuple[int, int],
        request_rate: float | None,
        num_salts: int,
    ) -> None:
        lo, hi = vocab_range
        if not lo < hi:
            raise ValueError(f"vocab_range must be (lo, hi) with lo < hi, got {vocab_range}")
        if num_salts < 0:
            raise ValueError(f"num_salts must be >= 0, got {num_salts}")
        if request_rate is not None and request_rate <= 0:
            raise ValueError(f"request_rate must be > 0 requests/s, got {request_rate}")
        self.rng = np.random.default_rng(seed)
        self.text = text
        self.lo, self.hi = lo, hi
        self.request_rate = request_rate
        self.num_salts = num_salts

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(self.lo, self.hi, size=n).tolist()

    def words(self, n: int) -> list[str]:
        return [WORDS[i] for i in self.rng.integers(0, len(WORDS), size=n).tolist()]

    def segment(self, n: int) -> list[Any]:
        """``n`` tokens or ``n`` words depending on the mode."""
        return self.words(n) if self.text else self.tokens(n)

    def finish(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        t = 0.0
        for i, r in enumerate(requests):
            r["id"] = i
            if self.request_rate is not None:
                t += float(self.rng.exponential(1.0 / self.request_rate))
            r["arrival"] = round(t, 6)
        return requests

    def prompt_field(self, parts: list[Any]) -> dict[str, Any]:
        if self.text:
            return {"text": " ".join(parts)}
        return {"input_ids": parts}


def generated_shared_prefix(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    *,
    seed: int = 0,
    text: bool = False,
    vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE,
    request_rate: float | None = None,
    num_salts: int = 0,
) -> list[dict[str, Any]]:
    """SGLang's generated-shared-prefix shape: ``num_groups`` random system prompts, each followed
    by ``prompts_per_group`` random questions (prompt = system + question), shuffled by seed.
    With ``num_salts > 0`` group ``g`` gets salt ``tenant-<g % num_salts>``. Lengths are tokens,
    or words with ``text=True``."""
    g = _Gen(seed, text, vocab_range, request_rate, num_salts)
    reqs: list[dict[str, Any]] = []
    for grp in range(num_groups):
        system = g.segment(system_prompt_len)
        for _ in range(prompts_per_group):
            r = g.prompt_field(system + g.segment(question_len))
            r["output_len"] = output_len
            if num_salts:
                r["salt"] = f"tenant-{grp % num_salts}"
            reqs.append(r)
    order = g.rng.permutation(len(reqs)).tolist()
    return g.finish([reqs[i] for i in order])


def multi_turn(
    num_clients: int = 16,
    num_rounds: int = 4,
    turn_len: int = 128,
    output_len: int = 128,
    shared_system_prompt_len: int = 0,
    *,
    seed: int = 0,
    text: bool = False,
    vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE,
    request_rate: float | None = None,
    num_salts: int = 0,
) -> list[dict[str, Any]]:
    """``num_clients`` conversations of ``num_rounds`` rounds. Round ``r``'s prompt is the
    (optional, shared by all clients) system prompt, then every earlier user turn and answer,
    then a new user turn of ``turn_len``. Each request records its simulated answer
    (``output_ids``, or ``output_text`` with ``text=True``) of ``output_len``, which the next
    round's prompt contains. Requests come round by round, clients shuffled within a round.
    With ``num_salts > 0`` client ``c`` gets salt ``tenant-<c % num_salts>``."""
    g = _Gen(seed, text, vocab_range, request_rate, num_salts)
    system = g.segment(shared_system_prompt_len)
    history: list[list[Any]] = [list(system) for _ in range(num_clients)]
    reqs: list[dict[str, Any]] = []
    for _ in range(num_rounds):
        round_reqs = []
        for c in range(num_clients):
            history[c] += g.segment(turn_len)
            r = g.prompt_field(list(history[c]))
            answer = g.segment(output_len)
            r["output_len"] = output_len
            if text:
                r["output_text"] = " ".join(answer)
            else:
                r["output_ids"] = answer
            if num_salts:
                r["salt"] = f"tenant-{c % num_salts}"
            history[c] += answer
            round_reqs.append(r)
        order = g.rng.permutation(num_clients).tolist()
        reqs += [round_reqs[i] for i in order]
    return g.finish(reqs)


def few_shot(
    num_requests: int = 256,
    num_examples: int = 8,
    example_len: int = 32,
    question_len: int = 32,
    output_len: int = 32,
    *,
    seed: int = 0,
    text: bool = False,
    vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE,
    request_rate: float | None = None,
    num_salts: int = 0,
) -> list[dict[str, Any]]:
    """Few-shot translation: ``num_examples`` fixed example pairs (source and target of
    ``example_len`` each, shared by every request) followed by a new source sentence of
    ``question_len``. With ``text=True`` the prompt reads ``Translate English to French.``,
    ``English: ...`` / ``French: ...`` lines, ending in ``French:``. With ``num_salts > 0`` each
    request gets a random salt ``tenant-<k>``."""
    g = _Gen(seed, text, vocab_range, request_rate, num_salts)
    if text:
        header: list[Any] = ["Translate", "English", "to", "French."]
        for _ in range(num_examples):
            header += ["\nEnglish:"] + g.words(example_len) + ["\nFrench:"] + g.words(example_len)
    else:
        header = []
        for _ in range(num_examples):
            header += g.tokens(2 * example_len)
    reqs: list[dict[str, Any]] = []
    for _ in range(num_requests):
        if text:
            parts = header + ["\nEnglish:"] + g.words(question_len) + ["\nFrench:"]
        else:
            parts = header + g.tokens(question_len)
        r = g.prompt_field(parts)
        r["output_len"] = output_len
        if num_salts:
            r["salt"] = f"tenant-{int(g.rng.integers(0, num_salts))}"
        reqs.append(r)
    return g.finish(reqs)


def write_jsonl(requests: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Write one JSON object per line; returns the number of requests written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r, separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL trace (blank lines ignored). Raises ``ValueError`` naming a bad line."""
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line")
            out.append(obj)
    return out
