"""``open_grpc_channel``: a test server's gRPC port, in memory (``grpc/_memory_channel``)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from .._server import Server
from ..grpc import GrpcChannel, open_memory_channel


def open_grpc_channel(server: Server) -> AbstractAsyncContextManager[GrpcChannel]:
    """A gRPC channel to ``server`` in memory, for the duration of an ``async with``.

    ``server`` is any running server (``open_test_server`` serves no port, and needs
    none for this): the channel's connection is served by the same HTTP/2 core and
    method table as the gRPC port, with the server's gRPC limits. Real HTTP/2 and gRPC
    framing cross a trio memory stream, so under trio's mock clock a call's deadline and
    a model's declared time come out exact, as ``Server.infer``'s do.
    """
    return open_memory_channel(server._context)
