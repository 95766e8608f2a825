"""The gRPC front ends: Triton's ``inference.GRPCInferenceService`` and the health service.

What the server answers is one method table of plain trio code (``_methods``); a front
end carries it over HTTP/2. ``serve_grpc_core`` is ours (the default, fastest);
``serve_grpclib`` is grpclib's, hosted in trio through trio-asyncio: an extra, imported
only when chosen (``_alternatives``), on first use of the name.
"""

from typing import TYPE_CHECKING

from ._memory_channel import GrpcCallError as GrpcCallError
from ._memory_channel import GrpcChannel as GrpcChannel
from ._memory_channel import StreamingCall as StreamingCall
from ._memory_channel import open_memory_channel as open_memory_channel
from ._serve import serve_grpc_core as serve_grpc_core
from ._serve import serve_grpc_stream as serve_grpc_stream

if TYPE_CHECKING:
    from ._grpclib import serve_grpclib as serve_grpclib

__all__ = [
    "GrpcCallError",
    "GrpcChannel",
    "StreamingCall",
    "open_memory_channel",
    "serve_grpc_core",
    "serve_grpc_stream",
    "serve_grpclib",
]


def __getattr__(name: str) -> object:
    if name == "serve_grpclib":  # imports grpclib and trio-asyncio: only when chosen
        from ._grpclib import serve_grpclib

        return serve_grpclib
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
