"""gRPC over HTTP/2, the parts above framing: message prefixes, compression, timeouts,
metadata and status trailers (the gRPC "PROTOCOL-HTTP2" document).

Everything here is plain functions over bytes, for the HTTP/2 core (``_h2_request``,
``_h2_stream``, ``_h2_streams``, ``_grpc_call``).
"""

from __future__ import annotations

import base64
import re
import struct
import zlib
from collections.abc import Iterable, Mapping

from ._errors import STATUS_OK, GrpcError, GrpcStatus
from ._hpack import encode_headers

MESSAGE_PREFIX = struct.Struct(">BL")  # compressed flag, length
PREFIX_BYTES = 5

# What requests may be compressed with, as the client names it in grpc-encoding.
# zlib's wbits select the container: 31 for gzip, 15 for zlib ("deflate" in gRPC).
_WBITS = {b"gzip": 31, b"deflate": 15}
ACCEPT_ENCODING = b"identity,deflate,gzip"

_TIMEOUT = re.compile(rb"([0-9]{1,8})([HMSmun])")
_TIMEOUT_UNIT_S = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}

# Headers of the HTTP/2 mapping itself, not the call's metadata.
_RESERVED = frozenset(
    {b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding",
     b"user-agent"}
)  # fmt: skip


def timeout_s(value: bytes) -> float | None:
    """The seconds a ``grpc-timeout`` value allows; None if it is malformed (ignored, as
    Triton's front end does)."""
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        return None
    return int(match[1]) * _TIMEOUT_UNIT_S[match[2]]


def text_metadata(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The call's text metadata. Values are taken as Latin-1, which decodes any octet:
    a client's odd byte reaches a handler as a character, never as an exception."""
    return {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in headers
        if not name.startswith(b":") and name not in _RESERVED and not name.endswith(b"-bin")
    }


def decompressor(encoding: bytes) -> int:
    """The zlib wbits for a request's ``grpc-encoding``; UNIMPLEMENTED for others."""
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise GrpcError(
            GrpcStatus.UNIMPLEMENTED,
            f"message compression {encoding.decode('latin-1')!r} is not supported "
            f"(supported: {ACCEPT_ENCODING.decode()})",
        )
    return wbits


def decompress(data: bytes | bytearray | memoryview, wbits: int, limit: int) -> bytes:
    """A compressed message's bytes, refusing to inflate past ``limit`` (a zip bomb
    stops there instead of filling memory)."""
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise GrpcError(GrpcStatus.INTERNAL, f"could not decompress the message: {exc}") from None
    if len(out) > limit:
        raise GrpcError(
            GrpcStatus.RESOURCE_EXHAUSTED,
            f"Received message larger than max (over {limit} bytes when decompressed)",
        )
    if not inflater.eof:
        raise GrpcError(GrpcStatus.INTERNAL, "the compressed message is truncated")
    return out


def compress(data: bytes, wbits: int) -> bytes:
    deflater = zlib.compressobj(6, zlib.DEFLATED, wbits)
    return deflater.compress(data) + deflater.flush()


def wbits_accepted(accept: bytes | None, wanted: bytes) -> int | None:
    """Compress responses the way the request was, if the client accepts that."""
    if accept is None or wanted not in (token.strip() for token in accept.split(b",")):
        return None
    return _WBITS.get(wanted)


def percent_encode(message: str) -> bytes:
    """``grpc-message``: UTF-8 with bytes outside printable ASCII and ``%`` escaped."""
    out = bytearray()
    for byte in message.encode("utf-8", "replace"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def metadata_value(key: str, value: bytes | str) -> bytes:
    """A metadata value as sent: ``-bin`` values base64 (unpadded, as gRPC writes them)."""
    if key.endswith("-bin"):
        raw = value if isinstance(value, bytes) else value.encode()
        return base64.b64encode(raw).rstrip(b"=")
    return value if isinstance(value, bytes) else value.encode("latin-1")


RESPONSE_HEADERS = encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc")])
_ENCODED_RESPONSE_HEADERS = {
    wbits: encode_headers(
        [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-encoding", name)]
    )
    for name, wbits in _WBITS.items()
}
OK_TRAILERS = encode_headers([(b"grpc-status", b"0")])


def response_headers(wbits: int | None) -> bytes:
    return RESPONSE_HEADERS if wbits is None else _ENCODED_RESPONSE_HEADERS[wbits]


def trailers(
    status: GrpcStatus, message: str, metadata: Mapping[str, bytes] | None, *, only: bool
) -> bytes:
    """The trailing header block; ``only``: a trailers-only response (no headers before)."""
    if status == STATUS_OK and not metadata and not only:
        return OK_TRAILERS
    fields: list[tuple[bytes, bytes]] = []
    if only:
        fields += [(b":status", b"200"), (b"content-type", b"application/grpc")]
    fields.append((b"grpc-status", b"%d" % status))
    if message:
        fields.append((b"grpc-message", percent_encode(message)))
    for key, value in (metadata or {}).items():
        fields.append((key.encode("latin-1"), metadata_value(key, value)))
    return encode_headers(fields)
