"""A raw HTTP/2 client for protocol tests of the gRPC core (the ``h2`` fixture): the
``h2`` package for well-formed traffic, plus helpers to write frames by hand for the
malformed kind."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
import trio

from trioserve import GrpcLimits
from trioserve.grpc._core import serve_methods
from trioserve.grpc._generated import grpc_service_pb2 as pb
from trioserve.grpc._methods import Call, MessageStream, Method, StreamMethod, UnaryMethod

GRPC_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":authority", "127.0.0.1"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


def grpc_message(payload: bytes, *, compressed: bool = False) -> bytes:
    return struct.pack(">BL", compressed, len(payload)) + payload


def raw_frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    length = len(payload)
    return struct.pack(">BHBBL", length >> 16, length & 0xFFFF, kind, flags, stream_id) + payload


@asynccontextmanager
async def core_server(
    methods: dict[str, Method],
    max_message_bytes: int = 2**31 - 1,
    statistics: Any = None,
    **limits: Any,
) -> AsyncIterator[int]:
    """The core alone, serving ``methods`` on a free port (counting in ``statistics``)."""
    async with trio.open_nursery() as nursery:
        serve = partial(
            serve_methods, methods, "127.0.0.1", 0, GrpcLimits(**limits),
            max_message_bytes=max_message_bytes, statistics=statistics,
        )  # fmt: skip
        addresses = await nursery.start(serve)
        yield addresses[0][1]
        nursery.cancel_scope.cancel()


@dataclass
class Reply:
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    data: bytes = b""
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    reset: int | None = None
    ended: bool = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in [*self.headers, *self.trailers]:
            if key == name:
                return value
        return None

    @property
    def status(self) -> int | None:
        value = self.header(b"grpc-status")
        return None if value is None else int(value)


class RawClient:
    """One HTTP/2 connection to the core, driven by the test."""

    def __init__(self, stream: trio.SocketStream, window: int | None = None) -> None:
        self.stream = stream
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.h2 = h2.connection.H2Connection(config)
        self.replies: dict[int, Reply] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed = False
        self.settings: dict[int, int] = {}
        self._window = window

    @classmethod
    @asynccontextmanager
    async def connect(cls, port: int, window: int | None = None) -> AsyncIterator[RawClient]:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            client = cls(stream, window)
            client.h2.initiate_connection()
            if window is not None:
                client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
            await client.flush()
            yield client

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    def start_call(
        self, path: str, metadata: Sequence[tuple[Any, Any]] = (), *, end: bool = False
    ) -> int:
        headers = [*GRPC_HEADERS[:2], (":path", path), *GRPC_HEADERS[2:], *metadata]
        return self.send_headers(headers, end=end)

    def send_headers(self, headers: Sequence[tuple[str, str]], *, end: bool) -> int:
        stream_id: int = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, headers, end_stream=end)
        self.replies[stream_id] = Reply()
        return stream_id

    def send_message(self, stream_id: int, payload: bytes, *, end: bool = True) -> None:
        self.h2.send_data(stream_id, grpc_message(payload), end_stream=end)

    async def call(
        self, path: str, payload: bytes, metadata: Sequence[tuple[Any, Any]] = ()
    ) -> Reply:
        stream_id = self.start_call(path, metadata)
        self.send_message(stream_id, payload)
        await self.flush()
        return await self.until_ended(stream_id)

    async def until_ended(self, stream_id: int) -> Reply:
        reply = self.replies[stream_id]
        await self.until(lambda: reply.ended)
        return reply

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            if self.closed:
                raise AssertionError("the server closed the connection")
            await self.receive()

    async def receive(self) -> None:
        """Read once and handle what arrived; marks ``closed`` at EOF."""
        try:
            data = await self.stream.receive_some(1 << 20)
        except trio.BrokenResourceError:
            data = b""
        if not data:
            self.closed = True
            return
        for event in self.h2.receive_data(data):
            self._on(event)
        await self.flush()

    async def until_closed(self) -> None:
        while not self.closed:
            await self.receive()

    def _on(self, event: Any) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            self.replies[event.stream_id].headers = list(event.headers)
            if event.stream_ended is not None:
                self.replies[event.stream_id].ended = True
        elif isinstance(event, h2.events.TrailersReceived):
            self.replies[event.stream_id].trailers = list(event.headers)
            self.replies[event.stream_id].ended = True
        elif isinstance(event, h2.events.DataReceived):
            self.replies[event.stream_id].data += event.data
            if self._window is None:  # a client that reads as fast as it receives
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if event.stream_ended is not None:
                self.replies[event.stream_id].ended = True
        elif isinstance(event, h2.events.StreamEnded):
            if event.stream_id in self.replies:
                self.replies[event.stream_id].ended = True
        elif isinstance(event, h2.events.StreamReset):
            if event.stream_id in self.replies:
                self.replies[event.stream_id].reset = event.error_code
                self.replies[event.stream_id].ended = True
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            for code, setting in event.changed_settings.items():
                self.settings[int(code)] = setting.new_value


async def next_frame(stream: trio.SocketStream, kind: int | None) -> tuple[int, bytes] | None:
    """Read raw frames until one of ``kind`` (its stream id and payload); None at EOF.
    ``kind`` None reads to the end. The stream must be at a frame boundary."""
    buffer = bytearray()
    while True:
        while len(buffer) >= 9:
            high, low, frame_kind, _, stream_id = struct.unpack(">BHBBL", buffer[:9])
            length = high << 16 | low
            if len(buffer) < 9 + length:
                break
            payload = bytes(buffer[9 : 9 + length])
            del buffer[: 9 + length]
            if frame_kind == kind:
                return stream_id, payload
        data = await stream.receive_some(1 << 20)
        if not data:
            return None
        buffer += data


def messages(data: bytes) -> list[bytes]:
    """The payloads of the length-prefixed messages in ``data``."""
    out = []
    while data:
        _, size = struct.unpack(">BL", data[:5])
        out.append(data[5 : 5 + size])
        data = data[5 + size :]
    return out


ECHO = "/t.T/Echo"
CHAT = "/t.T/Chat"


async def _echo(message: Any, call: Call) -> Any:
    return pb.ModelInferResponse(model_name=message.model_name, id=str(message.ByteSize()))


async def _chat(stream: MessageStream, call: Call) -> None:
    while (message := await stream.recv()) is not None:
        await stream.send(pb.ModelInferResponse(raw_output_contents=message.raw_input_contents))


def small_methods() -> dict[str, Method]:
    """Echo (answers the request's model name and size) and Chat (echoes each message's
    raw contents), for tests of the transport."""
    request = pb.ModelInferRequest
    return {ECHO: UnaryMethod(request, _echo), CHAT: StreamMethod(request, _chat)}


async def send_until_closed(stream: trio.SocketStream, data: bytes) -> None:
    """Send what the server may stop reading half way (it closes after GOAWAY)."""
    with contextlib.suppress(trio.BrokenResourceError):
        await stream.send_all(data)


async def probe(port: int, path: str = ECHO) -> None:
    """One call on a fresh connection, answered OK within 5 s (a server that holds every
    other client while it serves one fails it). ``path``: a method whose request type
    reads a ModelInferRequest (such as ServerLive's, which ignores its fields)."""
    with trio.fail_after(5):
        async with RawClient.connect(port) as client:
            request = pb.ModelInferRequest(model_name="probe").SerializeToString()
            reply = await client.call(path, request)
    assert reply.status == 0


@dataclass(frozen=True)
class H2Tools:
    RawClient: type[RawClient]
    core_server: Callable[..., Any]
    grpc_message: Callable[..., bytes]
    raw_frame: Callable[..., bytes]
    messages: Callable[[bytes], list[bytes]]
    next_frame: Callable[..., Any]
    small_methods: Callable[[], dict[str, Method]]
    probe: Callable[..., Any]
    send_until_closed: Callable[[trio.SocketStream, bytes], Any]


@pytest.fixture
def h2c() -> H2Tools:
    return H2Tools(
        RawClient, core_server, grpc_message, raw_frame, messages, next_frame, small_methods, probe,
        send_until_closed,
    )  # fmt: skip
