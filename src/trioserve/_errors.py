"""The one exception tree of the serving core.

Every failure that can reach a client is an ``InferenceServerError`` carrying a neutral
``ErrorKind``. The core never speaks HTTP or gRPC: each transport owns exactly one table
that maps a kind to its status (``rest/_errors.py``, ``grpc/_errors.py``).

    InferenceServerError            (kind=UNKNOWN)
    ├── NotFoundError               unknown model, version, route or region
    ├── InvalidArgumentError        anything malformed a client sent
    ├── UnavailableError            not ready, queue full, timed out in queue
    ├── UnsupportedError            a feature this server or model does not offer
    ├── AlreadyExistsError          e.g. a shared-memory region name in use
    ├── CancelledError              the request was cancelled before it finished
    └── InternalError               the model or the server failed
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """What went wrong, independent of the transport that reports it."""

    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    UNKNOWN = "UNKNOWN"


class InferenceServerError(Exception):
    """Base of every error a client can see; ``message`` is what the client reads."""

    kind: ErrorKind = ErrorKind.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFoundError(InferenceServerError):
    kind = ErrorKind.NOT_FOUND


class InvalidArgumentError(InferenceServerError):
    kind = ErrorKind.INVALID_ARG


class UnavailableError(InferenceServerError):
    kind = ErrorKind.UNAVAILABLE


class UnsupportedError(InferenceServerError):
    kind = ErrorKind.UNSUPPORTED


class AlreadyExistsError(InferenceServerError):
    kind = ErrorKind.ALREADY_EXISTS


class CancelledError(InferenceServerError):
    kind = ErrorKind.CANCELLED


class InternalError(InferenceServerError):
    kind = ErrorKind.INTERNAL


def unknown_model(name: str) -> NotFoundError:
    """The error Triton's clients expect, word for word, for a model it does not serve."""
    return NotFoundError(f"Request for unknown model: '{name}' is not found")
