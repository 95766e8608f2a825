"""Inference on a running server from the same trio program, with no sockets.

``Server.infer`` and ``Server.generate`` are a front end like REST and gRPC, only
without a wire: inputs arrive as numpy arrays, the request runs through the server's
``InferencePipeline`` (validation, queueing and batching, statistics, metrics, load
counting) or its engine, and the answer comes back as numpy arrays or text. Nothing
here reads a clock or moves bytes, so under ``trio.testing.MockClock`` every time a
request spends is the scheduler's own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import numpy as np

from ._context import ServerContext
from ._errors import InvalidArgumentError
from ._tensor import datatype_of
from ._types import InferenceRequest, InferenceResponse, InputTensor, RequestedOutput
from .scheduler import generative, read_parameters
from .shm import RequestRegions


class InProcessFrontEnd:
    """What ``Server.infer`` and ``Server.generate`` run on: the server's context."""

    def __init__(self, context: ServerContext) -> None:
        self._context = context

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
        outputs: Sequence[str] | None = None,
        request_id: str = "",
    ) -> InferenceResponse:
        context = self._context
        version_name = "" if version is None else str(version)
        served = context.repository.get(model, version_name)
        request = InferenceRequest(
            model_name=model,
            model_version=version_name,
            inputs=_input_tensors(inputs),
            outputs=[RequestedOutput(name) for name in outputs or ()],
            id=request_id,
            parameters=dict(parameters or {}),
        )

        def decode(regions: RequestRegions) -> InferenceRequest:
            return request  # numpy in hand: no shared memory to lease

        _, response = await context.pipeline.infer(served, decode, endpoint="Server.infer")
        return response

    async def generate(
        self, model: str, prompt: str, *, version: str | int | None = None, **sampling: Any
    ) -> AsyncIterator[str]:
        """The text pieces of one sample, as the engine produces them."""
        context = self._context
        served = generative(context.repository.get(model, "" if version is None else str(version)))
        if sampling.get("n", 1) != 1:
            raise InvalidArgumentError("generate streams one sample: n must be 1")
        parameters = read_parameters(sampling, "vllm", max_num_seqs=served.max_num_seqs)
        pipeline = context.pipeline
        request = pipeline.generation_request("inprocess", served, prompt, parameters, {})
        async with pipeline.generate(served, request) as chunks:
            async for chunk in chunks:
                # An empty chunk only means that a multi-byte character is pending.
                if chunk.text:
                    yield chunk.text


def _input_tensors(inputs: Mapping[str, Any]) -> dict[str, InputTensor]:
    """Each input as the wire would deliver it: its datatype read from the array, BYTES
    elements as ``bytes`` in an object array."""
    tensors = {}
    for name, value in inputs.items():
        if not isinstance(name, str):
            raise InvalidArgumentError("input names must be strings")
        array = np.asarray(value)
        dt = datatype_of(array)
        if dt.is_bytes:
            array = _bytes_elements(array)
        tensors[name] = InputTensor(name, dt, tuple(array.shape), array)
    return tensors


def _bytes_elements(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    elements = np.empty(array.shape, dtype=object)
    for index, item in np.ndenumerate(array):
        if isinstance(item, str):
            elements[index] = item.encode()
        elif isinstance(item, bytes | bytearray | memoryview):
            elements[index] = bytes(item)
        else:
            raise InvalidArgumentError(
                f"BYTES elements must be str or bytes, not {type(item).__name__}"
            )
    return elements
