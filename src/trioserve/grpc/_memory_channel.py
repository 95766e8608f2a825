"""An in-memory gRPC channel to a test server: real HTTP/2 and gRPC framing, over a trio
memory stream instead of a socket, to the same HTTP/2 core the gRPC port runs. Nothing
waits on the kernel, so under trio's mock clock a call's deadline and a model's declared
time come out exact, as ``Server.infer``'s do.

The client half is minimal and trio-native: unary calls and streaming calls (one task
may send while another receives), protobuf messages in and out. It keeps its own
windows open (each DATA frame is credited back as it arrives) and honours the server's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TypeVar

import trio
import trio.testing
from google.protobuf.message import Message

from .._context import ServerContext
from . import _h2_frames as h2
from ._errors import GrpcStatus
from ._generated import grpc_service_pb2 as pb
from ._h2_guard import header_fragment
from ._hpack import HeaderDecoder, encode_headers
from ._serve import serve_grpc_stream
from ._wire import MESSAGE_PREFIX, PREFIX_BYTES

M = TypeVar("M", bound=Message)

_SERVICE = "/inference.GRPCInferenceService/"


class GrpcCallError(Exception):
    """A call ended with a status other than OK (``status``, a ``grpc.StatusCode``'s
    number as an ``IntEnum``, and the server's ``message``)."""

    def __init__(self, status: GrpcStatus, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message


class _Call:
    __slots__ = ("buffer", "ended", "headers", "id", "messages", "reset", "send_window", "trailers")

    def __init__(self, stream_id: int, send_window: int) -> None:
        self.id = stream_id
        self.send_window = send_window
        self.headers: dict[bytes, bytes] | None = None
        self.trailers: dict[bytes, bytes] | None = None
        self.messages: deque[bytes] = deque()
        self.buffer = bytearray()  # DATA not yet cut into messages
        self.ended = False
        self.reset: int | None = None

    def status(self) -> tuple[GrpcStatus, str]:
        if self.reset is not None:
            return GrpcStatus.UNAVAILABLE, f"the stream was reset ({self.reset:#x})"
        fields = self.trailers or {}
        code = fields.get(b"grpc-status")
        if code is None:
            return GrpcStatus.INTERNAL, "the call ended without a grpc-status"
        return GrpcStatus(int(code)), fields.get(b"grpc-message", b"").decode("latin-1")


class StreamingCall:
    """A streaming call: ``send`` requests, ``done_writing``, ``receive`` responses."""

    def __init__(self, channel: GrpcChannel, call: _Call, response_type: type[Message]) -> None:
        self._channel = channel
        self._call = call
        self._response_type = response_type

    async def send(self, request: Message) -> None:
        await self._channel._send_message(self._call, request.SerializeToString(), end=False)

    async def done_writing(self) -> None:
        await self._channel._send_data(self._call, b"", end=True)

    async def receive(self) -> Message | None:
        """The next response; None once the call ended OK. Raises ``GrpcCallError``."""
        message = await self._channel._next_message(self._call)
        return None if message is None else self._response_type.FromString(message)


class GrpcChannel:
    """One HTTP/2 connection's client side (``open_grpc_channel``)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._sending = trio.Lock()
        self._decoder = HeaderDecoder()
        self._calls: dict[int, _Call] = {}
        self._next_id = 1
        self._window = h2.DEFAULT_WINDOW  # the server's, for what we send
        self._initial_window = h2.DEFAULT_WINDOW
        self._max_frame = h2.DEFAULT_MAX_FRAME
        self._changed = trio.Event()  # a call got something, or a window opened
        self._block = b""  # a header block waiting for CONTINUATION
        self._closed: str | None = None  # why no new call may start
        self._gone = False  # the connection ended: calls in flight end too

    # --- calls ---------------------------------------------------------------------------

    async def unary(
        self,
        method: str,
        request: Message,
        response_type: type[M],
        *,
        metadata: Iterable[tuple[str, str]] = (),
        deadline_s: float | None = None,
    ) -> M:
        """Call ``method`` (its HTTP/2 path) with one request; its one response.
        ``deadline_s`` goes as ``grpc-timeout``: the server ends the call with
        DEADLINE_EXCEEDED past it. Raises ``GrpcCallError``."""
        call = await self._open(method, metadata, deadline_s)
        try:
            await self._send_message(call, request.SerializeToString(), end=True)
            message = await self._next_message(call)
            if message is None:
                raise GrpcCallError(GrpcStatus.INTERNAL, "the call ended without a response")
            await self._next_message(call)  # its status
        finally:
            self._calls.pop(call.id, None)
        reply: M = response_type.FromString(message)
        return reply

    async def model_infer(
        self,
        request: Message,
        *,
        metadata: Iterable[tuple[str, str]] = (),
        deadline_s: float | None = None,
    ) -> pb.ModelInferResponse:
        """``inference.GRPCInferenceService/ModelInfer``."""
        return await self.unary(
            _SERVICE + "ModelInfer", request, pb.ModelInferResponse, metadata=metadata,
            deadline_s=deadline_s,
        )  # fmt: skip

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        response_type: type[Message],
        *,
        metadata: Iterable[tuple[str, str]] = (),
        deadline_s: float | None = None,
    ) -> AsyncIterator[StreamingCall]:
        """A streaming call to ``method``; leaving the block before it ended resets it."""
        call = await self._open(method, metadata, deadline_s)
        try:
            yield StreamingCall(self, call, response_type)
        finally:
            if not call.ended and not self._gone:
                with trio.CancelScope(shield=True):
                    await self._send(h2.rst_stream(call.id, h2.CANCEL))
            self._calls.pop(call.id, None)

    def model_stream_infer(
        self, *, metadata: Iterable[tuple[str, str]] = (), deadline_s: float | None = None
    ) -> AbstractAsyncContextManager[StreamingCall]:
        """``inference.GRPCInferenceService/ModelStreamInfer``: responses are
        ``ModelStreamInferResponse``."""
        return self.stream(
            _SERVICE + "ModelStreamInfer", pb.ModelStreamInferResponse, metadata=metadata,
            deadline_s=deadline_s,
        )  # fmt: skip

    async def _open(
        self, path: str, metadata: Iterable[tuple[str, str]], deadline_s: float | None
    ) -> _Call:
        if self._closed is not None:
            raise GrpcCallError(GrpcStatus.UNAVAILABLE, self._closed)
        fields = [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
            (b":authority", b"trioserve.testing"), (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]  # fmt: skip
        if deadline_s is not None:  # the server ends the call DEADLINE_EXCEEDED past it
            fields.append((b"grpc-timeout", _timeout(deadline_s)))
        fields += [(key.lower().encode(), value.encode("latin-1")) for key, value in metadata]
        call = _Call(self._next_id, self._initial_window)
        self._next_id += 2
        self._calls[call.id] = call
        await self._send(h2.frame(h2.HEADERS, h2.END_HEADERS, call.id, encode_headers(fields)))
        return call

    async def _send_message(self, call: _Call, payload: bytes, *, end: bool) -> None:
        await self._send_data(call, MESSAGE_PREFIX.pack(0, len(payload)) + payload, end=end)

    async def _send_data(self, call: _Call, data: bytes, *, end: bool) -> None:
        """DATA frames within the server's windows (END_STREAM on the last if ``end``)."""
        while True:
            if call.ended:
                return  # answered already: what is left is not wanted
            count = min(len(data), self._window, call.send_window, self._max_frame)
            if count < len(data) and count <= 0:
                await self._wait()
                continue
            last = count == len(data)
            self._window -= count
            call.send_window -= count
            flags = h2.END_STREAM if last and end else 0
            await self._send(h2.frame(h2.DATA, flags, call.id, data[:count]))
            data = data[count:]
            if last:
                return

    async def _next_message(self, call: _Call) -> bytes | None:
        """The call's next response message; None once it ended OK."""
        while not call.messages:
            if call.ended:
                status, message = call.status()
                if status != GrpcStatus.OK:
                    raise GrpcCallError(status, message)
                return None
            if self._gone:
                raise GrpcCallError(GrpcStatus.UNAVAILABLE, str(self._closed))
            await self._wait()
        return call.messages.popleft()

    async def _wait(self) -> None:
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _send(self, data: bytes) -> None:
        async with self._sending:
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._close("the connection is gone", gone=True)

    # --- reading -------------------------------------------------------------------------

    async def _read_forever(self) -> None:
        buf = b""
        while True:
            while len(buf) >= h2.FRAME_HEADER_BYTES:
                high, low, kind, flags, stream_id = h2.HEADER.unpack_from(buf)
                end = h2.FRAME_HEADER_BYTES + (high << 16 | low)
                if len(buf) < end:
                    break
                await self._on_frame(kind, flags, stream_id & 0x7FFFFFFF, buf[9:end])
                buf = buf[end:]
            try:
                data = await self._stream.receive_some()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self._close("the server closed the connection", gone=True)
                return
            buf += data

    async def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        call = self._calls.get(stream_id)
        if kind == h2.SETTINGS and not flags & h2.ACK:
            for key, value in h2.parse_settings(payload):
                if key == h2.INITIAL_WINDOW_SIZE:
                    for each in self._calls.values():
                        each.send_window += value - self._initial_window
                    self._initial_window = value
                elif key == h2.MAX_FRAME_SIZE:
                    self._max_frame = value
            await self._send(h2.SETTINGS_ACK)
        elif kind == h2.PING and not flags & h2.ACK:
            await self._send(h2.ping_ack(payload))
        elif kind == h2.WINDOW_UPDATE:
            increment = h2.read_u32(payload) & 0x7FFFFFFF
            if stream_id == 0:
                self._window += increment
            elif call is not None:
                call.send_window += increment
        elif kind == h2.GOAWAY:  # the calls it started go on; no new one may start
            self._close("the server sent GOAWAY")
        elif call is None:
            return  # a frame for a call given up
        elif kind == h2.RST_STREAM:
            if not call.ended:  # after the trailers it only asks us to stop sending
                call.reset = h2.read_u32(payload)
                call.ended = True
        elif kind == h2.DATA:
            self._on_data(call, flags, payload)
            if payload:  # keep the server's windows for us open
                credit = len(payload)
                await self._send(h2.window_update(0, credit) + h2.window_update(call.id, credit))
        elif kind in (h2.HEADERS, h2.CONTINUATION):
            self._block += header_fragment(flags, payload) if kind == h2.HEADERS else payload
            if not flags & h2.END_HEADERS:
                return
            fields = dict(self._decoder.decode(self._block))
            self._block = b""
            if call.headers is None and not flags & h2.END_STREAM:
                call.headers = fields
            else:
                call.trailers = fields
            call.ended = bool(flags & h2.END_STREAM)
        self._wake()

    def _on_data(self, call: _Call, flags: int, payload: bytes) -> None:
        if flags & h2.PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        call.buffer += payload
        while len(call.buffer) >= PREFIX_BYTES:
            _, size = MESSAGE_PREFIX.unpack_from(call.buffer)
            if len(call.buffer) < PREFIX_BYTES + size:
                break
            call.messages.append(bytes(call.buffer[PREFIX_BYTES : PREFIX_BYTES + size]))
            del call.buffer[: PREFIX_BYTES + size]
        call.ended = bool(flags & h2.END_STREAM)

    def _close(self, reason: str, *, gone: bool = False) -> None:
        if self._closed is None:
            self._closed = reason
        self._gone = self._gone or gone
        self._wake()

    async def _start(self) -> None:
        settings = h2.settings_frame([(h2.ENABLE_PUSH, 0), (h2.INITIAL_WINDOW_SIZE, h2.MAX_WINDOW)])
        window = h2.window_update(0, h2.MAX_WINDOW - h2.DEFAULT_WINDOW)
        await self._send(h2.PREFACE + settings + window)


def _timeout(seconds: float) -> bytes:
    """``grpc-timeout``: at most 8 digits, in the finest unit that holds them."""
    for unit, scale in ((b"u", 1e6), (b"m", 1e3), (b"S", 1.0)):
        value = math.ceil(seconds * scale)
        if value < 10**8:
            return b"%d" % value + unit
    return b"99999999S"


@asynccontextmanager
async def open_memory_channel(context: ServerContext) -> AsyncIterator[GrpcChannel]:
    """A gRPC channel in memory to the server of ``context``, for the duration of the
    block: its connection is served by the same HTTP/2 core and method table as the gRPC
    port, with the server's gRPC limits (``trioserve.testing.open_grpc_channel``)."""
    client_side, server_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_grpc_stream, context, server_side)
        channel = GrpcChannel(client_side)
        await channel._start()
        nursery.start_soon(channel._read_forever)
        try:
            yield channel
        finally:
            # No await here: in a cancelled scope its Cancelled would replace an error
            # leaving the block. Both ends are memory, which nothing needs to close.
            nursery.cancel_scope.cancel()
