"""What a front-end worker serves: the REST app and the gRPC method table of one
process, with each endpoint and method replaced by its forwarding to the core.

The worker does the protocol work (accepting, HTTP/1.1 and HTTP/2, TLS, body limits,
decompression, gRPC framing and limits); the core answers every call with the code a
single process runs, so answers cannot differ between connections or workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import trio

from .._errors import NotFoundError, UnavailableError
from ..grpc import (
    Call,
    ClientGone,
    GrpcError,
    GrpcStatus,
    MessageStream,
    Method,
    StreamMethod,
    UnaryMethod,
    WireReply,
)
from ..rest import Endpoint, HttpError, Request, Router, accepted_encoding, compressed
from ._client import Answer, CoreClient
from ._wire import BODY, GRPC, GRPC_STREAM, HALF_CLOSE, HTTP, MESSAGE, REPLY, START

_CORE_GONE = "the server's core process is gone"


class ForwardAll(Router[Endpoint]):
    """A router with the routes the worker answers itself (added as to any router); every
    other request goes to ``fallback``, which forwards it: the core routes it."""

    def __init__(self, fallback: Endpoint) -> None:
        super().__init__()
        self._fallback = fallback

    def resolve(self, method: str, path: str) -> tuple[Endpoint, dict[str, str]]:
        try:
            return super().resolve(method, path)
        except (NotFoundError, HttpError):
            return self._fallback, {}


class RestForwarder:
    """The REST endpoint of every path: the request goes to the core, its answer (whole
    or streamed) back to the client; a client that leaves withdraws it there."""

    def __init__(self, client: CoreClient) -> None:
        self._client = client

    async def __call__(self, request: Request) -> None:
        client = self._client
        body = client.out.pack(request.body)
        call, answers = client.open()
        # Decompressed here already: the core must not inflate it again.
        headers = [(k, v) for k, v in request.headers.items() if k != b"content-encoding"]
        message = (HTTP, call, request.method, request.path, b"", headers, body)
        await client.out.send(message, body)
        request.cancel_with(partial(client.cancel, call, answers))
        encoding = accepted_encoding(request.headers)  # for a compressible response
        done = started = False
        try:
            async for item in answers:
                if isinstance(item, BaseException):  # the link died: the core is gone
                    done = True
                    if not started:
                        raise UnavailableError(_CORE_GONE)
                    break
                started = True
                done = await self._relay(request, item, encoding)
        finally:
            request.cancel_with(None)
            if not done:
                client.cancel(call, answers)

    async def _relay(self, request: Request, item: Answer, encoding: bytes | None) -> bool:
        """Send one answer item to the client, a compressible body in ``encoding`` if
        any; True once the response is complete."""
        client = self._client
        head: dict[str, Any] | None = None
        if item[0] == START:
            _, status, headers, compressible, chunk, more = item
            head = {"type": "http.response.start", "status": status, "headers": headers}
            if not compressible or more:  # (a compressible body comes whole)
                encoding = None
        else:
            _, chunk, more = item
            assert item[0] == BODY
        try:
            data = client.take(chunk)
            if head is not None:
                if encoding is not None:
                    data = await compressed(data, encoding)
                    kept = [(k, v) for k, v in head["headers"] if k != b"content-length"]
                    length = str(len(data)).encode()
                    head["headers"] = [
                        *kept,
                        (b"content-encoding", encoding),
                        (b"content-length", length),
                    ]
                await request.send(head)
            body = {"type": "http.response.body", "body": data, "more_body": more}
            await request.send(body)  # written (or the client gone) when this returns
        finally:
            client.free(chunk)
        return not more


class Raw:
    """A request message left as its bytes: the core parses it."""

    @staticmethod
    def FromString(data: bytes) -> bytes:
        return data


def forwarding_methods(client: CoreClient, paths: Mapping[str, bool]) -> dict[str, Method]:
    """The core's gRPC method table (``paths``: path -> streaming?), each forwarded."""
    methods: dict[str, Method] = {}
    for path, streaming in paths.items():
        if streaming:
            methods[path] = StreamMethod(Raw, partial(_forward_stream, client, path))
        else:
            methods[path] = UnaryMethod(Raw, partial(forward_unary, client, path))
    return methods


def _reply(client: CoreClient, payload: Any) -> WireReply:
    data = client.take(payload)
    # The HTTP/2 core may hold a reply's parts after send_reply returns: a block's bytes
    # are copied out before it is freed.
    reply = WireReply([bytes(data) if isinstance(data, memoryview) else data])
    client.free(payload)
    return reply


def _end(call: Call, item: Answer | BaseException) -> None:
    """Apply a call's END (trailers, status): raise for a status other than OK."""
    if isinstance(item, BaseException):
        raise GrpcError(GrpcStatus.UNAVAILABLE, _CORE_GONE)
    _, status, text, trailers = item[:4]
    for key, value in trailers:
        call.add_trailer(key, value)
    if status != GrpcStatus.OK:
        raise GrpcError(GrpcStatus(status), text)


async def forward_unary(client: CoreClient, path: str, data: bytes, call: Call) -> WireReply:
    payload = client.out.pack(data)
    number, answers = client.open()
    await client.out.send((GRPC, number, path, dict(call.metadata), payload), payload)
    call.cancel_with(partial(client.cancel, number, answers))
    try:
        item = await answers.receive()
    except BaseException:
        client.cancel(number, answers)
        raise
    try:
        _end(call, item)
    except GrpcError:
        client.release(item)
        raise
    assert isinstance(item, tuple)
    return _reply(client, item[4])


async def _forward_stream(
    client: CoreClient, path: str, messages: MessageStream, call: Call
) -> None:
    number, answers = client.open()
    await client.out.send((GRPC_STREAM, number, path, dict(call.metadata)))
    ended = False
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, client, number, messages, nursery.cancel_scope)
            async for item in answers:
                if isinstance(item, tuple) and item[0] == REPLY:
                    try:
                        await messages.send(_reply(client, item[1]))
                    except ClientGone:  # the client reset the stream (see _pump)
                        nursery.cancel_scope.cancel()
                        break
                    continue
                ended = True
                nursery.cancel_scope.cancel()
                _end(call, item)
                break
    finally:
        if not ended:
            client.cancel(number, answers)


async def _pump(
    client: CoreClient, number: int, messages: MessageStream, forward: trio.CancelScope
) -> None:
    """The client's messages to the core, then its half-close."""
    try:
        while (message := await messages.recv()) is not None:
            payload = client.out.pack(message)
            await client.out.send((MESSAGE, number, payload), payload)
    except ClientGone:
        # The client reset the stream: the forward ends (the core's call withdrawn), and
        # quietly, as the call's front end expects. Raised from this task, ClientGone
        # would leave the nursery inside an exception group, taken for a failure.
        forward.cancel()
        return
    await client.out.send((HALF_CLOSE, number))
