"""What the generate and OpenAI endpoints answer with: one JSON document, or server-sent
events; each with the load report the request asked for (on the first response), and
the cancel scope that ends a request's work when its client leaves."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from .._served import ServedModel
from ..metrics import LoadReporter
from ._app import Request, Response
from ._asgi import CancelWith
from ._json_body import COMPACT
from ._load_report import load_report_header

_EVENT_STREAM = b"text/event-stream; charset=utf-8"
_SSE_HEADERS = [(b"content-type", _EVENT_STREAM), (b"cache-control", b"no-cache")]

T = TypeVar("T")


def json_answer(
    load: LoadReporter, served: ServedModel, request: Request, document: Any
) -> Response:
    report = load_report_header(load, served, request.headers)
    return Response(
        200,
        COMPACT.encode(document).encode(),
        headers=() if report is None else (report,),
        compressible=True,
    )


def stream_start(load: LoadReporter, served: ServedModel, request: Request) -> dict[str, Any]:
    """The ``http.response.start`` message of a stream of events."""
    report = load_report_header(load, served, request.headers)
    headers = _SSE_HEADERS if report is None else [*_SSE_HEADERS, report]
    return {"type": "http.response.start", "status": 200, "headers": headers}


def stream_end() -> dict[str, Any]:
    """The message that ends a stream of events."""
    return {"type": "http.response.body", "body": b"", "more_body": False}


async def send_event(send: Callable[[Any], Awaitable[None]], document: Any) -> None:
    # Compact JSON escapes every newline, so one line is one event's data.
    frame = b"data: " + COMPACT.encode(document).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": frame, "more_body": True})


async def unless_client_leaves(
    cancel_with: CancelWith, work: Callable[[], Awaitable[T]]
) -> tuple[bool, T | None]:
    """Run ``work``, cancelled if the client leaves first (``cancel_with``, the
    request's): (finished, its result)."""
    with trio.CancelScope() as scope:
        cancel_with(scope.cancel)
        try:
            return True, await work()
        finally:
            cancel_with(None)
    return False, None
