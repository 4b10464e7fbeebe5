"""Reasoning parsers: a reasoning model's ``<think>...</think>`` block returned as the chat
message's ``reasoning_content``, apart from its ``content``, whole and streamed, as vLLM's
``--reasoning-parser`` and SGLang's ``separate_reasoning`` do (issue 58).

Two parsers, by how the model opens its reasoning:

* ``qwen3`` (Qwen3, SmolLM3, and other models that write ``<think>`` themselves): the text
  between ``<think>`` and ``</think>`` is the reasoning; an output without ``<think>`` is all
  content (``enable_thinking: false``). Text before ``<think>`` stays content.
* ``deepseek_r1`` (DeepSeek-R1 and its distills, whose chat template ends the prompt with
  ``<think>``): the output is reasoning from its first token until ``</think>``; an output that
  never closes it is all reasoning (it was cut short while thinking).

:class:`ReasoningStream` splits a stream of text deltas the same way, holding back only a suffix
that could be the start of a marker (so a marker split across two deltas is never shown), and
:func:`split_reasoning` a whole text; for any split of a text into deltas, the stream's
reasoning and content concatenate to the whole text's.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "REASONING_PARSERS",
    "ReasoningParser",
    "ReasoningStream",
    "partial_suffix",
    "split_reasoning",
]


@dataclass(frozen=True)
class ReasoningParser:
    """How a model marks its reasoning: ``start`` and ``end`` markers, and whether its output
    is reasoning from the first token (the prompt opened it)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    opens_in_prompt: bool = False


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", opens_in_prompt=True),
}


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """``(reasoning_content, content)`` of a whole output (None where there is none)."""
    stream = ReasoningStream(parser)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    reasoning, content = r1 + r2, c1 + c2
    return (reasoning if stream.saw_reasoning else None), (content or None)


class ReasoningStream:
    """Splits one output's text deltas into reasoning and content deltas (module docstring)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.state = "reasoning" if parser.opens_in_prompt else "before"
        self.saw_reasoning = parser.opens_in_prompt
        self._held = ""  # a suffix that may be the start of the next marker

    def feed(self, delta: str) -> tuple[str, str]:
        """The ``(reasoning, content)`` text that ``delta`` completes."""
        text, self._held = self._held + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.state == "after":
                content.append(text)
                break
            marker = self.parser.start if self.state == "before" else self.parser.end
            at = text.find(marker)
            if at < 0:
                keep = partial_suffix(text, marker)
                out, self._held = text[: len(text) - keep], text[len(text) - keep :]
                (content if self.state == "before" else reasoning).append(out)
                break
            (content if self.state == "before" else reasoning).append(text[:at])
            text = text[at + len(marker) :]
            if self.state == "before":
                self.state, self.saw_reasoning = "reasoning", True
            else:
                self.state = "after"
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the output's end (a marker's prefix is plain text)."""
        held, self._held = self._held, ""
        return (held, "") if self.state == "reasoning" else ("", held)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
