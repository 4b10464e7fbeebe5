"""Workloads of the serving benchmark as :class:`Session` lists with start offsets.

A :class:`Session` is requests sent one after another (``multi_turn`` sessions carry their
history, rendered by :func:`render_prompt`); arrivals are all-at-once (``inf``) or a seeded
Poisson process. Generated workloads come from :mod:`radixkv.sim.workloads`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.serve_config import BenchConfig

__all__ = ["Session", "Turn", "build_sessions", "render_prompt"]


@dataclass
class Turn:
    """One request of a session: a full prompt, or (multi-turn) the new user turn only."""

    prompt: str | list[int]
    output_len: int
    salt: str | None = None


@dataclass
class Session:
    """Requests sent one after another; ``multi_turn`` sessions carry their history along."""

    turns: list[Turn]
    start: float = 0.0
    multi_turn: bool = False
    system: str = ""


def _vocab(cfg: BenchConfig) -> tuple[int, int]:
    return (cfg.vocab_min, cfg.vocab_max)


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seeded Poisson arrival offsets (seconds); all 0 for ``rate = inf``."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed + 7919)
    gaps = rng.exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


def _from_request_dicts(reqs: list[dict[str, Any]]) -> list[Session]:
    sessions = []
    for r in reqs:
        prompt: str | list[int]
        if "input_ids" in r:
            prompt = [int(t) for t in r["input_ids"]]
        elif "text" in r:
            prompt = str(r["text"])
        else:
            raise ValueError(f"request {r.get('id')!r} has neither 'input_ids' nor 'text'")
        turn = Turn(prompt, int(r.get("output_len", 16)), r.get("salt"))
        sessions.append(Session([turn], start=float(r.get("arrival", 0.0) or 0.0)))
    return sessions


def _multi_turn_sessions(cfg: BenchConfig) -> list[Session]:
    from radixkv.sim.workloads import WORDS

    rng = np.random.default_rng(cfg.seed)

    def words(n: int) -> str:
        return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n).tolist())

    system = words(cfg.mt_system_prompt_len) if cfg.mt_system_prompt_len else ""
    return [
        Session(
            [Turn(words(cfg.mt_turn_len), cfg.mt_output_len) for _ in range(cfg.mt_rounds)],
            multi_turn=True,
            system=system,
        )
        for _ in range(cfg.mt_clients)
    ]


def _sharegpt_sessions(cfg: BenchConfig) -> list[Session]:
    assert cfg.dataset_path is not None
    data = json.loads(Path(cfg.dataset_path).read_text(encoding="utf-8"))
    pairs: list[tuple[str, int]] = []
    for entry in data:
        conv = entry.get("conversations") or entry.get("conversation") or []
        if len(conv) < 2:
            continue
        human, gpt = conv[0], conv[1]
        if human.get("from") != "human" or not human.get("value"):
            continue
        if cfg.sharegpt_output_len is not None:
            out = cfg.sharegpt_output_len
        else:  # no tokenizer here: about 1.3 tokens per English word
            out = max(1, round(len(str(gpt.get("value", "")).split()) * 1.3))
            out = min(out, cfg.sharegpt_max_output_len)
        pairs.append((str(human["value"]), out))
    if not pairs:
        raise ValueError(f"{cfg.dataset_path}: no usable human/gpt conversation pairs")
    rng = np.random.default_rng(cfg.seed)
    idx = rng.permutation(len(pairs))[: cfg.num_prompts].tolist()
    return [Session([Turn(pairs[i][0], pairs[i][1])]) for i in idx]


def build_sessions(cfg: BenchConfig) -> list[Session]:
    """Turn the config's workload into sessions with start offsets (seconds)."""
    from radixkv.sim import workloads as wl

    cfg.validate()
    common: dict[str, Any] = dict(seed=cfg.seed, text=cfg.text_prompts, vocab_range=_vocab(cfg))
    if cfg.workload == "generated-shared-prefix":
        sessions = _from_request_dicts(
            wl.generated_shared_prefix(
                cfg.gsp_num_groups,
                cfg.gsp_prompts_per_group,
                cfg.gsp_system_prompt_len,
                cfg.gsp_question_len,
                cfg.gsp_output_len,
                **common,
            )
        )
    elif cfg.workload == "few-shot":
        sessions = _from_request_dicts(
            wl.few_shot(
                cfg.fs_requests,
                cfg.fs_shots,
                cfg.fs_example_len,
                cfg.fs_question_len,
                cfg.fs_output_len,
                **common,
            )
        )
    elif cfg.workload == "multi-turn":
        sessions = _multi_turn_sessions(cfg)
    elif cfg.workload == "sharegpt":
        sessions = _sharegpt_sessions(cfg)
    else:
        assert cfg.trace_path is not None
        sessions = _from_request_dicts(wl.read_jsonl(cfg.trace_path))
        if cfg.endpoint == "chat" and any(isinstance(s.turns[0].prompt, list) for s in sessions):
            raise ValueError("this trace has token-id prompts: use --endpoint completions")
    if not (cfg.workload == "trace" and cfg.use_trace_arrivals):
        for s, t in zip(sessions, _arrivals(len(sessions), cfg.request_rate, cfg.seed)):
            s.start = t
    return sessions


def render_prompt(
    cfg: BenchConfig, session: Session, history: list[tuple[str, str]], turn: Turn
) -> Any:
    """The prompt for ``turn`` (multi-turn: system + every earlier turn and real answer)."""
    if not session.multi_turn:
        if cfg.endpoint == "chat":
            return [{"role": "user", "content": turn.prompt}]
        return turn.prompt
    if cfg.endpoint == "chat":
        msgs: list[dict[str, str]] = []
        if session.system:
            msgs.append({"role": "system", "content": session.system})
        for user, answer in history:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        msgs.append({"role": "user", "content": str(turn.prompt)})
        return msgs
    parts = [session.system] if session.system else []
    for user, answer in history:
        parts += [user, answer.strip()]
    parts.append(str(turn.prompt))
    return " ".join(p for p in parts if p)
