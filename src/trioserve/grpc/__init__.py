"""The gRPC front ends: Triton's ``inference.GRPCInferenceService`` and the health service.

What the server answers is one method table of plain trio code (``_methods``); a front
end carries it over HTTP/2. ``serve_grpclib`` is grpclib's, hosted in trio through
trio-asyncio.
"""

from ._grpclib import serve_grpclib as serve_grpclib

__all__ = ["serve_grpclib"]
