"""What a front end decoded, made into a ``GenerationRequest``.

REST's generate endpoints read a prompt and a parameter object from JSON; gRPC's
ModelStreamInfer reads them from tensors and typed parameters. Both end here, so a bad
prompt or parameter gets the same answer on either transport; the parameters are the
table's business (``_sampling_params``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from typing import Any

from .._errors import InvalidArgumentError
from .._types import InputTensor
from ._generation import GenerationRequest
from ._sampling_params import RequestParameters

TEXT_INPUT = "text_input"
# Inputs the vLLM backend of Triton takes besides the prompt: a JSON object of sampling
# parameters, and whether to stream (the RPC decides that here, so it is read and dropped).
SAMPLING_PARAMETERS_INPUT = "sampling_parameters"
STREAM_INPUT = "stream"


class RequestIds:
    """A server's ids for the requests its engines run: one counter for every front end
    and every generative model, so no two generations share an id (clients' ids may
    repeat, and are never the engine's)."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count = itertools.count(1)

    def next(self, origin: str) -> str:
        """A new id; ``origin`` names who asked (the front end), for logs and traces."""
        return f"{origin}-{next(self._count)}"


def generation_request(
    request_id: str, prompt: object, parameters: RequestParameters, arrival_time: float
) -> GenerationRequest:
    """The request for ``prompt`` with its checked ``parameters``."""
    if not isinstance(prompt, str):
        raise InvalidArgumentError(f"'{TEXT_INPUT}' must be a string")
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        sampling=parameters.sampling,
        arrival_time=arrival_time,
        priority=parameters.priority,
    )


def prompt_and_parameters(
    inputs: Mapping[str, InputTensor], parameters: Mapping[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The prompt of a tensor request (one-element BYTES ``text_input``) and its sampling
    parameters: the request's, with those of a ``sampling_parameters`` input on top."""
    unknown = inputs.keys() - {TEXT_INPUT, SAMPLING_PARAMETERS_INPUT, STREAM_INPUT}
    if unknown:
        raise InvalidArgumentError(
            f"unexpected inputs {sorted(unknown)}; a generative model takes '{TEXT_INPUT}' "
            f"and optionally '{SAMPLING_PARAMETERS_INPUT}' and '{STREAM_INPUT}'"
        )
    if TEXT_INPUT not in inputs:
        raise InvalidArgumentError(f"input '{TEXT_INPUT}' is required")
    merged = dict(parameters)
    if SAMPLING_PARAMETERS_INPUT in inputs:
        document = _one_string(inputs[SAMPLING_PARAMETERS_INPUT])
        try:
            extra = json.loads(document)
        except ValueError as exc:
            raise InvalidArgumentError(
                f"input '{SAMPLING_PARAMETERS_INPUT}' is not valid JSON: {exc}"
            ) from None
        if not isinstance(extra, dict):
            raise InvalidArgumentError(f"input '{SAMPLING_PARAMETERS_INPUT}' must be a JSON object")
        merged.update(extra)
    return _one_string(inputs[TEXT_INPUT]), merged


def _one_string(tensor: InputTensor) -> str:
    if not tensor.datatype.is_bytes or tensor.data.size != 1:
        raise InvalidArgumentError(f"input '{tensor.name}' must be BYTES with one element")
    value = tensor.data.reshape(-1)[0]
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"input '{tensor.name}' is not valid UTF-8") from None
