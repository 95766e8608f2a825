"""Inference requests decoded in the worker: the fast path.

REST infer (JSON and binary tensor data) and gRPC ModelInfer are decoded here, with the
same codecs one process uses; the core receives one INFER frame (names, datatypes,
shapes, parameters, and each tensor's raw bytes: in the frame when small, else written
once into this worker's arena and read in place by the core), runs its pipeline and
answers with the outputs' raw bytes, which are encoded here. The core validates the
request against its model, as it validates every request.

What the core alone can read goes the generic way (``_forward``): requests that name
shared-memory regions (the registry lives in the core) and REST's raw single-input
body (its meaning depends on the model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import trio

from .._errors import ErrorKind, InferenceServerError
from .._limits import OFF_LOOP_BYTES
from .._model import Model
from .._tensor import DATATYPES, array_from_own_raw, array_to_raw
from .._types import InferenceRequest, InferenceResponse, OutputTensor
from ..grpc import Call, ClientGone, InferPlans, ReplyHeads, WireRequest, parse_message
from ..ipc import Pending
from ..metrics import FORMAT_HEADER
from ..rest import (
    Request,
    Response,
    decode_request,
    header_length,
    infer_response,
    small_infer_response,
)
from ._client import WITHDRAWN, Answer, CoreClient
from ._forward import RestForwarder, forward_unary
from ._wire import INFER, INLINE_BYTES, Payload, inline_tensors

_SHARED_MEMORY = b"shared_memory_region"  # any mention sends the request the generic way
_NO_MODEL = cast(Model, None)  # decode_request reads the model only for a raw body
_GRPC_FORMAT = FORMAT_HEADER.decode()
_HTTP_TRACE = (b"traceparent", b"tracestate")  # W3C trace context: HTTP's header names
_GRPC_TRACE = ("traceparent", "tracestate")  # gRPC's metadata keys


class InferForwarder:
    """REST's infer endpoint and gRPC's ModelInfer, decoded in the worker."""

    def __init__(self, client: CoreClient, generic: RestForwarder) -> None:
        self._client = client
        self._generic = generic
        self._plans = InferPlans()
        self._reply_heads = ReplyHeads()

    def body_buffer(self, headers: dict[bytes, bytes], length: int) -> memoryview | None:
        """Where a REST request's body is received (``rest.ReceivesInto``): a large
        binary one into this worker's arena, so that its tensors cross to the core
        without another copy; others into a bytearray (None)."""
        if length < INLINE_BYTES or b"inference-header-content-length" not in headers:
            return None
        return self._client.inputs.buffer(length)

    async def rest(self, request: Request) -> Response | None:
        body = request.body
        length = header_length(request.headers)
        head = body if length is None else body[:length]
        if isinstance(head, memoryview):  # a body received into the arena: no ``in``
            head = bytes(head)
        if length == 0 or _SHARED_MEMORY in head:
            await self._generic(request)  # answers the client itself
            return None
        name, version = request.params["model"], request.params.get("version", "")
        if len(body) >= OFF_LOOP_BYTES:  # a large JSON body takes a while
            inference = await trio.to_thread.run_sync(
                decode_request, body, length, _NO_MODEL, name, version
            )
        else:
            inference = decode_request(body, length, _NO_MODEL, name, version)
        report = request.headers.get(FORMAT_HEADER)
        wanted = None if report is None else ("http", report)
        headers = request.headers
        traced = _trace_context(headers, _HTTP_TRACE) if _HTTP_TRACE[0] in headers else None
        pending = await self._send(inference, "HTTP end point", wanted, traced)
        outcome = _checked(await self._client.answer(pending, request))
        if outcome is None:
            return None  # withdrawn: the client left
        # Binary outputs are sent from the blocks they lie in, given back once written.
        result = self._response(outcome)
        response = small_infer_response(inference, result, outcome[7])
        return response or await infer_response(inference, result, outcome[7])

    async def grpc(self, path: str, data: bytes, call: Call) -> Any:
        wire = parse_message(WireRequest, data)
        if _SHARED_MEMORY in wire.head:
            return await forward_unary(self._client, path, data, call)
        plan = self._plans.plan(wire)
        inference = plan.decode(wire.raw, None)  # type: ignore[arg-type]
        report = call.metadata.get(_GRPC_FORMAT)
        wanted = None if report is None else ("grpc", report)
        metadata = call.metadata
        traced = _trace_context(metadata, _GRPC_TRACE) if _GRPC_TRACE[0] in metadata else None
        pending = await self._send(inference, "ModelInfer RPC", wanted, traced)
        # Once answered, a client that leaves must not release it too (its blocks go back
        # with the reply's arrays).
        outcome = _checked(await self._client.answer(pending, call))
        if outcome is None:
            raise ClientGone("the client cancelled the call")
        # Sent from the blocks its outputs lie in, given back once the HTTP/2 core has
        # written it (its parts, views of them, are what hold them).
        reply = self._reply_heads.encode(self._response(outcome))
        for key, value in outcome[7] or ():
            call.add_trailer(key, value)
        return reply

    async def _send(
        self,
        inference: InferenceRequest,
        endpoint: str,
        report: tuple[str, Any] | None,
        trace_context: dict[Any, Any] | None,
    ) -> Pending[Answer]:
        client = self._client
        tensors = inference.inputs.values()
        inputs = inline_tensors(tensors)
        payloads: list[Payload] = []  # those in blocks are announced with the frame
        if inputs is None:
            payloads = client.pack_inputs([array_to_raw(t.data, t.datatype) for t in tensors])
            inputs = [
                (tensor.name, tensor.datatype.name, tensor.shape, payload, tensor.parameters)
                for tensor, payload in zip(tensors, payloads, strict=True)
            ]
        pending = client.open_pending()
        asked = inference.outputs  # most requests name none: no comprehension's call
        outputs = [(output.name, dict(output.parameters)) for output in asked] if asked else []
        message = (
            INFER, pending.call, endpoint, inference.model_name, inference.model_version, inference.id,
            dict(inference.parameters), inputs, outputs, report, trace_context,
        )  # fmt: skip
        await client.out.send(message, *payloads)
        return pending

    def _response(self, outcome: Answer) -> InferenceResponse:
        """The OUTCOME's response; its outputs' blocks are given back once no array or
        view of them is left (``CoreClient.owned_by``), wherever the response goes."""
        _, _, model, version, request_id, parameters, tensors, _ = outcome
        outputs: list[OutputTensor] = []
        client = self._client
        try:
            for name, type_name, shape, payload, params in tensors:
                dt = DATATYPES[type_name]  # the core's name for it
                if type(payload) is bytes:  # the usual: in the frame, nobody's to give back
                    data = array_from_own_raw(dt, shape, payload)
                else:
                    data = array_from_own_raw(dt, shape, client.take(payload))
                    client.owned_by(data, payload)
                outputs.append(OutputTensor(name, dt, data, params))
        except BaseException:  # a frame the core got wrong: the rest are nobody's
            client.release_payloads([tensor[3] for tensor in tensors[len(outputs) :]])
            raise
        return InferenceResponse(model, version, outputs, request_id, parameters)


def _trace_context(headers: Mapping[Any, Any], names: tuple[Any, ...]) -> dict[Any, Any]:
    """A client's W3C trace context among its headers (``names``: HTTP's or gRPC's), for
    the core's tracing. Asked only of a request with a ``traceparent`` (the first name):
    a ``tracestate`` alone is ignored, as the core's tracing would ignore it, and the
    usual request makes no call for it."""
    return {name: headers[name] for name in names if name in headers}


def _checked(item: Answer) -> Answer | None:
    """An INFER's answer as an OUTCOME; None if the call was withdrawn meanwhile (a
    function, not a coroutine around the wait: a frame less to resume per request)."""
    if item is WITHDRAWN:
        return None
    error = item[1]
    if error is not None:
        raise _rebuilt(*error)
    return item


def _rebuilt(kind: str, message: str) -> InferenceServerError:
    """The core's error as the worker raises it: same kind (hence status), same message."""
    error = InferenceServerError(message)
    error.kind = ErrorKind[kind]
    return error
