"""The gRPC front ends: Triton's ``inference.GRPCInferenceService`` and the health service.

What the server answers is one method table of plain trio code (``_methods``); a front
end carries it over HTTP/2. ``serve_grpc_core`` is ours (the default, fastest);
``serve_grpclib`` is grpclib's, hosted in trio through trio-asyncio: an extra, imported
only when chosen (``_alternatives``), on first use of the name.
"""

from typing import TYPE_CHECKING

from ._call import Call as Call
from ._call import MessageStream as MessageStream
from ._call import Method as Method
from ._call import StreamMethod as StreamMethod
from ._call import UnaryMethod as UnaryMethod
from ._core import serve_methods as serve_methods
from ._core import tls_context as tls_context
from ._errors import ClientGone as ClientGone
from ._errors import GrpcError as GrpcError
from ._errors import GrpcStatus as GrpcStatus
from ._errors import parse_message as parse_message
from ._errors import status_of as status_of
from ._h2_guard import CoreStatistics as CoreStatistics
from ._infer_wire import InferPlans as InferPlans
from ._infer_wire import ReplyHeads as ReplyHeads
from ._infer_wire import WireReply as WireReply
from ._infer_wire import WireRequest as WireRequest
from ._memory_channel import GrpcCallError as GrpcCallError
from ._memory_channel import GrpcChannel as GrpcChannel
from ._memory_channel import StreamingCall as StreamingCall
from ._memory_channel import open_memory_channel as open_memory_channel
from ._methods import grpc_methods as grpc_methods
from ._orca import add_load_report as add_load_report
from ._serve import GRPC_COUNTERS as GRPC_COUNTERS
from ._serve import serve_grpc_core as serve_grpc_core
from ._serve import serve_grpc_stream as serve_grpc_stream
from ._serve import with_reflection as with_reflection

if TYPE_CHECKING:
    from ._grpclib import serve_grpclib as serve_grpclib

__all__ = [
    "GRPC_COUNTERS",
    "Call",
    "ClientGone",
    "CoreStatistics",
    "GrpcCallError",
    "GrpcChannel",
    "GrpcError",
    "GrpcStatus",
    "InferPlans",
    "MessageStream",
    "Method",
    "ReplyHeads",
    "StreamMethod",
    "StreamingCall",
    "UnaryMethod",
    "WireReply",
    "WireRequest",
    "add_load_report",
    "grpc_methods",
    "open_memory_channel",
    "parse_message",
    "serve_grpc_core",
    "serve_grpc_stream",
    "serve_grpclib",
    "serve_methods",
    "status_of",
    "tls_context",
    "with_reflection",
]


def __getattr__(name: str) -> object:
    if name == "serve_grpclib":  # imports grpclib and trio-asyncio: only when chosen
        from ._grpclib import serve_grpclib

        return serve_grpclib
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
