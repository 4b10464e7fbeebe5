"""Incremental detokenization with stop strings, linear in the output.

Each :meth:`IncrementalDetokenizer.update` decodes a short window of the newest tokens, not the
whole output (which made a long answer quadratic): the text the tokens from ``prefix_offset`` on
decode to, minus the text of those up to ``read_offset``, is what the new tokens add (the
window starts a token or two back, so a tokenizer that drops the leading space of a window's
first token drops it in both decodes). While the window ends in an unfinished UTF-8 character
(decoded as U+FFFD) only the characters before it are added and the window stays open until the
character completes; the final update takes the window as it is. (A window's text is exact for
byte-level BPE tokenizers such as SmolLM2's and GPT-2's.)

Invariant: the confirmed text (:attr:`IncrementalDetokenizer.text`, before a stop cut) equals
the decode of every token fed so far once no character is unfinished, and a delta is never
retracted and never holds part of a stop string.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Holds back a trailing partial UTF-8 character and, when stop strings are set, the longest
    tail that could still start a stop string, so a delta is never retracted and never holds
    part of a stop string. Work per update is bounded by the window and the longest stop
    string, not by the output length.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str] | None,
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        #: stop strings are not honoured until more than this many tokens are out (vLLM's)
        self.min_tokens = min_tokens
        self._stops_from = 0  # no stop string may end at or before this character
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop  # the text ends after the stop string, not before
        self.skip_special_tokens = skip_special_tokens
        #: the stop string that ended the text (vLLM's ``stop_reason``), once one did
        self.stop_reason: str | None = None
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._chunks: list[str] = []  # the confirmed text, in pieces (joined on demand)
        self._length = 0  # characters in _chunks
        self._tail = ""  # the last characters of the confirmed text (stop strings span them)
        self._prefix_offset = 0  # tokens before this are decoded for good
        self._read_offset = 0  # tokens before this are in the confirmed text
        self._provisional = 0  # characters taken from past _read_offset (before a split char)
        self.emitted = 0  # characters of the text already returned as deltas
        self.stopped = False

    @classmethod
    def for_params(cls, tokenizer: Any, params: Any, stops: bool = True) -> IncrementalDetokenizer:
        """The detokenizer of a sequence sampled with ``params`` (``stops``: apply its stop
        strings; beam search does not)."""
        return cls(
            tokenizer,
            params.stop_list if stops else None,
            include_stop=bool(getattr(params, "include_stop_str_in_output", False)),
            skip_special_tokens=bool(getattr(params, "skip_special_tokens", True)),
            min_tokens=int(getattr(params, "min_tokens", 0) or 0),
        )

    @property
    def text(self) -> str:
        """The text so far (cut right before a stop string once one is found)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _decode(self, ids: list[int]) -> str:
        return str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=self.skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )

    def _append(self, new: str) -> None:
        if not new:
            return
        self._chunks.append(new)
        self._length += len(new)
        keep = 2 * self._hold + len(new)  # every character not yet emitted, and then some
        self._tail = (self._tail + new)[-keep:] if keep else ""

    def update(self, output_ids: list[int], final: bool) -> tuple[str, bool]:
        """Take ``output_ids`` (the previous ones plus new tokens); returns (new text delta,
        whether a stop string was hit)."""
        if self.tokenizer is None:  # token-id-only models: no text
            return "", False
        if self.stopped:
            return "", True
        before = self._decode(output_ids[self._prefix_offset : self._read_offset])
        after = self._decode(output_ids[self._prefix_offset :])
        new = after[len(before) :] if len(after) > len(before) else ""
        length_before = self._length
        if not final and new.endswith("\ufffd"):
            # an unfinished character: take what precedes it, keep the window open
            ready = new.rstrip("\ufffd")
            if len(ready) > self._provisional:
                self._append(ready[self._provisional :])
                self._provisional = len(ready)
        else:
            self._append(new[self._provisional :])
            self._provisional = 0
            self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
        if self.stop and self._length > length_before and len(output_ids) <= self.min_tokens:
            self._stops_from = self._length  # text of the first min_tokens tokens: no stop
        elif self.stop and self._length > length_before:
            tail_start = self._length - len(self._tail)
            search_from = max(0, self.emitted - self._hold) - tail_start
            # a stop string must end past the text of the first min_tokens tokens
            floor = self._stops_from - tail_start + 1
            found = [
                (c, s)
                for s in self.stop
                if (c := self._tail.find(s, max(search_from, floor - len(s), 0))) >= 0
            ]
            cut, matched = min(found, default=(-1, ""))
            if cut >= 0:
                self.stopped, self.stop_reason = True, matched
                if self.include_stop:
                    cut += len(matched)
                self._chunks = [self.text[: tail_start + cut]]
                self._length = tail_start + cut
                self._tail = self._tail[:cut]
        # unless done, hold back the tail a stop string could start in
        end = self._length if self.stopped or final else self._length - self._hold
        if end <= self.emitted:
            return "", self.stopped
        tail_start = self._length - len(self._tail)
        if self.emitted >= tail_start:
            delta = self._tail[self.emitted - tail_start : end - tail_start]
        else:  # pragma: no cover - the tail always reaches back to what is not emitted
            delta = self.text[self.emitted : end]
        self.emitted = end
        return delta, self.stopped
