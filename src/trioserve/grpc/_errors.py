"""gRPC statuses, and the one table from error kinds to them.

Triton's gRPC front end names its statuses after the same kinds, 1:1 (INTEROP.md,
Errors). Every front end turns a handler's failure into a status with ``status_of`` and
nowhere else, so the transports cannot drift apart on what a failure means. Handlers
raise ``InferenceServerError`` for what the core decides, ``GrpcError`` for transport
matters (a message over the size limit); anything else is a bug of ours.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from google.protobuf.message import DecodeError

from .._errors import ErrorKind, InferenceServerError

logger = logging.getLogger("trioserve.grpc")


class GrpcStatus(enum.IntEnum):
    """The status codes of gRPC (``grpc-status``)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


# Every call ends with it: a plain name, since Python 3.11 answers ``GrpcStatus.OK``
# through the enum metaclass's ``__getattr__`` (hundreds of instructions).
STATUS_OK = GrpcStatus.OK


GRPC_STATUS: dict[ErrorKind, GrpcStatus] = {
    ErrorKind.NOT_FOUND: GrpcStatus.NOT_FOUND,
    ErrorKind.INVALID_ARG: GrpcStatus.INVALID_ARGUMENT,
    ErrorKind.UNAVAILABLE: GrpcStatus.UNAVAILABLE,
    ErrorKind.UNSUPPORTED: GrpcStatus.UNIMPLEMENTED,
    ErrorKind.ALREADY_EXISTS: GrpcStatus.ALREADY_EXISTS,
    ErrorKind.CANCELLED: GrpcStatus.CANCELLED,
    ErrorKind.INTERNAL: GrpcStatus.INTERNAL,
    ErrorKind.UNKNOWN: GrpcStatus.UNKNOWN,
}


class GrpcError(Exception):
    """A call ends with ``status`` for a reason of the transport, not of the core: e.g. a
    message over the size limit, which gRPC itself (grpcio, grpc-go) answers with
    RESOURCE_EXHAUSTED and clients expect."""

    def __init__(self, status: GrpcStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ClientGone(Exception):
    """The client reset the stream or the connection: nothing can be sent any more."""


def status_of(exc: BaseException) -> tuple[GrpcStatus, str]:
    """The status and message that answer a call ended by ``exc``.

    A client's mistake is logged at DEBUG without a traceback (one client must not be
    able to flood the log); anything but ``InferenceServerError`` and ``GrpcError`` is a
    bug of ours, logged with its traceback and answered INTERNAL.
    """
    if isinstance(exc, InferenceServerError):
        status, message = GRPC_STATUS[exc.kind], exc.message
    elif isinstance(exc, GrpcError):
        status, message = exc.status, exc.message
    else:
        logger.error("a gRPC call failed unexpectedly", exc_info=exc)
        return GrpcStatus.INTERNAL, "the call failed unexpectedly"
    logger.debug("gRPC call answered %s: %s", status.name, message)
    return status, message


def parse_message(message_type: Any, data: bytes | bytearray | memoryview) -> Any:
    """A request message from its bytes; INVALID_ARGUMENT (a client mistake, not logged
    as an error) when they are not one. Both gRPC front ends parse through here."""
    try:
        return message_type.FromString(data)
    except DecodeError as exc:
        raise GrpcError(GrpcStatus.INVALID_ARGUMENT, f"malformed request message: {exc}") from None
