"""``trioserve run`` whose core answers every inference a worker decoded at once, without
its pipeline: no model, batcher, statistics or load count, the outputs being the inputs
(``OUTPUT0`` and ``OUTPUT1`` of ``simple``, as their bytes came). What is left of the
forwarded path is the link itself: the worker's decode, message and response, and the
core's read of the frame and its ANSWER. ``workers_bench.py --link-only`` runs it as the
forwarded side, to tell the link's cost from the pipeline's; it serves nothing else
correctly (a large tensor, one in a block, is refused) and is no server to deploy.

    python tools/link_only_core.py run --workers 1 --http-port 8000
"""

from __future__ import annotations

from typing import Any

from trioserve._cli import main
from trioserve._errors import UnsupportedError
from trioserve.workers._core_infer import LinkInferences, _error
from trioserve.workers._wire import OUTCOME

_OUTPUTS = ("OUTPUT0", "OUTPUT1")  # simple's, for its inputs in order


def _answer_rows(self: LinkInferences, message: tuple[Any, ...]) -> None:
    """``LinkInferences.submit_rows``: an INFERS (alike INFERs) answered at once by one
    OUTCOME of them all, its outputs the inputs' rows of all, as they came."""
    _, calls, _, model, version, ids, _, inputs = message[:8]
    tensors: list[tuple[str, str, tuple[int, ...], bytes, dict[str, Any]]] = [
        (name, datatype, shape, joined, {})
        for name, (_, datatype, shape, joined, _) in zip(_OUTPUTS, inputs, strict=False)
    ]
    outcome: tuple[Any, ...] = (OUTCOME, None, model, version or "1", ids, {}, tensors, None)
    self._outcomes.append((calls, outcome, True))
    self._wake_answerer()


def _answer_at_once(self: LinkInferences, call: int, *message: Any) -> None:
    """``LinkInferences.submit``: an INFER (``message``: its items after its call)
    answered in the same turn: the ANSWER goes with the others of the frame (the
    answering task is woken, as a finished inference wakes it)."""
    _, model, version, request_id, _, inputs = message[:6]
    blocks = [payload for *_, payload, _ in inputs if type(payload) is not bytes]
    if blocks:  # refused, and the worker may reuse them at once
        self._read += blocks
        refusal = _error(UnsupportedError("the link-only core answers small tensors only"))
        outcome: tuple[Any, ...] = (OUTCOME, refusal, model, version, "", {}, [], None)
    else:
        tensors: list[tuple[str, str, tuple[int, ...], Any, dict[str, Any]]] = [
            (name, datatype, shape, payload, {})
            for name, (_, datatype, shape, payload, _) in zip(_OUTPUTS, inputs, strict=False)
        ]
        outcome = (OUTCOME, None, model, version or "1", request_id, {}, tensors, None)
    self._outcomes.append((call, outcome, True))
    self._wake_answerer()


if __name__ == "__main__":
    LinkInferences.submit = _answer_at_once  # type: ignore[method-assign,assignment]
    LinkInferences.submit_rows = _answer_rows  # type: ignore[method-assign]
    main()
