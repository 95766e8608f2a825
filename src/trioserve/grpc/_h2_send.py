"""The sending half of an HTTP/2 connection's state: the client's flow-control windows
and frame size (from its SETTINGS and WINDOW_UPDATE frames), and response headers and
messages framed within them into what the connection has to send (``Outgoing``).

No I/O: the driver (``_h2_connection``) sends what is queued, and a reply waits
(``_grpc_call.send_reply``) while the client's windows are shut or more than
``max_outbox`` bytes are unsent (the client is not reading), so what one connection
queues stays bounded whatever its calls answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from . import _h2_frames as h2
from ._h2_frames import Part, trim
from ._h2_stream import H2Stream


class Outgoing:
    """Bytes queued to send, as parts (frames, and views of what messages hold)."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.size = 0  # bytes queued and not yet sent

    def queue(self, part: Part) -> None:
        self.parts.append(part)
        self.size += len(part)

    def extend(self, parts: Iterable[Part], size: int) -> None:
        """Queue ``parts``, ``size`` bytes together (the caller knows it already)."""
        self.parts += parts
        self.size += size

    def take(self) -> bytes:
        """All that is queued, joined, and the queue emptied (for a peer in memory)."""
        data = b"".join(self.parts)
        self.parts, self.size = [], 0
        return data


class Sender:
    __slots__ = ("_max_outbox", "_out", "initial_window", "max_frame", "window")

    def __init__(self, out: Outgoing, max_outbox: int) -> None:
        self._out = out
        self._max_outbox = max_outbox
        self.window = h2.DEFAULT_WINDOW  # the connection's send window
        self.initial_window = h2.DEFAULT_WINDOW  # a new stream's, from the client's SETTINGS
        self.max_frame = h2.DEFAULT_MAX_FRAME

    def on_settings(self, payload: bytes, streams: Iterable[H2Stream]) -> bool:
        """The client's SETTINGS (not an ACK); the ACK is queued. True if the streams'
        windows grew."""
        opened = False
        for key, value in h2.parse_settings(payload):
            if key == h2.INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    raise h2.GoawayError(h2.FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self.initial_window
                self.initial_window = value
                for stream in streams:
                    stream.send_window += delta
                    if stream.send_window > h2.MAX_WINDOW:
                        raise h2.GoawayError(h2.FLOW_CONTROL_ERROR, "stream window overflow")
                opened = opened or delta > 0
            elif key == h2.MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= h2.MAX_FRAME_LIMIT:
                    raise h2.GoawayError(h2.PROTOCOL_ERROR, "invalid MAX_FRAME_SIZE")
                self.max_frame = value
            elif key == h2.ENABLE_PUSH and value > 1:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "invalid ENABLE_PUSH")
        self._out.queue(h2.SETTINGS_ACK)
        return opened

    def on_window_update(
        self, stream_id: int, payload: bytes, streams: Mapping[int, H2Stream], last_id: int
    ) -> None:
        if len(payload) != 4:
            raise h2.GoawayError(h2.FRAME_SIZE_ERROR, "WINDOW_UPDATE is not 4 bytes")
        increment = h2.read_u32(payload) & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.window += increment
            if self.window > h2.MAX_WINDOW:
                raise h2.GoawayError(h2.FLOW_CONTROL_ERROR, "connection window overflow")
            return
        stream = streams.get(stream_id)
        if stream is None:
            if stream_id > last_id:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return
        if increment == 0:
            raise h2.StreamError(stream_id, h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        stream.send_window += increment
        if stream.send_window > h2.MAX_WINDOW:
            raise h2.StreamError(stream_id, h2.FLOW_CONTROL_ERROR, "stream window overflow")

    def queue_message(self, stream: H2Stream, parts: list[Part], size: int) -> list[Part]:
        """Queue a message (``parts``, ``size`` bytes, its prefix first) in DATA frames,
        as far as the windows allow and until more than ``max_outbox`` bytes are unsent;
        what is left to send, [] when all of it is queued."""
        out = self._out
        if size <= min(stream.send_window, self.window, self.max_frame):
            # The usual case: one DATA frame the windows allow as it is.
            stream.send_window -= size
            self.window -= size
            out.queue(h2.frame_header(size, h2.DATA, 0, stream.id))
            out.extend(parts, size)
            return []
        while size:
            count = min(size, stream.send_window, self.window, self.max_frame)
            if count <= 0 or out.size > self._max_outbox:
                return parts
            stream.send_window -= count
            self.window -= count
            out.queue(h2.frame_header(count, h2.DATA, 0, stream.id))
            out.extend(_take(parts, count), count)
            parts = trim(parts, count)
            size -= count
        return []

    def queue_headers(self, stream_id: int, block: bytes, flags: int) -> None:
        size = self.max_frame
        out = self._out
        if len(block) <= size:
            out.queue(h2.frame(h2.HEADERS, flags | h2.END_HEADERS, stream_id, block))
            return
        pieces = [block[at : at + size] for at in range(0, len(block), size)]
        out.queue(h2.frame(h2.HEADERS, flags, stream_id, pieces[0]))
        for piece in pieces[1:-1]:
            out.queue(h2.frame(h2.CONTINUATION, 0, stream_id, piece))
        out.queue(h2.frame(h2.CONTINUATION, h2.END_HEADERS, stream_id, pieces[-1]))


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
