"""The alternative gRPC front end: grpclib's asyncio ``Server``, hosted in trio through
trio-asyncio (``ServerConfig.grpc_server = "grpclib"``).

This is the only module that knows both worlds. grpclib runs its connections as asyncio
tasks on a trio-asyncio loop, which itself runs as trio tasks under ``serve_grpclib``,
so the whole front end lives inside the server's nursery. Each method of the table
(``_methods.grpc_methods``) becomes a grpclib handler: an asyncio function that
receives the request, runs the trio handler once (``loop.trio_as_future``), sends the
reply and then the trailers, or the status ``status_of`` gives its failure. A streaming
handler reads and writes its grpclib stream through ``_TrioStream``, each message one
step back into asyncio. grpclib cancels a handler's asyncio task when its client resets
the stream or its deadline passes; cancelling the awaited future cancels the trio call,
and that withdraws the request from the model's queue or aborts its generation.

asyncio reports what it cannot raise anywhere (an accept that failed for want of file
descriptors, a connection's protocol error) to the loop's exception handler, which
trio-asyncio's default turns into an exception in the server's nursery: one such event
would stop the server. Here it is logged instead; asyncio itself pauses accepting for a
second when descriptors run out.

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
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import trio
import trio_asyncio
from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import StreamTerminatedError
from grpclib.server import Server, Stream
from h2.exceptions import StreamClosedError

from .._context import ServerContext
from ._errors import ClientGone, GrpcError, GrpcStatus, parse_message, status_of
from ._methods import Method, UnaryMethod, grpc_methods

logger = logging.getLogger("trioserve.grpc")

Address = tuple[str, int]
# Runs ``await function(*args)`` in trio; cancelling the await cancels the call, and the
# await ends only once the call has.
_InTrio = Callable[..., Awaitable[Any]]
_Answer = Callable[[Stream[Any, Any]], Awaitable["_GrpclibCall"]]

# How long closed connections may take to flush what they still have to send before
# they are aborted. The drain before it is bounded by the server's exit_timeout_s.
_FLUSH_TIMEOUT_S = 5.0


async def serve_grpclib(
    context: ServerContext,
    *,
    task_status: trio.TaskStatus[list[Address]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the gRPC methods on the configured host and gRPC port until cancelled or
    shut down.

    Reports ``[(host, bound_port)]`` once listening (port 0 binds a free port). Once
    ``context.stop_accepting`` is set, refuses new RPCs, lets those in flight finish,
    returns.
    """
    config = context.config
    assert config.grpc_port is not None, "the gRPC front end is off"
    listener = _listen(config.host, config.grpc_port)
    bound = (config.host, listener.getsockname()[1])
    drain = _Drain()
    async with trio_asyncio.open_loop() as loop:
        loop.set_exception_handler(_log_loop_error)
        methods = grpc_methods(context)
        mapping = {
            path: _handler(method, loop.trio_as_future, drain) for path, method in methods.items()
        }
        try:
            server = await trio_asyncio.aio_as_trio(_start)(
                _Servable(mapping), listener, config.grpc_limits.max_message_bytes
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


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """What asyncio could raise nowhere: logged, never raised into the server's nursery."""
    exception = context.get("exception")
    message = context.get("message", "asyncio reported an error")
    logger.error("gRPC front end: %s", message, exc_info=exception)


def _no_compression() -> GrpcError:
    """grpclib reads no compressed message (it raises NotImplementedError for one)."""
    return GrpcError(
        GrpcStatus.UNIMPLEMENTED,
        "compressed messages are not supported by the grpclib front end "
        "(the built-in one, --grpc-server trio, takes gzip and deflate)",
    )


async def _receive(stream: Stream[Any, Any]) -> Any:
    try:
        return await stream.recv_message()
    except NotImplementedError:
        raise _no_compression() from None


def _handler(method: Method, in_trio: _InTrio, drain: _Drain) -> Handler:
    """The grpclib handler that serves ``method``'s trio handler."""
    if isinstance(method, UnaryMethod):
        unary = method.handler

        async def answer(stream: Stream[Any, Any]) -> _GrpclibCall:
            request = await _receive(stream)
            if request is None:  # the client ended the stream without sending one
                raise GrpcError(GrpcStatus.INVALID_ARGUMENT, "the call carried no request message")
            call = _GrpclibCall(stream)
            await stream.send_message(await in_trio(unary, request, call))
            return call

        cardinality = Cardinality.UNARY_UNARY
    else:
        streaming = method.handler

        async def answer(stream: Stream[Any, Any]) -> _GrpclibCall:
            call = _GrpclibCall(stream)
            await in_trio(streaming, _TrioStream(stream), call)
            return call

        cardinality = Cardinality.STREAM_STREAM
    # No reply type: the codec serializes whatever message the handler answers.
    return Handler(drain.counted(answer), cardinality, method.request_type, None)


class _GrpclibCall:
    """A call's metadata and trailers (``_methods.Call``) over a grpclib stream."""

    __slots__ = ("_metadata", "_stream", "trailers")

    def __init__(self, stream: Stream[Any, Any]) -> None:
        self._stream = stream
        self._metadata: dict[str, str] | None = None  # built when first asked for
        self.trailers: list[tuple[str, str | bytes]] = []

    @property
    def metadata(self) -> Mapping[str, str]:
        if self._metadata is None:
            received = self._stream.metadata
            # grpclib gives "-bin" values as bytes, the others as text.
            self._metadata = {
                key: value
                for key, value in (received.items() if received is not None else ())
                if isinstance(value, str)
            }
        return self._metadata

    def add_trailer(self, key: str, value: bytes) -> None:
        # grpclib sends "-bin" values as they are (base64) and others as text.
        self.trailers.append((key, value if key.endswith("-bin") else value.decode("latin-1")))

    def cancel_with(self, withdraw: Callable[[], None] | None) -> None:
        pass  # a grpclib call is cancelled as the trio task it runs in


class _TrioStream:
    """A streaming call's grpclib stream, for trio code (``_methods.MessageStream``)."""

    def __init__(self, stream: Stream[Any, Any]) -> None:
        self._recv = trio_asyncio.aio_as_trio(stream.recv_message)
        self._send = trio_asyncio.aio_as_trio(stream.send_message)

    async def recv(self) -> Any | None:
        try:
            return await self._recv()
        except (StreamClosedError, StreamTerminatedError) as exc:
            raise ClientGone from exc
        except NotImplementedError:
            raise _no_compression() from None

    async def send(self, message: Any) -> None:
        try:
            await self._send(message)
        except (StreamClosedError, StreamTerminatedError) as exc:
            raise ClientGone from exc


class _Drain:
    """Counts RPCs in flight; once closing, refuses new ones and says when none is left."""

    def __init__(self) -> None:
        self._closing = False
        self._active = 0
        self._idle = trio.Event()

    async def wait_idle(self) -> None:
        self._closing = True
        if self._active:
            await self._idle.wait()

    def counted(self, answer: _Answer) -> Callable[[Stream[Any, Any]], Awaitable[None]]:
        async def counted(stream: Stream[Any, Any]) -> None:
            if self._closing:
                refused = GrpcError(GrpcStatus.UNAVAILABLE, "the server is shutting down")
                await _finish_call(_refuse(refused), stream)
                return
            self._active += 1
            try:
                await _finish_call(answer, stream)
            finally:
                self._active -= 1
                if self._closing and not self._active:
                    self._idle.set()

        return counted


def _refuse(error: GrpcError) -> _Answer:
    async def refuse(stream: Stream[Any, Any]) -> _GrpclibCall:
        raise error

    return refuse


async def _finish_call(answer: _Answer, stream: Stream[Any, Any]) -> None:
    """Answer a call and send its trailers before the call counts as finished.

    grpclib would send them after the handler returns, but that write can wait on a
    paused transport (after a large reply), and a drain that ended first would let
    ``Server.close()`` cancel it: the client would never learn its call succeeded.
    """
    try:
        try:
            call = await answer(stream)
        except Exception as exc:  # asyncio.CancelledError passes, as grpclib needs
            status, message = status_of(exc)
            await stream.send_trailing_metadata(status=Status(status), status_message=message)
        else:
            await stream.send_trailing_metadata(metadata=call.trailers)
    except (StreamClosedError, StreamTerminatedError):
        pass  # the client reset the stream or left: there is nobody left to tell


class _Servable:
    """What grpclib serves: a handler for every path."""

    def __init__(self, mapping: dict[str, Handler]) -> None:
        self._mapping = mapping

    def __mapping__(self) -> dict[str, Handler]:
        return self._mapping


async def _start(servable: _Servable, listener: socket.socket, limit: int) -> _Server:
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
    """Protobuf codec that refuses messages over the configured size, both ways, and
    answers a malformed request INVALID_ARGUMENT.

    grpclib itself has no limit. A request is checked after grpclib has read it (it
    offers no earlier hook), so the limit protects the models, not the socket buffer.
    Replies are serialized whatever their type: the method table names request types only.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit

    def encode(self, message: Any, message_type: Any) -> bytes:
        data: bytes = message.SerializeToString()
        if len(data) > self._limit:
            raise GrpcError(
                GrpcStatus.RESOURCE_EXHAUSTED,
                f"Sent message larger than max ({len(data)} vs. {self._limit})",
            )
        return data

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self._limit:
            raise GrpcError(
                GrpcStatus.RESOURCE_EXHAUSTED,
                f"Received message larger than max ({len(data)} vs. {self._limit})",
            )
        return parse_message(message_type, data)


class _Server(Server):
    """grpclib's ``Server``, remembering its connections so that shutdown can close them.

    grpclib never closes the connections it accepted (``close()`` only stops listening
    and cancels handlers), which would leave sockets open after the front end returned.
    Overriding ``_protocol_factory`` is the one reach into grpclib's internals: every
    accepted connection is built there.
    """

    def __init__(self, servable: _Servable, *, codec: ProtoCodec) -> None:
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
