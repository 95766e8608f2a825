"""The REST front end as one hand-written ASGI app.

It reads the body (bounded, decompressed), routes, calls an endpoint and writes its
``Response``; every ``InferenceServerError`` becomes ``{"error": ...}`` with the status
from ``_errors.HTTP_STATUS``, every ``HttpError`` (405, 413) with its own status and
headers. It runs unchanged on our HTTP/1.1 core and on Hypercorn.
"""

from __future__ import annotations

import gzip
import logging
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import trio

from .._errors import InferenceServerError, InvalidArgumentError
from ._asgi import CANCEL_WITH, CancelWith, Receive, Scope, Send, answer_lifespan
from ._disconnects import ReceiveWatch
from ._errors import HttpError, body_too_large, error_body, error_status
from ._router import Router

logger = logging.getLogger("trioserve.rest")

JSON = b"application/json"


@dataclass(slots=True)
class Request:
    method: str
    path: str
    params: dict[str, str]
    headers: dict[bytes, bytes]
    body: bytes
    receive: Receive
    send: Send  # for endpoints that stream their response; they then return None
    cancel_with: CancelWith  # what to withdraw if the client leaves (``_asgi.CancelWith``)


class Response(NamedTuple):
    """An endpoint's answer. Immutable, since endpoints share constant ones (``_TRUE``...);
    a named tuple, as one is built per request and a frozen dataclass costs twice as much."""

    status: int = 200
    body: bytes = b""
    content_type: bytes | None = JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()
    compressible: bool = False  # honour Accept-Encoding (inference responses)


Endpoint = Callable[[Request], Awaitable[Response | None]]


class RestApp:
    """The ASGI application; endpoints register on ``router``."""

    def __init__(
        self,
        router: Router[Endpoint],
        max_body_bytes: int,
        background: Sequence[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self.router = router
        self.max_body_bytes = max_body_bytes
        # Disconnects under a server that offers no ``trioserve.cancel_with``.
        self.disconnects = ReceiveWatch()
        # Tasks the endpoints rely on while serving.
        self.background = [self.disconnects.run, *background]

    async def serve_with(
        self,
        serve_http: Callable[..., Awaitable[None]],
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve through ``serve_http`` (an HTTP server bound to this app) with the app's
        background tasks running alongside; they stop when the HTTP server returns."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.run_background)
            await serve_http(task_status=task_status)
            nursery.cancel_scope.cancel()

    async def run_background(self) -> None:
        """Run the app's background tasks until cancelled: for an app served by no
        listener of ours (in-process clients such as ``httpx.ASGITransport``)."""
        async with trio.open_nursery() as nursery:
            for task in self.background:
                nursery.start_soon(task)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        try:
            endpoint, params = self.router.resolve(scope["method"], scope["path"])
            body = await self._read_body(receive, headers)
            if body is None:
                return  # the client went away
            request = Request(
                scope["method"], scope["path"], params, headers, body, receive, send,
                _cancel_with(scope) or self.disconnects.cancel_with(receive),
            )  # fmt: skip
            response = await endpoint(request)
        except InferenceServerError as exc:
            response = Response(error_status(exc), error_body(exc.message))
        except HttpError as exc:
            response = Response(exc.status, error_body(exc.message), headers=exc.headers)
        if response is None:
            return  # answered by the endpoint itself, or the client went away
        await _send(send, response, headers)

    async def _read_body(self, receive: Receive, headers: dict[bytes, bytes]) -> bytes | None:
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                raise body_too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        encoding = headers.get(b"content-encoding")
        if encoding is None or encoding == b"identity":
            return body
        # In a worker thread: a small body may inflate to the limit (a "bomb"), and
        # inflating hundreds of MiB takes the better part of a second.
        return await trio.to_thread.run_sync(_decompress, body, encoding, self.max_body_bytes)


def _cancel_with(scope: Scope) -> CancelWith | None:
    extensions = scope.get("extensions")
    offered = extensions.get(CANCEL_WITH) if extensions else None
    return None if offered is None else offered["cancel_with"]


def _decompress(body: bytes, encoding: bytes, limit: int) -> bytes:
    if encoding == b"gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == b"deflate":
        wbits = zlib.MAX_WBITS
    else:
        raise InvalidArgumentError(f"unsupported Content-Encoding '{encoding.decode('latin-1')}'")
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidArgumentError(f"malformed {encoding.decode()} body: {exc}") from None
    if len(data) > limit:
        raise body_too_large(limit)
    if not inflater.eof:
        raise InvalidArgumentError(f"truncated {encoding.decode()} body")
    return data


def _compression(headers: dict[bytes, bytes]) -> bytes | None:
    accepted = headers.get(b"accept-encoding")
    if not accepted:
        return None
    names = {part.split(b";")[0].strip() for part in accepted.split(b",")}
    for name in (b"gzip", b"deflate"):
        if name in names:
            return name
    return None


async def _send(send: Send, response: Response, request_headers: dict[bytes, bytes]) -> None:
    headers = list(response.headers)
    body = response.body
    if response.content_type is not None:
        headers.append((b"content-type", response.content_type))
    encoding = _compression(request_headers) if response.compressible else None
    if encoding is not None:
        body = gzip.compress(body, 1) if encoding == b"gzip" else zlib.compress(body, 1)
        headers.append((b"content-encoding", encoding))
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
