"""The gRPC front end: Triton's ``inference.GRPCInferenceService`` on grpclib, hosted in trio."""

from ._bridge import serve_grpc as serve_grpc

__all__ = ["serve_grpc"]
