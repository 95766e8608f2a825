"""The sending half of an HTTP/2 connection: the client's flow-control windows and
frame size (from its SETTINGS and WINDOW_UPDATE frames), and response headers and
messages written within them into the connection's ``Outbox``.

A reply waits while the client's windows are shut, and while the outbox holds more than
``max_outbox`` unsent bytes (the client is not reading), so what one connection queues
stays bounded whatever its calls answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import trio
from google.protobuf.message import Message

from . import _h2_frames as h2
from ._call import Reply, UnaryMethod
from ._errors import ClientGone, GrpcError, GrpcStatus
from ._h2_outbox import Outbox, Part
from ._h2_stream import H2Stream
from ._h2_transport import trim
from ._wire import MESSAGE_PREFIX, compress, response_headers


class Sender:
    __slots__ = (
        "_max_message",
        "_max_outbox",
        "_outbox",
        "_window_opened",
        "initial_window",
        "max_frame",
        "window",
    )

    def __init__(self, outbox: Outbox, max_message: int, max_outbox: int) -> None:
        self._outbox = outbox
        self._max_message = max_message
        self._max_outbox = max_outbox
        self.window = h2.DEFAULT_WINDOW  # the connection's send window
        self.initial_window = h2.DEFAULT_WINDOW  # a new stream's, from the client's SETTINGS
        self.max_frame = h2.DEFAULT_MAX_FRAME
        self._window_opened = trio.Event()

    def on_settings(self, payload: bytes, streams: Iterable[H2Stream]) -> None:
        """The client's SETTINGS (not an ACK); the ACK is queued."""
        for key, value in h2.parse_settings(payload):
            if key == h2.INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    raise h2.ConnectionError_(h2.FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self.initial_window
                self.initial_window = value
                for stream in streams:
                    stream.send_window += delta
                self.open_window()
            elif key == h2.MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= h2.MAX_FRAME_LIMIT:
                    raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "invalid MAX_FRAME_SIZE")
                self.max_frame = value
            elif key == h2.ENABLE_PUSH and value > 1:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "invalid ENABLE_PUSH")
        self._outbox.queue(h2.SETTINGS_ACK)

    def on_window_update(
        self, stream_id: int, payload: bytes, streams: Mapping[int, H2Stream], last_id: int
    ) -> None:
        if len(payload) != 4:
            raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "WINDOW_UPDATE is not 4 bytes")
        increment = h2.read_u32(payload) & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.window += increment
            if self.window > h2.MAX_WINDOW:
                raise h2.ConnectionError_(h2.FLOW_CONTROL_ERROR, "connection window overflow")
        else:
            stream = streams.get(stream_id)
            if stream is None:
                if stream_id > last_id:
                    raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
                return
            if increment == 0:
                raise h2.StreamError(stream_id, h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            stream.send_window += increment
            if stream.send_window > h2.MAX_WINDOW:
                raise h2.StreamError(stream_id, h2.FLOW_CONTROL_ERROR, "stream window overflow")
        self.open_window()

    def open_window(self) -> None:
        """Wake the replies waiting on a window (it opened, or their stream is gone)."""
        self._window_opened.set()
        self._window_opened = trio.Event()

    async def send_reply(self, stream: H2Stream, reply: Reply) -> None:
        """One response message, in DATA frames the client's windows allow. A reply in
        parts (``_call.ReplyInParts``) is written part by part, never joined."""
        parts: list[Part] = (
            [reply.SerializeToString()] if isinstance(reply, Message) else reply.parts
        )
        size = sum(map(len, parts))
        limit = self._max_message
        if size > limit:
            raise GrpcError(
                GrpcStatus.RESOURCE_EXHAUSTED, f"Sent message larger than max ({size} vs. {limit})"
            )
        flag = 0
        if stream.wbits_out is not None:
            parts, flag = [compress(b"".join(parts), stream.wbits_out)], 1
            size = len(parts[0])
        outbox = self._outbox
        if outbox.size > self._max_outbox:  # the client is not reading: wait until it does
            await self._drain(stream)
        if not stream.headers_sent:
            stream.headers_sent = True
            self.queue_headers(stream.id, response_headers(stream.wbits_out), 0)
        prefix = MESSAGE_PREFIX.pack(flag, size)
        remaining = 5 + size
        if remaining <= min(stream.send_window, self.window, self.max_frame):
            # The usual case: one DATA frame the windows allow as it is.
            stream.send_window -= remaining
            self.window -= remaining
            frame = (h2.frame_header(remaining, h2.DATA, 0, stream.id), prefix, *parts)
            outbox.extend(frame, h2.FRAME_HEADER_BYTES + remaining)
            remaining = 0
        parts = [prefix, *parts]
        while remaining:
            if stream.reset:
                raise ClientGone("the client reset the stream")
            count = min(remaining, stream.send_window, self.window, self.max_frame)
            if count <= 0:
                outbox.flush()
                await self._window_opened.wait()
                continue
            stream.send_window -= count
            self.window -= count
            outbox.queue(h2.frame_header(count, h2.DATA, 0, stream.id))
            for part in _take(parts, count):
                outbox.queue(part)
            parts = trim(parts, count)
            remaining -= count
            if outbox.size > self._max_outbox:
                await self._drain(stream)
        if not isinstance(stream.method, UnaryMethod):
            outbox.flush()  # a streamed message goes now; a unary one with its trailers

    async def _drain(self, stream: H2Stream) -> None:
        self._outbox.flush()
        await self._outbox.drain()
        if stream.reset:
            raise ClientGone("the connection is gone")

    def queue_headers(self, stream_id: int, block: bytes, flags: int) -> None:
        size = self.max_frame
        outbox = self._outbox
        if len(block) <= size:
            outbox.queue(h2.frame(h2.HEADERS, flags | h2.END_HEADERS, stream_id, block))
            return
        pieces = [block[at : at + size] for at in range(0, len(block), size)]
        outbox.queue(h2.frame(h2.HEADERS, flags, stream_id, pieces[0]))
        for piece in pieces[1:-1]:
            outbox.queue(h2.frame(h2.CONTINUATION, 0, stream_id, piece))
        outbox.queue(h2.frame(h2.CONTINUATION, h2.END_HEADERS, stream_id, pieces[-1]))


def _take(parts: list[Part], count: int) -> list[Part]:
    """The first ``count`` bytes of ``parts``, as views (no copy)."""
    taken: list[Part] = []
    for part in parts:
        if count <= 0:
            break
        if len(part) <= count:
            taken.append(part)
            count -= len(part)
        else:
            taken.append(memoryview(part)[:count])
            count = 0
    return taken
