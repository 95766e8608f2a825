"""The one table from error kinds to gRPC status codes.

Triton's gRPC front end names its statuses after the same kinds, 1:1 (INTEROP.md,
Errors). Every handler turns an ``InferenceServerError`` into a ``GRPCError`` here and
nowhere else, so the two transports cannot drift apart on what a failure means.
"""

from __future__ import annotations

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from .._errors import ErrorKind, InferenceServerError

GRPC_STATUS: dict[ErrorKind, Status] = {
    ErrorKind.NOT_FOUND: Status.NOT_FOUND,
    ErrorKind.INVALID_ARG: Status.INVALID_ARGUMENT,
    ErrorKind.UNAVAILABLE: Status.UNAVAILABLE,
    ErrorKind.UNSUPPORTED: Status.UNIMPLEMENTED,
    ErrorKind.ALREADY_EXISTS: Status.ALREADY_EXISTS,
    ErrorKind.CANCELLED: Status.CANCELLED,
    ErrorKind.INTERNAL: Status.INTERNAL,
    ErrorKind.UNKNOWN: Status.UNKNOWN,
}

# Not a kind of the core: a message over the size limit is a transport matter, and gRPC
# itself (grpcio, grpc-go) answers it with RESOURCE_EXHAUSTED, which clients expect.
MESSAGE_TOO_LARGE = Status.RESOURCE_EXHAUSTED


def grpc_error(error: InferenceServerError) -> GRPCError:
    """The ``GRPCError`` a handler raises to answer ``error``; the message is unchanged."""
    return GRPCError(GRPC_STATUS[error.kind], error.message)
