"""The gRPC front ends: Triton's ``inference.GRPCInferenceService`` and the health service.

What the server answers is one method table of plain trio code (``_methods``); a front
end carries it over HTTP/2. ``serve_grpc_core`` is ours (the default, fastest);
``_grpclib.serve_grpclib`` is grpclib's, hosted in trio through trio-asyncio: an extra,
imported only when chosen (``_alternatives``).
"""

from ._serve import serve_grpc_core as serve_grpc_core
from ._serve import serve_grpc_stream as serve_grpc_stream

__all__ = ["serve_grpc_core", "serve_grpc_stream"]
