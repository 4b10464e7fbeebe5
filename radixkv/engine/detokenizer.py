"""Incremental detokenization with stop strings."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Holds back a trailing partial UTF-8 character (decoded as U+FFFD) and, when stop strings are
    set, the longest tail before it that could still start a stop string, so a delta is never
    retracted and never holds part of a stop string.
    """

    def __init__(self, tokenizer: Any, stop: list[str] | None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # the full text so far (stop string cut off once found)
        self.emitted = 0  # characters of ``text`` already returned as deltas

    def update(self, output_ids: list[int], final: bool) -> tuple[str, bool]:
        """Decode ``output_ids``; returns (new text delta, whether a stop string was hit)."""
        if self.tokenizer is None:  # token-id-only models: no text
            return "", False
        text = self.tokenizer.decode(
            output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        stopped = False
        if self.stop:
            search_from = max(0, self.emitted - self._hold)
            cut = min((i for s in self.stop if (i := text.find(s, search_from)) >= 0), default=-1)
            if cut >= 0:
                text, stopped = text[:cut], True
        self.text = text
        # unless done, hold back an unfinished character (U+FFFD) and, before it, the tail a
        # stop string could start in (the unfinished character may complete one)
        end = len(text) if stopped or final else len(text.rstrip("\ufffd")) - self._hold
        if end <= self.emitted:
            return "", stopped
        delta = text[self.emitted : end]
        self.emitted = end
        return delta, stopped
