"""The HTTP/2 core against a raw HTTP/2 client: framing, flow control, limits and abuse.

The core serves a small method table of its own here (echo, hold, chat, spew), so these
tests pin the transport alone; the service tests run the real one over it.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
from typing import Any

import grpc
import h2.errors
import pytest
import trio
import trio.testing
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve._admission import accept_forever
from trioserve._limits import GrpcLimits
from trioserve.grpc import _h2_frames as frames
from trioserve.grpc._core import serve_methods, tls_context
from trioserve.grpc._errors import ClientGone, GrpcError, GrpcStatus
from trioserve.grpc._generated import grpc_service_pb2 as pb
from trioserve.grpc._methods import Call, MessageStream, StreamMethod, UnaryMethod

ECHO = "/t.T/Echo"
HOLD = "/t.T/Hold"
CHAT = "/t.T/Chat"
SPEW = "/t.T/Spew"


class Handlers:
    """The test's method table, with what its handlers saw."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        self.held = 0
        self.cancelled = 0
        self.release = trio.Event()
        self.entered = trio.Event()
        self.spewed = 0

    def methods(self) -> dict[str, Any]:
        request = pb.ModelInferRequest
        return {
            ECHO: UnaryMethod(request, self.echo),
            HOLD: UnaryMethod(request, self.hold),
            CHAT: StreamMethod(request, self.chat),
            SPEW: StreamMethod(request, self.spew),
        }

    async def echo(self, message: Any, call: Call) -> Any:
        self.metadata.append(dict(call.metadata))
        if message.model_name == "fail":
            raise GrpcError(GrpcStatus.FAILED_PRECONDITION, "asked to fail: 100%")
        call.add_trailer("x-trailer-bin", b"\x00\xff")
        return pb.ModelInferResponse(
            model_name=message.model_name, raw_output_contents=message.raw_input_contents
        )

    async def hold(self, message: Any, call: Call) -> Any:
        """Waits for ``release``; gives up when the client cancels (as a model's ticket
        is withdrawn) or its deadline passes."""
        self.held += 1
        self.entered.set()
        gave_up = False

        def give_up() -> None:
            nonlocal gave_up
            gave_up = True
            self.release.set()

        call.cancel_with(give_up)
        try:
            await self.release.wait()
        except trio.Cancelled:
            self.cancelled += 1
            raise
        if gave_up:
            self.cancelled += 1
            raise ClientGone("cancelled")
        return pb.ModelInferResponse(model_name="released")

    async def chat(self, stream: MessageStream, call: Call) -> None:
        while (message := await stream.recv()) is not None:
            await stream.send(pb.ModelInferResponse(model_name=message.model_name))

    async def spew(self, stream: MessageStream, call: Call) -> None:
        chunk = pb.ModelInferResponse(raw_output_contents=[b"x" * 16384])
        while True:
            await stream.send(chunk)
            self.spewed += 1


def infer_request(name: str, *raw: bytes) -> bytes:
    return pb.ModelInferRequest(model_name=name, raw_input_contents=list(raw)).SerializeToString()


def header_block(client: Any, path: str, *extra: tuple[str, str]) -> bytes:
    """A request's header block, for frames written by hand."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "a")]
    block: bytes = client.h2.encoder.encode(
        [*headers, ("content-type", "application/grpc"), *extra]
    )
    return block


def reply_message(h2c: Any, data: bytes) -> Any:
    (payload,) = h2c.messages(data)
    return pb.ModelInferResponse.FromString(payload)


@pytest.fixture
def handlers() -> Handlers:
    return Handlers()


# --- calls ---------------------------------------------------------------------------


async def test_unary_call_metadata_and_trailers(h2c: Any, handlers: Handlers) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        reply = await c.call(ECHO, infer_request("m", b"abc"), [(b"x-key", b"v\xe9")])
        assert reply.status == 0
        assert reply.header(b"content-type") == b"application/grpc"
        assert reply_message(h2c, reply.data).raw_output_contents == [b"abc"]
        assert reply.header(b"x-trailer-bin") == b"AP8"  # base64, unpadded
        # A non-ASCII byte in metadata reaches the handler as a character, no crash.
        assert handlers.metadata[0]["x-key"] == "v\xe9"


async def test_error_is_trailers_only_with_percent_encoded_message(
    h2c: Any, handlers: Handlers
) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        reply = await c.call(ECHO, infer_request("fail"))
        assert reply.trailers == [] and reply.data == b""  # one HEADERS, nothing else
        assert reply.status == GrpcStatus.FAILED_PRECONDITION
        assert reply.header(b"grpc-message") == b"asked to fail: 100%25"


async def test_unknown_method_is_unimplemented(h2c: Any, handlers: Handlers) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        reply = await c.call("/no.Such/Method", b"")
        assert reply.status == GrpcStatus.UNIMPLEMENTED


async def test_malformed_message_is_invalid_argument_without_a_traceback(
    h2c: Any, handlers: Handlers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "trioserve")
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        reply = await c.call(ECHO, b"\xff\xff\xff")
        assert reply.status == GrpcStatus.INVALID_ARGUMENT
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


async def test_not_grpc_is_415_and_get_is_405(h2c: Any, handlers: Handlers) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        headers = [(":method", "POST"), (":scheme", "http"), (":path", ECHO),
                   (":authority", "x"), ("content-type", "application/json")]  # fmt: skip
        sid = c.send_headers(headers, end=True)
        await c.flush()
        assert (await c.until_ended(sid)).header(b":status") == b"415"
        sid = c.send_headers([(":method", "GET"), *headers[1:]], end=True)
        await c.flush()
        assert (await c.until_ended(sid)).header(b":status") == b"405"


async def test_streaming_call_answers_each_message(h2c: Any, handlers: Handlers) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        sid = c.start_call(CHAT)
        for name in ("a", "b", "c"):
            c.send_message(sid, infer_request(name), end=False)
        c.h2.end_stream(sid)
        await c.flush()
        reply = await c.until_ended(sid)
        names = [pb.ModelInferResponse.FromString(m).model_name for m in h2c.messages(reply.data)]
        assert names == ["a", "b", "c"] and reply.status == 0


async def test_grpc_timeout_is_a_deadline(h2c: Any, handlers: Handlers) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        reply = await c.call(HOLD, infer_request("x"), [("grpc-timeout", "50m")])
        assert reply.status == GrpcStatus.DEADLINE_EXCEEDED
        assert handlers.cancelled == 1


async def test_rst_stream_cancels_the_call(h2c: Any, handlers: Handlers) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        sid = c.start_call(HOLD)
        c.send_message(sid, infer_request("x"))
        await c.flush()
        await handlers.entered.wait()
        c.h2.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        await c.flush()
        while not handlers.cancelled:
            await trio.lowlevel.checkpoint()
        reply = await c.call(ECHO, infer_request("after"))  # the connection goes on
        assert reply.status == 0


# --- framing -------------------------------------------------------------------------


async def test_unknown_frame_types_priority_and_padding_are_handled(
    h2c: Any, handlers: Handlers
) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        await c.send_raw(h2c.raw_frame(0xFA, 0xFF, 0, b"whatever"))  # an extension frame
        await c.send_raw(h2c.raw_frame(frames.PRIORITY, 0, 7, b"\x00\x00\x00\x01\x10"))
        sid = c.start_call(ECHO)
        await c.flush()
        body = h2c.grpc_message(infer_request("padded", b"xyz"))
        padded = bytes([4]) + body + b"\x00" * 4
        await c.send_raw(h2c.raw_frame(frames.DATA, frames.PADDED | frames.END_STREAM, sid, padded))
        c.h2._get_stream_by_id(sid).state_machine.process_input(  # keep h2's view in step
            h2.stream.StreamInputs.SEND_END_STREAM
        )
        reply = await c.until_ended(sid)
        assert reply_message(h2c, reply.data).model_name == "padded"


async def test_headers_split_over_continuation(h2c: Any, handlers: Handlers) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        block = header_block(c, ECHO, ("x-long", "y" * 300))
        sid = 1
        await c.send_raw(
            h2c.raw_frame(frames.HEADERS, 0, sid, block[:10])
            + h2c.raw_frame(frames.CONTINUATION, 0, sid, block[10:100])
            + h2c.raw_frame(frames.CONTINUATION, frames.END_HEADERS, sid, block[100:])
            + h2c.raw_frame(frames.DATA, frames.END_STREAM, sid, h2c.grpc_message(b""))
        )
        data = b""
        while b"grpc-status" not in data and len(data) < 10_000:
            data += await c.stream.receive_some(65536)
        assert handlers.metadata == [{"x-long": "y" * 300}]


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ((frames.DATA, 0, 0, b"x"), frames.PROTOCOL_ERROR),
        ((frames.DATA, 0, 99, b"x"), frames.PROTOCOL_ERROR),  # idle stream
        ((frames.HEADERS, frames.END_HEADERS, 2, b""), frames.PROTOCOL_ERROR),  # even id
        ((frames.CONTINUATION, frames.END_HEADERS, 1, b""), frames.PROTOCOL_ERROR),
        ((frames.SETTINGS, 0, 0, b"\x00\x04\x00"), frames.FRAME_SIZE_ERROR),
        ((frames.SETTINGS, 0, 0, b"\x00\x04\xff\xff\xff\xff"), frames.FLOW_CONTROL_ERROR),
        ((frames.SETTINGS, 0, 0, b"\x00\x05\x00\x00\x00\x01"), frames.PROTOCOL_ERROR),
        ((frames.WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x00"), frames.PROTOCOL_ERROR),
        ((frames.WINDOW_UPDATE, 0, 0, b"\x7f\xff\xff\xff"), frames.FLOW_CONTROL_ERROR),
        ((frames.PING, 0, 0, b"short"), frames.FRAME_SIZE_ERROR),
        ((frames.PUSH_PROMISE, frames.END_HEADERS, 1, b"\x00\x00\x00\x02"), frames.PROTOCOL_ERROR),
        ((frames.RST_STREAM, 0, 0, b"\x00\x00\x00\x08"), frames.PROTOCOL_ERROR),
        ((frames.HEADERS, frames.END_HEADERS, 1, b"\xff\xff\xff\xff"), frames.COMPRESSION_ERROR),
    ],
)
async def test_connection_errors_answer_goaway(
    h2c: Any, handlers: Handlers, frame: tuple[int, int, int, bytes], code: int
) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        await c.send_raw(h2c.raw_frame(*frame))
        await c.until_closed()
        assert c.goaway is not None and c.goaway.error_code == code


async def test_bad_preface_and_first_frame_end_the_connection(h2c: Any, handlers: Handlers) -> None:
    async with h2c.core_server(handlers.methods()) as port:
        for opening in (
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            frames.PREFACE + frames.ping_ack(b"12345678"),
        ):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(opening)
                received = b""
                while chunk := await stream.receive_some(65536):
                    received += chunk
                assert struct.pack(">L", frames.PROTOCOL_ERROR) in received


async def test_ping_is_acknowledged(h2c: Any, handlers: Handlers) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        c.h2.ping(b"pingpong")
        await c.flush()
        acks: list[Any] = []
        original = c._on

        def on(event: Any) -> None:
            if isinstance(event, h2.events.PingAckReceived):
                acks.append(event.ping_data)
            original(event)

        c._on = on  # type: ignore[method-assign]
        await c.until(lambda: bool(acks))
        assert acks == [b"pingpong"]


# --- limits and abuse ----------------------------------------------------------------


async def test_message_refused_by_declared_length_before_buffering(
    h2c: Any, handlers: Handlers
) -> None:
    async with (
        h2c.core_server(handlers.methods(), max_message_bytes=1000) as port,
        h2c.RawClient.connect(port) as c,
    ):
        sid = c.start_call(ECHO)
        # Only the prefix of a 4 GiB message: the answer must not wait for its body.
        c.h2.send_data(sid, struct.pack(">BL", 0, 2**32 - 1), end_stream=False)
        await c.flush()
        reply = await c.until_ended(sid)
        assert reply.status == GrpcStatus.RESOURCE_EXHAUSTED
        assert b"4294967295 vs. 1000" in (reply.header(b"grpc-message") or b"")
        assert (await c.call(ECHO, infer_request("ok"))).status == 0


async def test_concurrent_streams_over_the_limit_are_refused(h2c: Any, handlers: Handlers) -> None:
    async with (
        h2c.core_server(handlers.methods(), max_concurrent_streams=4) as port,
        h2c.RawClient.connect(port) as c,
    ):
        await c.until(lambda: frames.MAX_CONCURRENT_STREAMS in c.settings)
        assert c.settings[frames.MAX_CONCURRENT_STREAMS] == 4
        sids = [c.start_call(CHAT) for _ in range(4)]
        await c.flush()
        # A fifth, written by hand: the h2 client itself keeps to the limit.
        block = header_block(c, CHAT)
        await c.send_raw(h2c.raw_frame(frames.HEADERS, frames.END_HEADERS, 9, block))
        refused = await h2c.next_frame(c.stream, frames.RST_STREAM)
        assert refused == (9, struct.pack(">L", frames.REFUSED_STREAM))
        assert all(not c.replies[sid].ended for sid in sids)


async def test_rapid_reset_flood_gets_goaway_and_others_are_served(
    h2c: Any, handlers: Handlers
) -> None:
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as flood:
        block = header_block(flood, CHAT)
        burst = b"".join(
            h2c.raw_frame(frames.HEADERS, frames.END_HEADERS, sid, block)
            + h2c.raw_frame(frames.RST_STREAM, 0, sid, struct.pack(">L", 8))
            for sid in range(1, 2 * 5000, 2)
        )
        # The server may close before it has read all of it (or after: it lets other
        # tasks run, this test's sender among them, while it works through a flood).
        await h2c.send_until_closed(flood.stream, burst + burst)
        await flood.until_closed()
        assert flood.goaway is not None
        assert flood.goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        async with h2c.RawClient.connect(port) as other:
            assert (await other.call(ECHO, infer_request("still here"))).status == 0


async def test_header_block_flood_gets_goaway(h2c: Any, handlers: Handlers) -> None:
    async with (
        h2c.core_server(handlers.methods(), max_header_list_bytes=4096) as port,
        h2c.RawClient.connect(port) as c,
    ):
        frames_ = h2c.raw_frame(frames.HEADERS, 0, 1, b"\x00" * 1000) + b"".join(
            h2c.raw_frame(frames.CONTINUATION, 0, 1, b"\x00" * 1000) for _ in range(20)
        )
        await c.send_raw(frames_)
        await c.until_closed()
        assert c.goaway is not None
        assert c.goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


async def test_streamed_responses_wait_for_a_client_that_does_not_read(
    h2c: Any, handlers: Handlers
) -> None:
    window = 65_535
    async with (
        h2c.core_server(handlers.methods()) as port,
        h2c.RawClient.connect(port, window=window) as c,
    ):
        sid = c.start_call(SPEW)
        c.send_message(sid, infer_request("go"), end=False)
        await c.flush()
        # The server sends until the window the client gave is used up, and no more.
        await c.until(lambda: len(c.replies[sid].data) == window)
        await trio.testing.wait_all_tasks_blocked()
        assert handlers.spewed == window // 16_390  # the next message waits, unsent
        assert len(c.replies[sid].data) == window


async def test_idle_connection_is_closed_with_goaway(h2c: Any, handlers: Handlers) -> None:
    async with (
        h2c.core_server(handlers.methods(), idle_timeout_s=0.2) as port,
        h2c.RawClient.connect(port) as c,
    ):
        assert (await c.call(ECHO, infer_request("x"))).status == 0
        await c.until_closed()
        assert c.goaway is not None and c.goaway.error_code == 0


async def test_flow_control_with_small_client_window_and_16_mib_both_ways(
    h2c: Any, handlers: Handlers
) -> None:
    big = bytes(range(256)) * (16 * 4096)  # 16 MiB
    async with h2c.core_server(handlers.methods()) as port, h2c.RawClient.connect(port) as c:
        sid = c.start_call(ECHO)
        body = h2c.grpc_message(infer_request("big", big))
        sent = 0
        while sent < len(body):  # within the server's windows, as h2 allows
            room = min(c.h2.local_flow_control_window(sid), c.h2.max_outbound_frame_size)
            if room == 0:
                await c.receive()
                continue
            chunk = body[sent : sent + room]
            sent += len(chunk)
            c.h2.send_data(sid, chunk, end_stream=sent == len(body))
            await c.flush()
        reply = await c.until_ended(sid)
        assert reply.status == 0
        assert reply_message(h2c, reply.data).raw_output_contents == [big]


async def test_drain_sends_goaway_finishes_in_flight_and_refuses_new(
    h2c: Any, handlers: Handlers
) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serve = serve_methods
        addresses = await nursery.start(
            lambda task_status: serve(
                handlers.methods(), "127.0.0.1", 0, GrpcLimits(),
                shutdown_trigger=stop.wait, task_status=task_status,
            )
        )  # fmt: skip
        async with h2c.RawClient.connect(addresses[0][1]) as c:
            held = c.start_call(HOLD)
            c.send_message(held, infer_request("x"))
            await c.flush()
            await handlers.entered.wait()
            stop.set()
            # Read by hand from here: the h2 client takes GOAWAY as the end of everything.
            goaway = await h2c.next_frame(c.stream, frames.GOAWAY)
            assert goaway == (0, struct.pack(">LL", held, frames.NO_ERROR))
            fresh = header_block(c, ECHO)
            await c.send_raw(h2c.raw_frame(frames.HEADERS, frames.END_HEADERS, held + 2, fresh))
            refused = await h2c.next_frame(c.stream, frames.RST_STREAM)
            assert refused == (held + 2, struct.pack(">L", frames.REFUSED_STREAM))
            handlers.release.set()
            data = await h2c.next_frame(c.stream, frames.DATA)
            assert reply_message(h2c, data[1]).model_name == "released"
            assert await h2c.next_frame(c.stream, None) is None  # closed once the call ended


async def test_accept_backs_off_when_out_of_descriptors(autojump_clock: Any) -> None:
    class Exhausted(socket.socket):
        failures = 3

        def accept(self) -> Any:
            if Exhausted.failures:
                Exhausted.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return super().accept()

    listener = Exhausted(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    accepted: list[Any] = []
    arrived = trio.Event()

    def on_accept(*connection: Any) -> None:
        accepted.append(connection)
        arrived.set()

    with listener:
        client = socket.create_connection(listener.getsockname())
        with client, trio.move_on_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(accept_forever, listener, on_accept)
                await arrived.wait()
                nursery.cancel_scope.cancel()
    assert Exhausted.failures == 0 and len(accepted) == 1
    accepted[0][0].close()


async def test_tls_with_alpn_h2(handlers: Handlers, tmp_path: Any) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    context = tls_context(str(tmp_path / "server.pem"), str(tmp_path / "server.pem"))
    async with trio.open_nursery() as nursery:
        addresses = await nursery.start(
            lambda task_status: serve_methods(
                handlers.methods(), "127.0.0.1", 0, GrpcLimits(), tls=context,
                task_status=task_status,
            )
        )  # fmt: skip

        def call() -> Any:
            credentials = grpc.ssl_channel_credentials(ca.cert_pem.bytes())
            target = f"localhost:{addresses[0][1]}"
            with grpc.secure_channel(target, credentials) as channel:
                echo = channel.unary_unary(ECHO)
                return pb.ModelInferResponse.FromString(echo(infer_request("tls")))

        assert (await trio.to_thread.run_sync(call)).model_name == "tls"
        nursery.cancel_scope.cancel()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(
        st.tuples(
            st.integers(0, 12), st.integers(0, 255), st.integers(0, 9), st.binary(max_size=40)
        ),
        max_size=12,
    )
)
def test_arbitrary_frames_never_crash_or_hang(frames_: list[tuple[int, int, int, bytes]]) -> None:
    handlers = Handlers()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            serve = serve_methods
            addresses = await nursery.start(
                lambda task_status: serve(
                    handlers.methods(), "127.0.0.1", 0, GrpcLimits(idle_timeout_s=2),
                    task_status=task_status,
                )
            )  # fmt: skip
            port = addresses[0][1]
            with trio.fail_after(5):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    data = frames.PREFACE + frames.settings_frame([])
                    for kind, flags, sid, payload in frames_:
                        length = len(payload)
                        data += struct.pack(">BHBBL", 0, length, kind, flags, sid) + payload
                    await stream.send_all(data)
                    await stream.send_eof()
                    while await stream.receive_some(65536):
                        pass
                # The server still answers a well-formed call afterwards.
                probe = await trio.open_tcp_stream("127.0.0.1", port)
                async with probe:
                    await probe.send_all(frames.PREFACE + frames.settings_frame([]))
                    assert await probe.receive_some(65536)
            nursery.cancel_scope.cancel()

    trio.run(main)
