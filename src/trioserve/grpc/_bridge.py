"""Hosts grpclib's asyncio ``Server`` inside trio, through trio-asyncio.

This is the only module that knows both worlds. grpclib runs its connections and
handlers as asyncio tasks on a trio-asyncio loop, which itself runs as trio tasks under
``serve_grpc``, so the whole front end lives inside the server's nursery. Three things
cross back into trio, started with ``loop.trio_as_future``: ``ServedModel.infer``; a
whole ModelStreamInfer call (``_stream.StreamInfer``), which in turn reads and writes
its grpclib stream through ``_TrioStream``, each message one step back into asyncio;
and the shared-memory work that waits in trio's worker threads (``_service.InTrio``).
grpclib cancels a handler's asyncio task when its client resets the stream or its
deadline passes; cancelling the awaited future cancels the trio call, and that
withdraws the request from the model's queue or aborts its generation.

Shutdown, once ``ServerContext.stop_accepting`` is set:
1. new RPCs answer UNAVAILABLE; those in flight finish, trailers included;
2. ``Server.close()`` stops listening (grpclib's close cancels any handler still
   running, which is why it waits for step 1);
3. open connections are closed, flushing what they still have to send (bounded, then
   aborted).
On cancellation instead, handlers are cancelled and connections aborted at once.

Handlers and connection callbacks run as asyncio callbacks, but trio-asyncio runs those
inside a trio task of this thread, so they may set a ``trio.Event``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

import trio
import trio_asyncio
from grpclib.const import Handler
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.server import Server, Stream
from h2.exceptions import StreamClosedError

from .._context import ServerContext
from .._errors import UnavailableError
from .._repository import ServedModel
from ._errors import MESSAGE_TOO_LARGE, grpc_error
from ._generated import grpc_service_pb2 as pb
from ._service import HealthService, InferenceService, InTrio
from ._stream import ClientGone, StreamInfer

Address = tuple[str, int]
_RpcFunc = Callable[[Stream[Any, Any]], Awaitable[None]]

# How long closed connections may take to flush what they still have to send before
# they are aborted. The drain before it is bounded by the server's exit_timeout_s.
_FLUSH_TIMEOUT_S = 5.0


async def serve_grpc(
    context: ServerContext,
    *,
    task_status: trio.TaskStatus[list[Address]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the gRPC front end on the configured host and gRPC port until cancelled or
    shut down.

    Reports ``[(host, bound_port)]`` once listening (port 0 binds a free port). Once
    ``context.stop_accepting`` is set, refuses new RPCs, lets those in flight finish, returns.
    """
    config = context.config
    host = config.host
    assert config.grpc_port is not None, "the gRPC front end is off"
    listener = _listen(host, config.grpc_port)
    bound = (host, listener.getsockname()[1])
    drain = _Drain()
    async with trio_asyncio.open_loop() as loop:
        # A trio task for each call and an asyncio future for its outcome; cancelling the
        # future cancels the task and resolves once it has ended.
        in_trio: InTrio = loop.trio_as_future

        streams = StreamInfer(context.repository, context.pipeline, context.load)

        def stream_infer(stream: Stream[Any, Any]) -> Awaitable[ServedModel | None]:
            return in_trio(streams.serve, _TrioStream(stream))

        services = [
            InferenceService(context, stream_infer, in_trio),
            HealthService(context.repository),
        ]
        try:
            server = await trio_asyncio.aio_as_trio(_start)(
                drain.guard(services), listener, config.grpc_max_message_bytes
            )
        except BaseException:
            listener.close()  # grpclib owns it only once started
            raise
        task_status.started([bound])
        try:
            await context.stop_accepting.wait()
            await drain.wait_idle()
            server.close()
            await server.close_connections(_FLUSH_TIMEOUT_S)
            await trio_asyncio.aio_as_trio(server.wait_closed)()
        finally:
            # On cancellation: cancels the handlers (open_loop's exit waits for them)
            # and drops the connections. After a graceful shutdown: nothing left to do.
            server.close()
            server.abort_connections()


class _TrioStream:
    """A ModelStreamInfer call's grpclib stream, for trio code (``_stream.StreamIO``)."""

    def __init__(self, stream: Stream[Any, Any]) -> None:
        self._recv = trio_asyncio.aio_as_trio(stream.recv_message)
        self._send = trio_asyncio.aio_as_trio(stream.send_message)

    async def recv(self) -> pb.ModelInferRequest | None:
        try:
            message: pb.ModelInferRequest | None = await self._recv()
        except (StreamClosedError, StreamTerminatedError) as exc:
            raise ClientGone from exc
        return message

    async def send(self, response: pb.ModelStreamInferResponse) -> None:
        try:
            await self._send(response)
        except (StreamClosedError, StreamTerminatedError) as exc:
            raise ClientGone from exc


async def _start(servable: _Guarded, listener: socket.socket, limit: int) -> _Server:
    """asyncio-flavoured: grpclib binds itself to the loop running it."""
    server = _Server(servable, codec=_LimitedCodec(limit))
    await server.start(sock=listener)
    return server


def _listen(host: str, port: int) -> socket.socket:
    """Bind here rather than in grpclib so the bound port is known without internals.

    The socket must say IPPROTO_TCP: accepted sockets inherit it, and both asyncio and
    grpclib set TCP_NODELAY only on sockets that do. Without it every small reply waits
    for the peer's delayed ACK (about 40 ms each).
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except BaseException:
        listener.close()
        raise
    return listener


class _LimitedCodec(ProtoCodec):
    """Protobuf codec that refuses messages over the configured size, both ways.

    grpclib itself has no limit. A request is checked after grpclib has read it (it
    offers no earlier hook), so the limit protects the models, not the socket buffer.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit

    def encode(self, message: Any, message_type: Any) -> bytes:
        data: bytes = super().encode(message, message_type)
        if len(data) > self._limit:
            raise GRPCError(
                MESSAGE_TOO_LARGE, f"Sent message larger than max ({len(data)} vs. {self._limit})"
            )
        return data

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self._limit:
            raise GRPCError(
                MESSAGE_TOO_LARGE,
                f"Received message larger than max ({len(data)} vs. {self._limit})",
            )
        return super().decode(data, message_type)


class _Server(Server):
    """grpclib's ``Server``, remembering its connections so that shutdown can close them.

    grpclib never closes the connections it accepted (``close()`` only stops listening
    and cancels handlers), which would leave sockets open after the front end returned.
    Overriding ``_protocol_factory`` is the one reach into grpclib's internals: every
    accepted connection is built there.
    """

    def __init__(self, servable: _Guarded, *, codec: ProtoCodec) -> None:
        super().__init__([servable], codec=codec)
        self._transports: set[asyncio.Transport] = set()
        self._all_lost: trio.Event | None = None  # exists while close_connections waits

    # asyncio needs only a Protocol here; grpclib's annotation names its own class.
    def _protocol_factory(self) -> asyncio.Protocol:  # type: ignore[override]
        return _Tracked(super()._protocol_factory(), self)

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transports.add(transport)

    def connection_lost(self, transport: asyncio.Transport) -> None:
        self._transports.discard(transport)
        if not self._transports and self._all_lost is not None:
            self._all_lost.set()

    async def close_connections(self, timeout_s: float) -> None:
        """Close every connection once it has sent what it buffered; abort the slow ones."""
        self._all_lost = trio.Event()
        for transport in list(self._transports):
            transport.close()
        if self._transports:
            with trio.move_on_after(timeout_s):
                await self._all_lost.wait()
        self.abort_connections()

    def abort_connections(self) -> None:
        for transport in list(self._transports):
            transport.abort()


class _Tracked(asyncio.Protocol):
    """Passes every callback to grpclib's protocol and tells the server about the ends."""

    def __init__(self, inner: Any, server: _Server) -> None:
        self._inner = inner
        self._server = server
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP server's transports are full Transports (they can abort()).
        self._transport = cast(asyncio.Transport, transport)
        self._server.connection_made(self._transport)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        result: bool | None = self._inner.eof_received()
        return result

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            if self._transport is not None:
                self._server.connection_lost(self._transport)


class _Drain:
    """Counts RPCs in flight; once closing, refuses new ones and says when none is left."""

    def __init__(self) -> None:
        self._closing = False
        self._active = 0
        self._idle = trio.Event()

    def guard(self, services: Iterable[Any]) -> _Guarded:
        mapping = {
            path: handler._replace(func=self._counted(handler.func))
            for service in services
            for path, handler in service.__mapping__().items()
        }
        return _Guarded(mapping)

    async def wait_idle(self) -> None:
        self._closing = True
        if self._active:
            await self._idle.wait()

    def _counted(self, func: _RpcFunc) -> _RpcFunc:
        async def counted(stream: Stream[Any, Any]) -> None:
            if self._closing:
                raise grpc_error(UnavailableError("the server is shutting down"))
            self._active += 1
            try:
                await _finish_call(func, stream)
            finally:
                self._active -= 1
                if self._closing and not self._active:
                    self._idle.set()

        return counted


async def _finish_call(func: _RpcFunc, stream: Stream[Any, Any]) -> None:
    """Run a handler and send its trailers before the call counts as finished.

    grpclib would send them after the handler returns, but that write can wait on a
    paused transport (after a large reply), and a drain that ended first would let
    ``Server.close()`` cancel it: the client would never learn its call succeeded.
    """
    try:
        try:
            await func(stream)
        except GRPCError as error:
            await stream.send_trailing_metadata(
                status=error.status, status_message=error.message, status_details=error.details
            )
        else:
            # A handler may send its own trailers (with metadata), as grpclib allows;
            # this is the check grpclib itself makes before sending them for it.
            if not stream._send_trailing_metadata_done:
                await stream.send_trailing_metadata()
    except (StreamClosedError, StreamTerminatedError):
        pass  # the client reset the stream or left: there is nobody left to tell


class _Guarded:
    """What grpclib serves: every handler of our services, counted by the drain."""

    def __init__(self, mapping: dict[str, Handler]) -> None:
        self._mapping = mapping

    def __mapping__(self) -> dict[str, Handler]:
        return self._mapping
