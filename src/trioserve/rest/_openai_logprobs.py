"""The ``logprobs`` of OpenAI answers, from the engine's ``TokenLogprob`` values.

Completions ask with an integer ``logprobs`` (how many alternatives per token) and get
OpenAI's legacy object per choice: ``tokens``, ``token_logprobs``, ``top_logprobs`` (per
token, a ``{token: logprob}`` of the most likely tokens and the chosen one, as vLLM
answers) and ``text_offset`` (where each token's text begins in the choice's text).
Chat asks with ``logprobs: true`` and ``top_logprobs: N`` and gets ``{"content": [...],
"refusal": null}``, one ``{token, logprob, bytes, top_logprobs}`` per token. A token's
text is the model's decoding of that token alone. Streamed chunks carry the entries of
their own tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..scheduler import ParameterError, TokenLogprob


def requested_logprobs(document: Mapping[str, Any], top: int | None, *, chat: bool) -> int | None:
    """How many alternatives per token the request asks for (None: no logprobs), given
    the count the parameter table read (completions' ``logprobs``, chat's
    ``top_logprobs``)."""
    if not chat:
        if top is not None and document.get("echo"):
            raise ParameterError("logprobs", "'logprobs' with 'echo' is not supported")
        return top
    asked = document.get("logprobs")
    if asked is not None and type(asked) is not bool:
        raise ParameterError("logprobs", "'logprobs' must be a boolean")
    if top is not None and not asked:
        raise ParameterError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if asked else None


class ChoiceLogprobs:
    """The logprobs of one choice, built as its tokens come."""

    def __init__(self, decode: Callable[[Sequence[int]], str], *, chat: bool, offset: int) -> None:
        self._decode = decode
        self._chat = chat
        self._offset = offset  # completions: where the next token's text begins
        self._pieces: dict[int, str] = {}  # token id -> its text

    def document(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The ``logprobs`` object of these tokens (the whole choice, or one chunk's)."""
        if self._chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        tokens = [self._piece(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                {self._piece(t): lp for t, lp in (*e.top, (e.token_id, e.logprob))} for e in entries
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        return {
            **self._token(entry.token_id, entry.logprob),
            "top_logprobs": [self._token(t, lp) for t, lp in entry.top],
        }

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        piece = self._piece(token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    def _piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._decode([token_id])
        return piece
