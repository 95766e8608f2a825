"""HTTP's errors: the one table from the core's error kinds to status codes, the one
transport error type, and the one JSON error body.

Two trees, kept apart: ``InferenceServerError`` (``_errors.py``) is what the core
decides, and its ``kind`` picks the status through ``HTTP_STATUS``; ``HttpError`` is
what only HTTP knows of (a method the path does not take, a body over the limit, a
malformed request line) and carries its status itself. Neither subclasses the other,
so no handler depends on the order of its ``except`` clauses.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .._errors import ErrorKind, InferenceServerError

HTTP_STATUS: dict[ErrorKind, int] = {
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.INVALID_ARG: 400,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.UNSUPPORTED: 501,
    ErrorKind.ALREADY_EXISTS: 400,
    ErrorKind.CANCELLED: 400,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UNKNOWN: 400,
}


class HttpError(Exception):
    """A request the HTTP layer answers itself: ``status``, ``{"error": message}`` and
    ``headers`` (e.g. 405's ``allow``)."""

    def __init__(
        self, status: int, message: str, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = tuple(headers)


def method_not_allowed(allow: Sequence[str]) -> HttpError:
    """405: the path exists, but not for this method; ``allow`` lists those it takes."""
    return HttpError(405, "Method Not Allowed", [(b"allow", ", ".join(allow).encode())])


def body_too_large(limit: int) -> HttpError:
    """413: the body (or what it inflates to) is over ``limit`` bytes."""
    return HttpError(413, f"request body exceeds the limit of {limit} bytes")


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def error_status(error: InferenceServerError) -> int:
    return HTTP_STATUS[error.kind]
