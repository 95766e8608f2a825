"""HTTP/2 framing facts (RFC 9113): frame types, flags, error codes, settings, and the
few byte strings the core writes. No state and no I/O: ``_h2_state`` owns the state,
``_h2_connection`` the I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._limits import GrpcLimits

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_BYTES = 9

# Frame types (RFC 9113 §6). Others are extensions: received ones are ignored.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9

# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Error codes (RFC 9113 §7).
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

# Settings identifiers (RFC 9113 §6.5.2).
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_FRAME_LIMIT = 2**24 - 1
MAX_WINDOW = 2**31 - 1

# length (24 bits as 8 + 16), type, flags, stream id (31 bits; the reserved bit masked off)
HEADER = struct.Struct(">BHBBL")
_U32 = struct.Struct(">L")

# What is queued to send: frames, or parts of one (a message's raw tensors are views).
Part = bytes | memoryview
_U32_PAIR = struct.Struct(">LL")
_SETTING = struct.Struct(">HL")


class GoawayError(Exception):
    """The connection must end: GOAWAY with ``code`` (RFC 9113 §5.4.1). ``counter``
    names the ``CoreStatistics`` count a defence keeps of such ends, if any."""

    def __init__(self, code: int, reason: str, counter: str | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.counter = counter


class StreamError(Exception):
    """One stream must end: RST_STREAM with ``code`` (RFC 9113 §5.4.2)."""

    def __init__(self, stream_id: int, code: int, reason: str) -> None:
        super().__init__(reason)
        self.stream_id = stream_id
        self.code = code
        self.reason = reason


def frame_header(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    return HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id)


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return frame_header(len(payload), kind, flags, stream_id) + payload


def settings_frame(settings: Iterable[tuple[int, int]]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(key, value) for key, value in settings))


SETTINGS_ACK = frame(SETTINGS, ACK, 0)


def opening_frames(limits: GrpcLimits) -> bytes:
    """The server's SETTINGS, which announce its limits, and its connection window."""
    settings = settings_frame(
        [
            (ENABLE_PUSH, 0),
            (MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
            (INITIAL_WINDOW_SIZE, limits.stream_window_bytes),
            (MAX_FRAME_SIZE, limits.max_frame_bytes),
            (MAX_HEADER_LIST_SIZE, limits.max_header_list_bytes),
        ]
    )
    extra = limits.connection_window_bytes - DEFAULT_WINDOW
    return settings + window_update(0, extra) if extra > 0 else settings  # 0: no update


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _U32_PAIR.pack(last_stream_id, code) + debug)


def ping_ack(payload: bytes) -> bytes:
    return frame(PING, ACK, 0, payload)


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    """The (identifier, value) pairs of a SETTINGS payload, whose length is checked."""
    if len(payload) % 6:
        raise GoawayError(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6")
    return [_SETTING.unpack_from(payload, at) for at in range(0, len(payload), 6)]


def read_u32(payload: bytes | memoryview, at: int = 0) -> int:
    value: int = _U32.unpack_from(payload, at)[0]
    return value


def trim(parts: list[Part], sent: int) -> list[Part]:
    """What is left of ``parts`` once their first ``sent`` bytes went out."""
    for index, part in enumerate(parts):
        size = len(part)
        if sent < size:
            rest = parts[index:]
            if sent:
                rest[0] = memoryview(part)[sent:]
            return rest
        sent -= size
    return []
