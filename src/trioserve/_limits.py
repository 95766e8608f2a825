"""Limits on what one request or connection may cost the server, per transport."""

from __future__ import annotations

from dataclasses import dataclass

OFF_LOOP_BYTES = 256 * 1024
"""Messages (and REST responses) at least this large are decoded (encoded) in a worker
thread: about 5 ms of JSON, past which the work would hold up every other client."""

MAX_SHARED_MEMORY_REGIONS = 256
"""Shared-memory regions registered at once, by default (``--max-shared-memory-regions``)."""


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on request size and connection timing.

    The status given with each field is what the built-in HTTP/1.1 server answers when the
    bound is passed; ``_hypercorn.py`` documents which of them hypercorn can honour.
    """

    max_request_line_bytes: int = 8192
    """A longer request line is answered 414."""
    max_header_count: int = 100
    """More header fields are answered 431."""
    max_header_bytes: int = 64 * 1024
    """All header lines of a request head together; larger is answered 431."""
    max_body_bytes: int = 256 * 1024 * 1024
    """A larger Content-Length, or a chunked body whose running total passes it, gets 413."""
    header_timeout_s: float = 30.0
    """Time to receive a complete request head once its first byte arrived; then 408 + close."""
    idle_timeout_s: float = 75.0
    """A keep-alive connection with no request in progress is closed after this."""
    max_connections: int = 4096
    """Connections open at once; one more is answered 503 and closed at once (the
    process's descriptor limit, often 1,024 by default, may bind first: raise it with
    ``ulimit -n``)."""
    body_timeout_s: float = 60.0
    """Time to receive a whole request body once the server waits for it, however steadily
    it trickles in; then 408 + close."""


@dataclass(frozen=True)
class GrpcLimits:
    """Bounds on what one gRPC connection may cost the server, honoured by the built-in
    HTTP/2 core (grpclib offers none of these knobs but ``max_message_bytes``)."""

    max_message_bytes: int = 2**31 - 1
    """The largest message either way, for both gRPC front ends (tritonclient's own
    limit: INT32_MAX); a larger request is RESOURCE_EXHAUSTED."""

    max_concurrent_streams: int = 256
    """Calls open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS); more are
    refused with REFUSED_STREAM."""
    max_header_list_bytes: int = 64 * 1024
    """A call's metadata, as HTTP/2 counts it; larger is answered 431."""
    idle_timeout_s: float = 300.0
    """A connection with no call open is closed (GOAWAY) after this."""
    stream_window_bytes: int = 16 * 1024 * 1024
    """Receive window per call: how much a client may send ahead."""
    connection_window_bytes: int = 64 * 1024 * 1024
    """Receive window of a connection, across its calls."""
    max_frame_bytes: int = 1024 * 1024
    """The largest HTTP/2 frame a client may send (SETTINGS_MAX_FRAME_SIZE)."""
    max_connections: int = HttpLimits.max_connections
    """Connections open at once; one more is closed as soon as it is accepted, and
    counted in ``trioserve_grpc_refused_connections``."""
    idle_close_share: float = 0.75
    """Past this share of ``max_connections`` open, each new connection closes the
    connection idle the longest (GOAWAY), so that idle clients cannot lock out new ones."""
    max_reset_burst: int = 1000
    """Streams a connection may see reset in a burst: reset by the client, refused, or
    reset by the server for the client's error. Past it: GOAWAY(ENHANCE_YOUR_CALM)."""
    resets_per_s: float = 200.0
    """How fast that burst allowance refills."""
    max_continuation_frames: int = 32
    """CONTINUATION frames in one header block, empty ones included; more:
    GOAWAY(ENHANCE_YOUR_CALM)."""
    hpack_cache_bytes: int = 256 * 1024
    """Decoded header blocks (and their call plans) a connection remembers, in bytes."""
    max_outbox_bytes: int = 4 * 1024 * 1024
    """Bytes a connection has queued that the client has not taken off the socket;
    past it the connection stops reading until they are sent."""
    max_pending_bytes: int = 64 * 1024 * 1024
    """Per connection: request messages received and not yet taken by their calls, plus
    replies waiting for the client's flow-control window. Past it, streaming calls take
    no new request and the connection's receive window is not reopened."""

    def __post_init__(self) -> None:
        if not 0 < self.idle_close_share <= 1:
            raise ValueError("idle_close_share must be above 0 and at most 1")
        # HTTP/2's own ranges (RFC 9113 6.5.2, 6.9): a connection window can only be
        # opened past the protocol's initial 65,535 bytes, never shut below it.
        for name, low, high in (
            ("max_frame_bytes", 16_384, 2**24 - 1),
            ("stream_window_bytes", 1, 2**31 - 1),
            ("connection_window_bytes", 65_535, 2**31 - 1),
            ("max_header_list_bytes", 1, 2**32 - 1),
        ):
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be between {low:,} and {high:,}")
        for name in ("max_message_bytes", "max_reset_burst", "resets_per_s", "max_continuation_frames",
                     "hpack_cache_bytes", "max_outbox_bytes", "max_pending_bytes"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
