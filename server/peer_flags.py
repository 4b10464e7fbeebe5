"""The machinery of another engine's launch flags that ``radixkv serve`` takes so that a launch
command runs unchanged (issue 58): a table of :class:`PeerFlag` per engine (:mod:`.vllm_flags`,
:mod:`.sglang_flags`), each flag with one of three dispositions said at start:

* **done**: it does here what it does there; an INFO line names it;
* **no-op**: what it asks for is what radixkv always does, or means nothing on this engine; an
  INFO line says why;
* **refused**: it asks for what radixkv cannot do: ``radixkv serve`` exits 2 naming the flag and
  the reason, before loading anything.

Each table's flags store their value under ``<prefix>_<first spelling>`` (None when absent);
:func:`apply_peer_flags` judges the given ones.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "PeerFlag",
    "add_peer_flags",
    "apply_peer_flags",
    "env",
    "noop",
    "one_only",
    "only",
    "refuse",
    "set_arg",
]


class PeerFlag(NamedTuple):
    """One flag of another engine: its spellings, whether it takes a value, and
    ``judge(value, args)``: the log line (done or no-op), or raises ``ValueError`` with the
    reason it is refused."""

    flags: tuple[str, ...]
    takes_value: bool
    judge: Callable[[Any, argparse.Namespace], str]


def noop(why: str) -> Callable[[Any, argparse.Namespace], str]:
    """No-op: the line says why."""
    return lambda value, args: f"no-op here: {why}"


def refuse(why: str) -> Callable[[Any, argparse.Namespace], str]:
    """Refused, saying why."""

    def judge(value: Any, args: argparse.Namespace) -> str:
        raise ValueError(why)

    return judge


def one_only(what: str, instead: str) -> Callable[[Any, argparse.Namespace], str]:
    """Accepted as 1 (the one device or process radixkv runs); more is refused."""

    def judge(value: Any, args: argparse.Namespace) -> str:
        if int(value) == 1:
            return f"no-op here: radixkv runs one {what}"
        raise ValueError(f"radixkv runs one {what}, not {value}: {instead}")

    return judge


def only(allowed: tuple[str, ...], why: str) -> Callable[[Any, argparse.Namespace], str]:
    """Accepted for the values in ``allowed`` (what radixkv does anyway), refused otherwise."""

    def judge(value: Any, args: argparse.Namespace) -> str:
        if str(value).lower() in allowed:
            return f"no-op here: {why}"
        raise ValueError(f"{value!r} is not supported ({', '.join(allowed)} only): {why}")

    return judge


def set_arg(name: str, value: Any, line: str) -> Callable[[Any, argparse.Namespace], str]:
    """Done: ``args.<name>`` becomes ``value`` (the flag's own value when None)."""

    def judge(given: Any, args: argparse.Namespace) -> str:
        setattr(args, name, given if value is None else value)
        return line

    return judge


def env(name: str, line: str) -> Callable[[Any, argparse.Namespace], str]:
    """Done: the environment variable ``name`` becomes the flag's value."""

    def judge(value: Any, args: argparse.Namespace) -> str:
        os.environ[name] = str(value)
        return line

    return judge


def dest(prefix: str, flag: PeerFlag) -> str:
    """Where ``flag``'s value is stored in the parsed arguments."""
    return f"{prefix}_" + flag.flags[0].lstrip("-").replace("-", "_")


def add_peer_flags(
    parser: argparse.ArgumentParser, flags: list[PeerFlag], prefix: str, title: str
) -> None:
    """Register every flag of ``flags`` (each stores its value, None when absent)."""
    group = parser.add_argument_group(title)
    for flag in flags:
        if flag.takes_value:
            group.add_argument(*flag.flags, dest=dest(prefix, flag), default=None, metavar="VALUE")
        else:
            group.add_argument(
                *flag.flags, dest=dest(prefix, flag), action="store_const", const=True
            )


def apply_peer_flags(args: argparse.Namespace, flags: list[PeerFlag], prefix: str) -> list[str]:
    """Judge the flags of ``flags`` given in ``args``: set what they map to (``args``
    attributes, environment variables) and return one line per flag saying what it does here.
    Raises ``ValueError`` naming the first refused flag and why."""
    lines = []
    for flag in flags:
        value = getattr(args, dest(prefix, flag), None)
        if value is None:
            continue
        shown = flag.flags[0] if value is True else f"{flag.flags[0]} {value}"
        try:
            what = flag.judge(value, args)
        except ValueError as exc:
            raise ValueError(f"{shown}: {exc}") from None
        lines.append(f"{shown}: {what}")
    return lines
