"""Sans-IO half of the HTTP/1.1 server: request heads, chunked bodies, response heads.

Nothing here does I/O or imports trio, so every strictness rule can be read (and tested) in
one place. Parsing works on ``bytes`` with ``find``/``split`` and validates character classes
with ``bytes.translate(None, delete=...)``: deleting every allowed byte leaves ``b""`` exactly
when the input was valid, which is a single C-level pass and no regex.
"""

from __future__ import annotations

from collections.abc import Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import TypeAlias
from urllib.parse import unquote

from .._limits import HttpLimits
from ._errors import HttpError, error_body

_TCHAR = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_VCHAR = bytes(range(0x21, 0x7F))
# What a field value may hold (RFC 9110 5.5): VCHAR, SP, HTAB and obs-text.
_FIELD_CHARS = b"\t " + _VCHAR + bytes(range(0x80, 0x100))
_HEX = b"0123456789abcdefABCDEF"
_DIGITS = b"0123456789"

# Names the parser acts on; one set lookup per header instead of a chain of comparisons.
_CONTENT_LENGTH = b"content-length"
_TRANSFER_ENCODING = b"transfer-encoding"
_CONNECTION = b"connection"
_EXPECT = b"expect"
_FRAMING = frozenset((_CONTENT_LENGTH, _TRANSFER_ENCODING, _CONNECTION, _EXPECT))

# Common methods map to interned str without a decode per request.
_METHODS = {m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH")}

_MAX_CHUNK_SIZE_LINE = 1024  # hex size plus extensions; anything longer is abuse


# method, http_version, path, raw_path, query_string, headers, content_length, chunked,
# keep_alive, expect_continue. A plain tuple: one is built per request, and a tuple is
# several times cheaper to build than an object with as many attributes.
RequestHead: TypeAlias = tuple[
    str, str, str, bytes, bytes, list[tuple[bytes, bytes]], int, bool, bool, bool
]


def check_partial_head(head: bytes | bytearray, checked: int, limits: HttpLimits) -> None:
    """Reject an incomplete head that can no longer become valid.

    ``head[:checked]`` passed this check before; only the rest is scanned for bare LFs, so a
    head that arrives in many pieces is checked in linear time.
    """
    eol = head.find(b"\r\n")
    line_end = len(head) if eol < 0 else eol
    if line_end > limits.max_request_line_bytes:
        raise HttpError(414, "request line too long")
    if eol >= 0 and len(head) - eol - 2 > limits.max_header_bytes:
        raise HttpError(431, "request header section too large")
    # Bare LF is rejected rather than accepted as a line end (consistently with parse_head);
    # failing here answers at once instead of waiting for a CRLFCRLF that never comes.
    # An LF at index >= checked pairs with a CR at index >= checked - 1.
    if head.count(b"\n", checked) != head.count(b"\r\n", max(checked - 1, 0)):
        raise HttpError(400, "bare LF in request head")


# Clients repeat the same request lines and header lines over and over (Host, User-Agent,
# Accept, Content-Type, the inference path...). Each distinct line is validated and split
# once and then found by one dict lookup; a cached line is byte-identical to one that passed
# every check. Bounded: cleared when full, and long lines are never kept.
_CACHE_ENTRIES = 1024
_CACHE_LINE_BYTES = 256
_request_lines: dict[bytes, tuple[str, str, str, bytes, bytes]] = {}
_field_lines: dict[bytes, tuple[bytes, bytes]] = {}
# Content-Length lines with a single plain value, and that value (bodies of one size recur).
_length_lines: dict[bytes, tuple[tuple[bytes, bytes], int]] = {}
_REQUEST_LINE_CHARS = b" " + _VCHAR


def parse_head(buf: bytes, pos: int, end: int, limits: HttpLimits) -> RequestHead:
    """Parse the head in ``buf[pos:end]`` (``end`` is where ``b"\\r\\n\\r\\n"`` starts)."""
    lines = buf[pos:end].split(b"\r\n")
    request_line = lines[0]
    if len(request_line) > limits.max_request_line_bytes:
        raise HttpError(414, "request line too long")
    if len(lines) > limits.max_header_count + 1:
        raise HttpError(431, "too many header fields")
    if end - pos - len(request_line) > limits.max_header_bytes:
        raise HttpError(431, "request header section too large")
    parsed = _request_lines.get(request_line)
    if parsed is None:
        parsed = _parse_request_line(request_line)
    method, http_version, path, raw_path, query_string = parsed

    headers: list[tuple[bytes, bytes]] = []
    content_length = -1
    transfer_codings: list[bytes] | None = None
    close = False
    keep_alive_asked = False
    expect_continue = False
    for line in lines[1:]:
        field = _field_lines.get(line)
        if field is not None:
            headers.append(field)
            continue
        known_length = _length_lines.get(line)
        if known_length is not None:
            field, length = known_length
            headers.append(field)
            content_length = _merge_length(length, content_length, limits)
            continue
        field = _parse_field(line)
        headers.append(field)
        name, value = field
        if name not in _FRAMING:
            if len(line) <= _CACHE_LINE_BYTES:
                if len(_field_lines) >= _CACHE_ENTRIES:
                    _field_lines.clear()
                _field_lines[line] = field
        elif name == _CONTENT_LENGTH:
            content_length = _content_length(value, content_length, limits)
            if value.isdigit() and len(line) <= _CACHE_LINE_BYTES:
                if len(_length_lines) >= _CACHE_ENTRIES:
                    _length_lines.clear()
                _length_lines[line] = (field, int(value))
        elif name == _TRANSFER_ENCODING:
            transfer_codings = (transfer_codings or []) + _tokens(value)
        elif name == _CONNECTION:
            for token in _tokens(value):
                if token == b"close":
                    close = True
                elif token == b"keep-alive":
                    keep_alive_asked = True
        elif value.lower() == b"100-continue" and http_version == "1.1":
            expect_continue = True

    chunked = False
    if transfer_codings:
        if http_version == "1.0":
            # RFC 9112 6.1: framing of a 1.0 message with Transfer-Encoding is faulty.
            raise HttpError(400, "Transfer-Encoding in an HTTP/1.0 request")
        if content_length >= 0:
            raise HttpError(400, "both Content-Length and Transfer-Encoding")
        for coding in transfer_codings:
            if coding != b"chunked":
                raise HttpError(501, "unsupported transfer-coding")
        if len(transfer_codings) > 1:
            raise HttpError(400, "chunked applied more than once")
        chunked = True
    # HTTP/1.1 persists unless told to close; 1.0 only when the client asked for it.
    keep_alive = not close and (http_version == "1.1" or keep_alive_asked)
    return (
        method,
        http_version,
        path,
        raw_path,
        query_string,
        headers,
        content_length if content_length > 0 else 0,
        chunked,
        keep_alive,
        expect_continue,
    )


def _parse_request_line(line: bytes) -> tuple[str, str, str, bytes, bytes]:
    """``method SP request-target SP HTTP-version``, strictly (RFC 9112 3)."""
    if line.translate(None, _REQUEST_LINE_CHARS):
        raise HttpError(400, "invalid character in request line")
    parts = line.split(b" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    raw_method, target, version = parts
    if version == b"HTTP/1.1":
        http_version = "1.1"
    elif version == b"HTTP/1.0":
        http_version = "1.0"
    elif (
        len(version) == 8
        and version.startswith(b"HTTP/")
        and version[5:6].isdigit()
        and version[6:7] == b"."
        and version[7:8].isdigit()
    ):
        raise HttpError(505, "HTTP version not supported")
    else:
        raise HttpError(400, "malformed HTTP version")
    if not raw_method or raw_method.translate(None, _TCHAR):
        raise HttpError(400, "invalid method")
    if not target:
        raise HttpError(400, "invalid request target")
    method = _METHODS.get(raw_method) or raw_method.decode("ascii").upper()
    parsed = (method, http_version, *split_target(target))
    if len(line) <= _CACHE_LINE_BYTES:
        if len(_request_lines) >= _CACHE_ENTRIES:
            _request_lines.clear()
        _request_lines[line] = parsed
    return parsed


def _parse_field(line: bytes) -> tuple[bytes, bytes]:
    """``name ":" OWS value OWS`` with the name lowercased (RFC 9112 5)."""
    if line.translate(None, _FIELD_CHARS):
        raise HttpError(400, "invalid character in header field")
    colon = line.find(b":")
    if line[:1] in (b" ", b"\t"):
        raise HttpError(400, "obsolete line folding in header")
    if colon <= 0:
        raise HttpError(400, "malformed header line")
    name = line[:colon]
    if name.translate(None, _TCHAR):
        if name[-1:] in (b" ", b"\t"):
            raise HttpError(400, "whitespace before colon in header")
        raise HttpError(400, "invalid header name")
    return name.lower(), line[colon + 1 :].strip(b" \t")


def _tokens(value: bytes) -> list[bytes]:
    return [t for t in (part.strip(b" \t").lower() for part in value.split(b",")) if t]


def _content_length(value: bytes, previous: int, limits: HttpLimits) -> int:
    """Merge one Content-Length field into ``previous`` (-1: none yet)."""
    # Identical duplicates (as separate fields or a comma list) are allowed by RFC 9110 8.6;
    # anything that disagrees is a framing attack and is refused.
    length = previous
    for part in value.split(b",") if b"," in value else (value,):
        digits = part.strip(b" \t")
        if not digits or digits.translate(None, _DIGITS):
            raise HttpError(400, "invalid Content-Length")
        # More than 18 significant digits is above any sane limit; skip the huge int.
        n = int(digits) if len(digits.lstrip(b"0")) <= 18 else limits.max_body_bytes + 1
        length = _merge_length(n, length, limits)
    return length


def _merge_length(length: int, previous: int, limits: HttpLimits) -> int:
    if previous >= 0 and length != previous:
        raise HttpError(400, "conflicting Content-Length values")
    if length > limits.max_body_bytes:
        raise HttpError(413, "request body too large")
    return length


def split_target(target: bytes) -> tuple[str, bytes, bytes]:
    """``(path, raw_path, query_string)`` of an origin-, absolute- or asterisk-form target."""
    if target[:1] != b"/":
        if target == b"*":
            return "*", b"*", b""
        scheme_end = target.find(b"://")
        if scheme_end <= 0 or target[:scheme_end].lower() not in (b"http", b"https"):
            raise HttpError(400, "invalid request target")
        rest = target[scheme_end + 3 :]
        cut = len(rest)
        for sep in (b"/", b"?"):
            i = rest.find(sep)
            if 0 <= i < cut:
                cut = i
        target = rest[cut:]
        if target[:1] != b"/":
            target = b"/" + target
    raw_path, _, query_string = target.partition(b"?")
    path = raw_path.decode("ascii")  # ASCII is guaranteed by the VCHAR check
    if "%" in path:
        path = unquote(path)
    return path, raw_path, query_string


class ChunkedDecoder:
    """Incremental decoder for a chunked request body; trailer fields are read and dropped."""

    __slots__ = ("_limits", "_remaining", "_state", "_total", "_trailer_bytes", "done")

    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)

    def __init__(self, limits: HttpLimits) -> None:
        self._limits = limits
        self._state = self._SIZE
        self._remaining = 0
        self._total = 0
        self._trailer_bytes = 0
        self.done = False

    def decode(self, buf: bytes, pos: int) -> tuple[bytes, int]:
        """Decode from ``buf[pos:]``; return the body bytes found and the new position.

        Stops at the end of ``buf`` or of the body (``done``), whichever comes first.
        """
        out: list[bytes] = []
        end = len(buf)
        while pos < end and not self.done:
            state = self._state
            if state == self._DATA:
                take = min(self._remaining, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = self._DATA_END
            elif state == self._SIZE:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > _MAX_CHUNK_SIZE_LINE:
                        raise HttpError(400, "chunk size line too long")
                    if b"\n" in buf[pos:]:
                        raise HttpError(400, "bare LF in chunk size line")
                    break
                if eol - pos > _MAX_CHUNK_SIZE_LINE:
                    raise HttpError(400, "chunk size line too long")
                size = self._chunk_size(buf[pos:eol])
                pos = eol + 2
                if size == 0:
                    self._state = self._TRAILER
                else:
                    self._total += size
                    if self._total > self._limits.max_body_bytes:
                        raise HttpError(413, "request body too large")
                    self._remaining = size
                    self._state = self._DATA
            elif state == self._DATA_END:
                if end - pos < 2:
                    if buf[pos:] != b"\r":
                        raise HttpError(400, "missing CRLF after chunk data")
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise HttpError(400, "missing CRLF after chunk data")
                pos += 2
                self._state = self._SIZE
            else:
                after = self._trailer(buf, pos)
                if after == pos:
                    break  # incomplete trailer line
                pos = after
        return b"".join(out) if len(out) != 1 else out[0], pos

    @staticmethod
    def _chunk_size(line: bytes) -> int:
        size, _, extensions = line.partition(b";")
        size = size.rstrip(b" \t")  # BWS before an extension
        # int(x, 16) alone would accept "0x", "_" and surrounding spaces; check the digits.
        if not size or len(size) > 16 or size.translate(None, _HEX):
            raise HttpError(400, "invalid chunk size")
        if extensions.translate(None, _FIELD_CHARS):
            raise HttpError(400, "invalid chunk extension")
        return int(size, 16)

    def _trailer(self, buf: bytes, pos: int) -> int:
        eol = buf.find(b"\r\n", pos)
        pending = (len(buf) if eol < 0 else eol) - pos
        if self._trailer_bytes + pending > self._limits.max_header_bytes:
            raise HttpError(431, "chunked trailer section too large")
        if eol < 0:
            if b"\n" in buf[pos:]:
                raise HttpError(400, "bare LF in chunked trailer")
            return pos  # wait for the rest of the line
        if eol == pos:
            self.done = True
            return pos + 2
        line = buf[pos:eol]
        colon = line.find(b":")
        if colon <= 0 or line[:colon].translate(None, _TCHAR):
            raise HttpError(400, "malformed trailer field")
        if line.translate(None, _FIELD_CHARS):
            raise HttpError(400, "invalid character in trailer field")
        self._trailer_bytes += eol - pos + 2
        return eol + 2


# ---------------------------------------------------------------------------- responses

STATUS_LINES = {
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode("ascii")) for s in HTTPStatus
}


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    if line is None:
        if not isinstance(status, int) or not 100 <= status <= 999:
            raise ValueError(f"invalid HTTP status {status!r}")
        line = b"HTTP/1.1 %d \r\n" % status  # the reason phrase may be empty
    return line


def date_line() -> bytes:
    """The ``date`` header line for now; the server keeps one and refreshes it every tick."""
    return b"date: %s\r\n" % formatdate(usegmt=True).encode("ascii")


def scan_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bytes, int, bool, bool]:
    """The app's ``http.response.start`` headers as ``(block, content_length, close, has_date)``.

    ``block`` holds the header lines to send (transfer-encoding and connection removed: the
    server frames the body and says itself whether the connection stays open);
    ``content_length`` is -1 when the app gave none; ``close`` is whether it asked to close.
    """
    parts: list[bytes] = []
    content_length = -1
    close = False
    has_date = False
    for name, value in headers:
        lname = name.lower()
        if lname in _RESPONSE_SPECIAL:
            if lname == _CONTENT_LENGTH:
                if not value or bytes(value).translate(None, _DIGITS):
                    raise ValueError(f"invalid content-length {value!r} from application")
                content_length = int(value)
            elif lname == _TRANSFER_ENCODING:
                continue
            elif lname == _CONNECTION:
                close = close or b"close" in _tokens(value)
                continue
            else:
                has_date = True
        parts += (name, b": ", value, b"\r\n")
    block = b"".join(parts)
    # One count over the block instead of per-value scans: any CR or LF beyond the line
    # ends added here would let the application (or its input) inject header lines.
    lines = len(parts) >> 2
    if block.count(b"\n") != lines or block.count(b"\r") != lines:
        raise ValueError("CR or LF in a response header from the application")
    return block, content_length, close, has_date


_RESPONSE_SPECIAL = frozenset((_CONTENT_LENGTH, _TRANSFER_ENCODING, _CONNECTION, b"date"))


CLOSE = b"connection: close\r\n"


def error_response(status: int, message: str, connection: bytes) -> bytes:
    """A complete JSON error response; ``connection`` is a header line or ``b""``."""
    body = error_body(message)
    return b"".join(
        (
            status_line(status),
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
            date_line(),
            connection,
            b"\r\n",
            body,
        )
    )
