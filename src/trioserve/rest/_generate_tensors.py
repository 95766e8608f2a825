"""Triton's generate extension for a model that is not generative (a Python-backend
model, an ONNX model, an ensemble): the request's keys name the model's tensors.

Request (both endpoints)::

    {"id"?: str, "parameters"?: {...}, <input name>: value, <other key>: value, ...}

As in Triton, a key (at the top level or in ``parameters``; one given in both places is
an error) that names one of the model's inputs is that input: a JSON scalar is a tensor
of one element (shape ``[1]``), a (nested) list a tensor of its shape, with a batch
dimension of 1 in front when the model batches, and the datatype the model declares.
Every other key is a request parameter. So a Triton user's LLM model (``text_input``
in, ``text_output`` out, an optional ``stream`` input, sampling settings read from the
request's parameters) answers ``{"text_input": "...", "parameters": {"stream": false,
"temperature": 0}}``.

Each answer is ``{"id"?, "model_name", "model_version", <output name>: value, ...}``: an
output of one element as a JSON scalar (BYTES as text), a larger one as the flat list of
its elements, as an inference answer's ``data`` carries them.

``generate`` answers a model's one response; a decoupled model that sends more than one
is refused after the fact (``generate_stream`` streams them). ``generate_stream`` sends
each response as a ``data:`` event (one for a model that is not decoupled); an error
before the first is an ordinary JSON error response, a later one an ``{"error": ...}``
event under the 200 already sent.
"""

from __future__ import annotations

from typing import Any

from .._context import ServerContext
from .._errors import InferenceServerError, InvalidArgumentError, UnsupportedError
from .._pipeline import Decode
from .._served import Answer, ServedModel
from .._tensor import array_from_json, array_to_json
from .._types import InferenceRequest, InferenceResponse, InputTensor
from ..metrics import LoadReporter
from ..shm import RequestRegions
from ._app import Request, Response
from ._generate_events import (
    json_answer,
    send_event,
    stream_end,
    stream_start,
    unless_client_leaves,
)
from ._json_body import json_object

_PARAMETER_TYPES = (str, int, float, bool)


class TensorGenerate:
    """``generate`` and ``generate_stream`` on a model's own inputs and outputs."""

    def __init__(self, context: ServerContext) -> None:
        self.pipeline = context.pipeline
        self.load = context.load  # the answers' load reports

    async def generate(self, request: Request, served: ServedModel) -> Response | None:
        decode, head = _decoder(request, served)

        async def work() -> dict[str, Any]:
            if served.model.decoupled:
                return await self._only_answer(served, decode, head, request)
            _, response = await self.pipeline.infer(
                served, decode, endpoint="generate", headers=request.headers
            )
            return _answer(head, response)

        answered, document = await unless_client_leaves(request.cancel_with, work)
        return json_answer(self.load, served, request, document) if answered else None

    async def _only_answer(
        self, served: ServedModel, decode: Decode, head: dict[str, Any], request: Request
    ) -> dict[str, Any]:
        """A decoupled model's one response, or the error that says why there is none."""
        responses: list[InferenceResponse] = []
        failure: list[InferenceServerError] = []

        async def deliver(answer: Answer, final: bool) -> None:
            if isinstance(answer, InferenceServerError):
                failure.append(answer)
            elif answer is not None:
                responses.append(answer)

        await self.pipeline.infer_decoupled(served, decode, deliver, headers=request.headers)
        if failure:
            raise failure[0]
        if len(responses) != 1:
            raise UnsupportedError(
                f"model '{served.model.name}' sent {len(responses)} responses; generate "
                "answers with one (generate_stream streams them)"
            )
        return _answer(head, responses[0])

    async def generate_stream(self, request: Request, served: ServedModel) -> Response | None:
        decode, head = _decoder(request, served)
        events = _Events(request, self.load, served, head)

        async def work() -> None:
            if served.model.decoupled:
                await self.pipeline.infer_decoupled(
                    served, decode, events.deliver, headers=request.headers
                )
                return
            _, response = await self.pipeline.infer(
                served, decode, endpoint="generate_stream", headers=request.headers
            )
            await events.deliver(response, True)

        answered, _ = await unless_client_leaves(request.cancel_with, work)
        if not answered:
            return None
        if events.early_error is not None:  # before any event: an ordinary error answer
            raise events.early_error
        await events.end()
        return None


class _Events:
    """One ``generate_stream`` answer: the stream starts with the first response."""

    def __init__(
        self, request: Request, load: LoadReporter, served: ServedModel, head: dict[str, Any]
    ) -> None:
        self._request = request
        self._load = load
        self._served = served
        self._head = head
        self._started = False
        self.early_error: InferenceServerError | None = None  # the first answer, final

    async def deliver(self, answer: Answer, final: bool) -> None:
        if answer is None:  # a final flag sent alone
            return
        if not self._started:
            if isinstance(answer, InferenceServerError) and final:
                self.early_error = answer
                return
            await self._start()
        try:
            if isinstance(answer, InferenceServerError):
                raise answer
            document = _answer(self._head, answer)
        except InferenceServerError as exc:  # the model's, or an output JSON cannot carry
            document = {"error": exc.message}
        await send_event(self._request.send, document)

    async def _start(self) -> None:
        self._started = True
        await self._request.send(stream_start(self._load, self._served, self._request))

    async def end(self) -> None:
        if not self._started:  # no response at all: an empty stream
            await self._start()
        await self._request.send(stream_end())


def _decoder(request: Request, served: ServedModel) -> tuple[Decode, dict[str, Any]]:
    """The request's decode (as the pipeline calls it) and the keys every answer starts
    with; a malformed request is refused here, before anything runs."""
    document = json_object(request.body)
    model = served.model
    specs = {spec.name: spec for spec in model.inputs}
    batch = (1,) if model.max_batch_size > 0 else ()
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgumentError("request 'parameters' must be a JSON object")
    top_level = {key: value for key, value in document.items() if key not in ("id", "parameters")}
    if both := sorted(top_level.keys() & parameters.keys()):
        raise InvalidArgumentError(f"{both} given both at the top level and in 'parameters'")
    inputs: dict[str, InputTensor] = {}
    given: dict[str, Any] = {}
    for key, value in {**parameters, **top_level}.items():
        spec = specs.get(key)
        if spec is not None:
            shape = (*batch, *(_json_shape(value) or (1,)))
            data = array_from_json(spec.wire_datatype, shape, value, f"input '{key}'")
            inputs[key] = InputTensor(key, spec.wire_datatype, shape, data)
        elif isinstance(value, _PARAMETER_TYPES):
            given[key] = value
        else:
            raise InvalidArgumentError(f"parameter '{key}' must be a string, a number or a boolean")
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgumentError("request 'id' must be a string")
    head: dict[str, Any] = {"id": request_id} if "id" in document else {}
    head["model_name"] = model.name
    head["model_version"] = served.version
    version = request.params.get("version", "")

    def decode(regions: RequestRegions) -> InferenceRequest:
        return InferenceRequest(model.name, version, inputs, [], request_id, given)

    return decode, head


def _json_shape(value: Any) -> tuple[int, ...]:
    """The shape of a JSON value: () for a scalar, a (nested) list's lengths (checked
    for being rectangular when the tensor is read)."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        value = value[0] if value else None
    return tuple(shape)


def _answer(head: dict[str, Any], response: InferenceResponse) -> dict[str, Any]:
    document = dict(head)
    for tensor in response.outputs:
        values = array_to_json(tensor.data, tensor.datatype, f"output '{tensor.name}'")
        document[tensor.name] = values[0] if len(values) == 1 else values
    return document
