"""Limits on what one HTTP request may cost the server, shared by both HTTP servers."""

from __future__ import annotations

from dataclasses import dataclass


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
