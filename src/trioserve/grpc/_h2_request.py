"""A request's header block, read once: is it a gRPC call, to which method, with what
deadline, compression and metadata (RFC 9113 §8.3 and gRPC's HTTP/2 mapping)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from . import _h2_frames as h2
from ._call import Method
from ._errors import GrpcError, GrpcStatus
from ._h2_stream import CallPlan
from ._hpack import ENTRY_OVERHEAD, HeaderList, encode_headers
from ._sized_cache import SizedCache
from ._wire import decompressor, text_metadata, timeout_s, wbits_accepted

# Plain HTTP answers to requests that are not gRPC calls.
HTTP_415 = encode_headers([(b":status", b"415"), (b"content-type", b"text/plain")])
HTTP_405 = encode_headers([(b":status", b"405"), (b"allow", b"POST")])
HTTP_431 = encode_headers([(b":status", b"431")])

_PSEUDO = frozenset({b":method", b":path", b":scheme", b":authority"})
_CONNECTION_SPECIFIC = frozenset({b"connection", b"keep-alive", b"upgrade"})


class Refusal(Exception):
    """The call is answered at once with ``status`` (e.g. an unknown method)."""

    def __init__(self, plan: CallPlan, status: GrpcStatus, message: str) -> None:
        super().__init__(message)
        self.plan = plan
        self.status = status
        self.message = message


class _UnknownMethod:
    """Stands for a path no method serves; such a call is refused UNIMPLEMENTED."""

    request_type = None


_UNKNOWN: Any = _UnknownMethod()


def plan_call(
    stream_id: int, headers: HeaderList, methods: Mapping[str, Method]
) -> CallPlan | bytes | Refusal:
    """The call's plan; a header block to answer with for a request that is not a gRPC
    call; or a ``Refusal``. Raises ``StreamError`` for a malformed request."""
    fields = _request_fields(stream_id, headers)
    if fields.get(b":method") != b"POST":
        return HTTP_405
    if not fields.get(b"content-type", b"").startswith(b"application/grpc"):
        return HTTP_415
    path = fields[b":path"].decode("latin-1")
    metadata = MappingProxyType(text_metadata(headers))
    method = methods.get(path)
    if method is None:
        return Refusal(
            CallPlan(_UNKNOWN, metadata), GrpcStatus.UNIMPLEMENTED, f"unknown method {path}"
        )
    timeout = fields.get(b"grpc-timeout")
    seconds = None if timeout is None else timeout_s(timeout)
    encoding = fields.get(b"grpc-encoding", b"identity")
    if encoding == b"identity":
        return CallPlan(method, metadata, seconds)
    try:
        wbits = decompressor(encoding)
    except GrpcError as exc:
        return Refusal(CallPlan(method, metadata), exc.status, exc.message)
    accepted = wbits_accepted(fields.get(b"grpc-accept-encoding"), encoding)
    return CallPlan(method, metadata, seconds, wbits, accepted)


class CallPlans:
    """A connection's call plans by header block: the decoder hands back the very same
    block object for a repeated block, so a client repeating its headers is planned
    once. Bounded in bytes, as the decoder's cache is."""

    __slots__ = ("_cache", "_methods")

    def __init__(self, methods: Mapping[str, Method], cache_bytes: int) -> None:
        self._methods = methods
        self._cache: SizedCache[int, tuple[HeaderList, CallPlan | bytes | Refusal]] = SizedCache(
            cache_bytes
        )

    @property
    def evictions(self) -> int:
        return self._cache.evictions

    def plan(self, stream_id: int, headers: HeaderList) -> CallPlan | bytes | Refusal:
        entry = self._cache.get(id(headers))
        if entry is not None and entry[0] is headers:
            return entry[1]
        plan = plan_call(stream_id, headers, self._methods)
        size = sum(len(name) + len(value) + ENTRY_OVERHEAD for name, value in headers)
        self._cache.put(id(headers), (headers, plan), size)  # holding it keeps the id unique
        return plan

    def clear(self) -> None:
        self._cache.clear()


def _request_fields(stream_id: int, headers: HeaderList) -> dict[bytes, bytes]:
    """The request's fields by name, checked as RFC 9113 §8.3 asks (malformed: reset)."""
    fields: dict[bytes, bytes] = {}
    regular = False
    for name, value in headers:
        if name.startswith(b":"):
            if regular or name in fields:
                raise h2.StreamError(stream_id, h2.PROTOCOL_ERROR, "misplaced pseudo-header")
            if name not in _PSEUDO:
                raise h2.StreamError(stream_id, h2.PROTOCOL_ERROR, "unknown pseudo-header")
        else:
            regular = True
            if name.lower() != name or name in _CONNECTION_SPECIFIC:
                raise h2.StreamError(stream_id, h2.PROTOCOL_ERROR, "malformed header field")
        fields[name] = value
    if b":method" not in fields or b":path" not in fields or b":scheme" not in fields:
        raise h2.StreamError(stream_id, h2.PROTOCOL_ERROR, "missing pseudo-header")
    return fields
