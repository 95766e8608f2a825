"""One sample's output text: incremental detokenizing, stop strings, held-back text.

Tokens become text incrementally: the text of the output from ``prefix`` on, minus the
text of ``prefix:read`` already accounted for, so that tokenizers whose pieces depend
on their neighbours decode correctly. An incomplete UTF-8 character (U+FFFD at the end)
waits for its next tokens, but no longer than a character can be.

With stop strings, the last ``len(longest stop) - 1`` characters are held back until
they cannot begin a stop string, so a stream never shows text that a stop then cuts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_MAX_CHARACTER_TOKENS = 4  # UTF-8 bytes in a character


class SampleOutput:
    __slots__ = ("_decode", "_emitted", "_hold", "_prefix", "_read", "_start", "_stops", "_text")

    def __init__(
        self, decode: Callable[[Sequence[int]], str], prompt_len: int, stops: tuple[str, ...]
    ) -> None:
        self._decode = decode
        self._start = prompt_len  # where the output begins in the token ids
        self._stops = stops
        self._hold = max(len(s) for s in stops) - 1 if stops else 0
        self._prefix = 0  # output offsets, see the module docstring
        self._read = 0
        self._text = ""  # kept only while stop strings need it
        self._emitted = 0

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Take the newest token of ``token_ids``: (text to send now, hit a stop string)."""
        delta = self._new_text(token_ids)
        if not self._stops:
            return delta, False
        self._text += delta
        window = max(0, self._emitted - self._hold)  # a stop may begin in held-back text
        cut = min(
            (i for i in (self._text.find(s, window) for s in self._stops) if i >= 0), default=-1
        )
        if cut >= 0:
            self._text = self._text[:cut]
            return self._take(len(self._text)), True
        return self._take(len(self._text) - self._hold), False

    def flush(self) -> str:
        """The sample ended: everything still held back."""
        return self._take(len(self._text)) if self._stops else ""

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        text = self._text[self._emitted : end]
        self._emitted = end
        return text

    def _new_text(self, ids: list[int]) -> str:
        start = self._start
        before = self._decode(ids[start + self._prefix : start + self._read])
        after = self._decode(ids[start + self._prefix :])
        pending = len(ids) - start - self._read
        if len(after) <= len(before) or (
            after.endswith("\ufffd") and pending < _MAX_CHARACTER_TOKENS
        ):
            return ""
        self._prefix = self._read
        self._read = len(ids) - start
        return after[len(before) :]
