"""The one table from error kinds to HTTP status codes, and the error body."""

from __future__ import annotations

import json

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


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def error_status(error: InferenceServerError) -> int:
    return HTTP_STATUS[error.kind]
