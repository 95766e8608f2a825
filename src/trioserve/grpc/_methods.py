"""Every method the gRPC front ends answer, as plain trio code, keyed by HTTP/2 path.

``inference.GRPCInferenceService`` and ``grpc.health.v1.Health/Check``. A front end
(``_grpclib``, or the HTTP/2 core) parses each request message with its method's
``request_type``, calls the handler with a ``Call`` (the metadata in, trailers out), and
answers with the reply or, when the handler raises, the status ``_errors.status_of``
gives. Handlers raise ``InferenceServerError`` (the core's table decides the status) or
``GrpcError``; they never see the transport.

ModelInfer and ModelStreamInfer's tensor requests run through the server's
``InferencePipeline``, as REST infer does; a call whose metadata asks for a load report
(``endpoint-load-metrics-format``) gets it in its trailers (``_orca``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from google.protobuf.message import Message

from .._context import ServerContext
from .._errors import unknown_model
from .._limits import OFF_LOOP_BYTES
from .._served import Ticket
from ._call import Call, MessageStream, Method, StreamMethod, UnaryMethod
from ._codec import (
    model_config_message,
    model_metadata_message,
    server_metadata_message,
    statistics_message,
)
from ._errors import ClientGone
from ._generated import grpc_service_pb2 as pb
from ._generated import health_pb2
from ._infer_wire import InferPlans, ReplyHeads, WireRequest
from ._orca import add_load_report
from ._repository_rpcs import REPOSITORY_RPCS
from ._shm import SHARED_MEMORY_RPCS, check_restriction
from ._stream import StreamInfer
from ._trace_rpcs import log_settings, trace_setting

__all__ = [
    "Call",
    "ClientGone",
    "MessageStream",
    "Method",
    "StreamMethod",
    "UnaryMethod",
    "grpc_methods",
]  # fmt: skip


class _CallWatch:
    """A waiting ticket withdrawn when its gRPC client cancels (``_pipeline.Watch``)."""

    def track(self, ticket: Ticket, call: Call) -> None:
        call.cancel_with(ticket.withdraw)

    def untrack(self, ticket: Ticket, token: None) -> None:
        pass  # the call is over either way


_CALL_WATCH = _CallWatch()


_SERVICE = "/inference.GRPCInferenceService/"
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# Service names a health check may ask about that mean "the server as a whole".
_SERVER_SERVICES = frozenset({"", "inference.GRPCInferenceService"})


def grpc_methods(context: ServerContext) -> dict[str, Method]:
    """Every method this server answers, keyed by its HTTP/2 path, e.g.
    ``/inference.GRPCInferenceService/ModelInfer``, ``/grpc.health.v1.Health/Check``."""
    service = _InferenceService(context)
    unary = {
        "ServerLive": UnaryMethod(pb.ServerLiveRequest, service.server_live),
        "ServerReady": UnaryMethod(pb.ServerReadyRequest, service.server_ready),
        "ModelReady": UnaryMethod(pb.ModelReadyRequest, service.model_ready),
        "ServerMetadata": UnaryMethod(pb.ServerMetadataRequest, service.server_metadata),
        "ModelMetadata": UnaryMethod(pb.ModelMetadataRequest, service.model_metadata),
        "ModelConfig": UnaryMethod(pb.ModelConfigRequest, service.model_config),
        "ModelInfer": UnaryMethod(WireRequest, service.model_infer),
        "ModelStatistics": UnaryMethod(pb.ModelStatisticsRequest, service.model_statistics),
    }
    for rpc in SHARED_MEMORY_RPCS:
        unary[rpc] = UnaryMethod(getattr(pb, f"{rpc}Request"), partial(service.shared_memory, rpc))
    for rpc in REPOSITORY_RPCS:
        unary[rpc] = UnaryMethod(
            getattr(pb, f"{rpc}Request"), partial(service.model_repository, rpc)
        )
    unary["TraceSetting"] = UnaryMethod(pb.TraceSettingRequest, service.trace_setting)
    unary["LogSettings"] = UnaryMethod(pb.LogSettingsRequest, service.log_settings)
    methods: dict[str, Method] = {_SERVICE + rpc: method for rpc, method in unary.items()}
    stream = StreamInfer(context)
    methods[_SERVICE + "ModelStreamInfer"] = StreamMethod(WireRequest, stream.serve)
    methods[_HEALTH_CHECK] = UnaryMethod(health_pb2.HealthCheckRequest, service.health_check)
    return methods


class _InferenceService:
    """The unary handlers over one server's context."""

    def __init__(self, context: ServerContext) -> None:
        self._repository = context.repository
        self._pipeline = context.pipeline
        self._load = context.load
        self._shared_memory = context.shared_memory
        restrictions = context.config.grpc_restricted_apis
        self._shared_memory_restriction = restrictions.get("shared-memory")
        self._repository_restriction = restrictions.get("model-repository")
        self._trace_restriction = restrictions.get("trace")
        self._logging_restriction = restrictions.get("logging")
        self._tracing = context.tracing
        self._logs = context.logs
        self._server_metadata = server_metadata_message(context.metadata)  # never changes
        self._infer_plans = InferPlans()  # ModelInfer's request heads, decoded once
        self._reply_heads = ReplyHeads()

    async def server_live(self, request: pb.ServerLiveRequest, call: Call) -> Message:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: pb.ServerReadyRequest, call: Call) -> Message:
        return pb.ServerReadyResponse(ready=self._repository.ready())

    async def model_ready(self, request: pb.ModelReadyRequest, call: Call) -> Message:
        # An unknown model is not ready, not an error (what Triton answers).
        return pb.ModelReadyResponse(
            ready=self._repository.model_ready(request.name, request.version)
        )

    async def server_metadata(self, request: pb.ServerMetadataRequest, call: Call) -> Message:
        return self._server_metadata

    async def model_metadata(self, request: pb.ModelMetadataRequest, call: Call) -> Message:
        served = self._repository.get(request.name, request.version)
        return model_metadata_message(served.model, self._repository.versions(request.name))

    async def model_config(self, request: pb.ModelConfigRequest, call: Call) -> Message:
        served = self._repository.get(request.name, request.version)
        return model_config_message(served.model)

    async def model_statistics(self, request: pb.ModelStatisticsRequest, call: Call) -> Message:
        return statistics_message(self._repository.statistics(request.name, request.version))

    async def model_infer(self, request: WireRequest, call: Call) -> Any:
        plan = self._infer_plans.plan(request)
        served = self._repository.get(plan.model_name, plan.model_version)
        decode = partial(plan.decode, request.raw)
        large = len(request.head) >= OFF_LOOP_BYTES  # raw inputs are views: no decoding
        answered = await self._pipeline.infer(
            served, decode, _CALL_WATCH, call,
            endpoint="ModelInfer RPC", large=large, headers=call.metadata,
        )  # fmt: skip
        if answered is None:
            raise ClientGone("the client cancelled the call")
        _, response = answered
        reply = self._reply_heads.encode(response)
        add_load_report(call, self._load, served)
        return reply

    async def shared_memory(self, rpc: str, request: Any, call: Call) -> Message:
        check_restriction(self._shared_memory_restriction, call.metadata)
        return await SHARED_MEMORY_RPCS[rpc](self._shared_memory, request)

    async def model_repository(self, rpc: str, request: Any, call: Call) -> Message:
        check_restriction(self._repository_restriction, call.metadata)
        return await REPOSITORY_RPCS[rpc](self._repository, request)

    async def trace_setting(self, request: pb.TraceSettingRequest, call: Call) -> Message:
        check_restriction(self._trace_restriction, call.metadata)
        return trace_setting(self._tracing, self._repository, request)

    async def log_settings(self, request: pb.LogSettingsRequest, call: Call) -> Message:
        check_restriction(self._logging_restriction, call.metadata)
        return log_settings(self._logs, request)

    async def health_check(self, request: health_pb2.HealthCheckRequest, call: Call) -> Message:
        """SERVING when what was asked about is ready: "" or "inference.GRPCInferenceService"
        asks about the whole server, a model name about that model (its latest version).
        An unknown name answers NOT_FOUND, as the health protocol specifies."""
        service = request.service
        if service in _SERVER_SERVICES:
            ready = self._repository.ready()
        elif service in self._repository.names():
            ready = self._repository.model_ready(service)
        else:
            raise unknown_model(service)
        status = health_pb2.HealthCheckResponse
        return status(status=status.SERVING if ready else status.NOT_SERVING)
