"""The REST front end as one hand-written ASGI app.

It reads the body (bounded, decompressed; whole into one buffer where the server offers
``RECEIVE_WHOLE``), routes, calls an endpoint and writes its
``Response``; every ``InferenceServerError`` becomes ``{"error": ...}`` with the status
from ``_errors.HTTP_STATUS``, every ``HttpError`` (405, 413) with its own status and
headers. A response's binary ``parts`` go to a server that offers ``BODY_PARTS`` as they
are (tensors' memory), joined otherwise. A compressible response is compressed as the
client accepts, unless a front-end worker in front does that (``COMPRESSED_IN_FRONT``).
It runs unchanged on our HTTP/1.1 core and on Hypercorn.
"""

from __future__ import annotations

import gzip
import logging
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import trio

from .._errors import InferenceServerError, InvalidArgumentError
from .._limits import OFF_LOOP_BYTES
from ._asgi import (
    BODY_PARTS,
    CANCEL_WITH,
    COMPRESSED_IN_FRONT,
    COMPRESSIBLE,
    RECEIVE_WHOLE,
    CancelWith,
    Message,
    Receive,
    Scope,
    Send,
    answer_lifespan,
)
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
    # A bytearray or a memoryview: received whole in one buffer (RECEIVE_WHOLE; a
    # ``ReceivesInto`` endpoint's), or read in place where a front-end worker wrote it.
    body: bytes | bytearray | memoryview
    receive: Receive
    send: Send  # for endpoints that stream their response; they then return None
    cancel_with: CancelWith  # what to withdraw if the client leaves (``_asgi.CancelWith``)
    pieces: BodyPieces | None = None  # the body, for a ``ReadsBody`` endpoint (then b"")


class Response(NamedTuple):
    """An endpoint's answer. Immutable, since endpoints share constant ones (``_TRUE``...);
    a named tuple, as one is built per request and a frozen dataclass costs twice as much."""

    status: int = 200
    body: bytes = b""
    content_type: bytes | None = JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()
    compressible: bool = False  # honour Accept-Encoding (inference responses)
    # Byte buffers (bytes, 1-D byte memoryviews of tensors) that follow ``body``, written
    # without being joined to it where the server offers BODY_PARTS.
    parts: tuple[bytes | memoryview, ...] = ()

    def joined(self) -> Response:
        """This response with its parts joined into its body: a copy the caller owns."""
        if not self.parts:
            return self
        return self._replace(body=b"".join((self.body, *self.parts)), parts=())


Endpoint = Callable[[Request], Awaitable[Response | None]]


class ReadsBody:
    """An endpoint that reads its request's body itself, a piece at a time, from
    ``Request.pieces`` (a repository upload, too large to hold whole)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint

    async def __call__(self, request: Request) -> Response | None:
        return await self._endpoint(request)


class ReceivesInto:
    """An endpoint whose body, where the server receives bodies whole
    (``RECEIVE_WHOLE``), goes into the buffer ``into(headers, length)`` gives: a
    writable byte buffer of exactly ``length`` bytes, or None for a new bytearray (a
    front-end worker receives a binary request into its shared memory, so that the
    tensors in it cross to the core without another copy)."""

    def __init__(
        self, endpoint: Endpoint, into: Callable[[dict[bytes, bytes], int], memoryview | None]
    ) -> None:
        self.endpoint = endpoint  # ``RestApp`` calls it directly: no coroutine more
        self.into = into

    async def __call__(self, request: Request) -> Response | None:
        return await self.endpoint(request)


class ClientLeft(Exception):
    """The client went away before the end of the body an endpoint was reading."""


class BodyPieces:
    """A request body as it arrives, within the body limit, inflated if compressed:
    ``next()`` gives its pieces, then b"" at its end."""

    __slots__ = ("_ended", "_headers", "_inflation", "_limit", "_receive", "_received")

    def __init__(self, receive: Receive, headers: dict[bytes, bytes], limit: int) -> None:
        self._receive = receive
        self._headers = headers
        self._limit = limit
        self._received = 0  # bytes as sent
        self._ended = False  # the last piece was received
        self._inflation: _Inflation | None = None  # next()'s, for a compressed body

    async def next(self) -> bytes:
        encoding = self._headers.get(b"content-encoding")
        if encoding is None or encoding == b"identity":
            return await self._next_raw()
        if self._inflation is None:
            self._inflation = _Inflation(encoding, self._limit)
        inflation = self._inflation
        while True:
            if not inflation.unconsumed:
                if self._ended:
                    return inflation.ended()
                inflation.unconsumed = await self._next_raw()
            else:
                await trio.lowlevel.checkpoint()  # between inflated pieces of one chunk
            piece = inflation.inflate()
            if piece:
                return piece

    async def _next_raw(self) -> bytes:
        """The next piece as the client sent it; b"" at the end."""
        while not self._ended:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientLeft
            chunk: bytes = message.get("body", b"")
            self._received += len(chunk)
            if self._received > self._limit:
                raise body_too_large(self._limit)
            self._ended = not message.get("more_body", False)
            if chunk:
                return chunk
        return b""


class _Inflation:
    """A compressed body inflated a MiB at a time (a millisecond's work), within the
    body limit."""

    _PIECE = 1024 * 1024

    def __init__(self, encoding: bytes, limit: int) -> None:
        self._encoding = encoding.decode("latin-1")
        self._inflater = _inflater(encoding)
        self._limit = limit
        self._inflated = 0
        self.unconsumed = b""  # compressed bytes not inflated yet

    def inflate(self) -> bytes:
        try:
            piece = self._inflater.decompress(self.unconsumed, self._PIECE)
        except zlib.error as exc:
            raise InvalidArgumentError(f"malformed {self._encoding} body: {exc}") from None
        self.unconsumed = self._inflater.unconsumed_tail
        self._inflated += len(piece)
        if self._inflated > self._limit:
            raise body_too_large(self._limit)
        return piece

    def ended(self) -> bytes:
        if not self._inflater.eof:
            raise InvalidArgumentError(f"truncated {self._encoding} body")
        return b""


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
        extensions = scope.get("extensions") or _NO_EXTENSIONS
        try:
            endpoint, params = self.router.resolve(scope["method"], scope["path"])
            pieces = None
            body: bytes | bytearray | memoryview = b""
            if isinstance(endpoint, ReadsBody):
                pieces = BodyPieces(receive, headers, self.max_body_bytes)
            else:
                whole = extensions.get(RECEIVE_WHOLE)
                if whole is None:
                    body = await self._read_body(receive, headers)
                elif isinstance(endpoint, ReceivesInto):
                    into = partial(endpoint.into, headers)
                    body = await self._read_body(partial(whole["receive"], into), headers)
                    endpoint = endpoint.endpoint
                else:
                    body = await self._read_body(whole["receive"], headers)
            cancel_with = extensions.get(CANCEL_WITH)
            request = Request(
                scope["method"], scope["path"], params, headers, body, receive, send,
                self.disconnects.cancel_with(receive) if cancel_with is None
                else cancel_with["cancel_with"],
                pieces,
            )  # fmt: skip
            response = await endpoint(request)
        except ClientLeft:
            return  # nobody to answer
        except InferenceServerError as exc:
            response = Response(error_status(exc), error_body(exc.message))
        except HttpError as exc:
            response = Response(exc.status, error_body(exc.message), headers=exc.headers)
        if response is None:
            return  # answered by the endpoint itself, or the client went away
        await _send(send, response, headers, extensions)

    async def _read_body(
        self, receive: Callable[[], Awaitable[Message]], headers: dict[bytes, bytes]
    ) -> bytes | bytearray | memoryview:
        # Not through BodyPieces: this is every request's path, and a call less per
        # request shows in its CPU time.
        chunks: list[bytes | bytearray | memoryview] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientLeft
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


_NO_EXTENSIONS: dict[str, dict[str, Any]] = {}


def _inflater(encoding: bytes) -> zlib._Decompress:
    if encoding == b"gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if encoding == b"deflate":
        return zlib.decompressobj(zlib.MAX_WBITS)
    raise InvalidArgumentError(f"unsupported Content-Encoding '{encoding.decode('latin-1')}'")


def _decompress(body: bytes | bytearray | memoryview, encoding: bytes, limit: int) -> bytes:
    inflater = _inflater(encoding)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidArgumentError(f"malformed {encoding.decode()} body: {exc}") from None
    if len(data) > limit:
        raise body_too_large(limit)
    if not inflater.eof:
        raise InvalidArgumentError(f"truncated {encoding.decode()} body")
    return data


def accepted_encoding(headers: Mapping[bytes, bytes]) -> bytes | None:
    """The encoding a compressible response to a request with ``headers`` gets (gzip or
    deflate, by its Accept-Encoding), or None."""
    accepted = headers.get(b"accept-encoding")
    if not accepted:
        return None
    names = {part.split(b";")[0].strip() for part in accepted.split(b",")}
    for name in (b"gzip", b"deflate"):
        if name in names:
            return name
    return None


async def compressed(body: bytes | bytearray | memoryview, encoding: bytes) -> bytes:
    """``body`` in ``accepted_encoding``'s ``encoding``, at the fastest level; a large
    one in a worker thread (zlib lets go of the GIL), not holding up the other clients
    (about a millisecond per 200 KiB at this level)."""
    if len(body) < OFF_LOOP_BYTES:
        return _compress(body, encoding)
    return await trio.to_thread.run_sync(_compress, body, encoding)


def _compress(body: bytes | bytearray | memoryview, encoding: bytes) -> bytes:
    return gzip.compress(body, 1) if encoding == b"gzip" else zlib.compress(body, 1)


async def _send(
    send: Send,
    response: Response,
    request_headers: dict[bytes, bytes],
    extensions: Mapping[str, object],
) -> None:
    """Write ``response`` through ``send``, whose scope offered ``extensions``."""
    headers = list(response.headers)
    body = response.body
    if response.content_type is not None:
        headers.append((b"content-type", response.content_type))
    # (Its headers are completed below: the list is the message's.)
    start: Message = {"type": "http.response.start", "status": response.status, "headers": headers}
    if COMPRESSED_IN_FRONT in extensions:  # by the worker in front, if at all
        start[COMPRESSIBLE] = response.compressible
        encoding = None
    else:
        encoding = accepted_encoding(request_headers) if response.compressible else None
    if response.parts:
        if encoding is None and BODY_PARTS in extensions:
            parts = [body, *response.parts]
            headers.append((b"content-length", str(sum(map(len, parts))).encode()))
            await send(start)
            await send({"type": BODY_PARTS, "parts": parts})
            return
        body = response.joined().body  # to compress, or for a server that takes bytes only
    if encoding is not None:
        body = await compressed(body, encoding)
        headers.append((b"content-encoding", encoding))
    headers.append((b"content-length", str(len(body)).encode()))
    await send(start)
    await send({"type": "http.response.body", "body": body})
