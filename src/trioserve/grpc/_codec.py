"""Protobuf messages <-> the transport-neutral values of ``trioserve._types``.

Inputs travel either as ``raw_input_contents`` (one raw buffer per input, in input order;
what tritonclient sends) or as typed ``InferTensorContents`` fields; never both in one
request. Raw buffers become numpy views through the same codec the REST binary extension
uses (``_tensor.array_from_raw``), so both transports read tensors identically. Outputs
always go back as ``raw_output_contents``: tritonclient reads nothing else.

Metadata and config are built from the same dicts REST serves, parsed into the messages,
so both transports describe a model identically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.json_format import ParseDict

from .._errors import InternalError, InvalidArgumentError, UnsupportedError
from .._model import Model
from .._model_config import model_config, model_metadata
from .._stats import ModelStatistics, statistics_document
from .._tensor import Datatype, array_from_raw, array_to_raw, check_shape, datatype, element_count
from .._types import InferenceRequest, InferenceResponse, InputTensor, RequestedOutput
from ..shm import (
    RequestRegions,
    is_shared_memory_output,
    shared_memory_input,
    shared_memory_outputs,
)
from ._generated import grpc_service_pb2 as pb
from ._generated import model_config_pb2

# The typed contents field that carries each datatype. FP16 and BF16 have none: they
# travel raw only (INTEROP.md).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_ALL_CONTENTS_FIELDS = frozenset(_CONTENTS_FIELD.values())

# Parameters that name features this server does not offer yet; refusing them is better
# than silently reading a tensor from the wrong place.
_UNSUPPORTED_PARAMETERS = {
    "classification": "the classification extension",
}


# --- requests ------------------------------------------------------------------------


def decode_request(
    message: pb.ModelInferRequest,
    regions: RequestRegions | None = None,
    raw: Sequence[bytes | bytearray | memoryview] | None = None,
) -> InferenceRequest:
    """The request a ``ModelInferRequest`` holds; INVALID_ARG for anything malformed.

    ``regions``: where tensors placed in shared memory are read from (and leased).
    ``raw``: the raw input contents, when they were kept apart from the message
    (``_infer_wire``); else the message's own.
    """
    model = message.model_name
    if raw is None:
        raw = list(message.raw_input_contents)  # each access copies out of upb: read once
    used = 0  # raw buffers go, in order, to the inputs that carry no typed contents
    inputs: dict[str, InputTensor] = {}
    for tensor in message.inputs:
        name = tensor.name
        if name in inputs:
            raise InvalidArgumentError(f"input '{name}' appears twice")
        what = f"input '{name}'"
        dt = datatype(tensor.datatype)
        shape = check_shape(list(tensor.shape), what)
        parameters = decode_parameters(tensor.parameters, what)
        has_contents = tensor.HasField("contents")
        in_shared_memory = shared_memory_input(regions, parameters, dt, shape, what, has_contents)
        if in_shared_memory is not None:
            array = in_shared_memory  # takes no raw_input_contents entry, as in Triton
        elif has_contents:
            if raw:
                raise InvalidArgumentError(
                    "contents field must not be specified when using raw_input_contents "
                    f"for '{name}' for model '{model}'"
                )
            array = _array_from_contents(dt, shape, tensor.contents, what)
        elif used < len(raw):
            array = array_from_raw(dt, shape, raw[used], what)
            used += 1
        else:
            raise InvalidArgumentError(
                f"unable to find data for input tensor '{name}' for model '{model}' in request."
            )
        inputs[name] = InputTensor(name, dt, shape, array, parameters)
    if used != len(raw):
        raise InvalidArgumentError(
            f"the request carries {len(raw)} raw_input_contents for {used} inputs"
        )
    parameters = decode_parameters(message.parameters, "request")
    _check_scheduling_parameters(message.parameters)
    outputs = [
        RequestedOutput(o.name, decode_parameters(o.parameters, f"output '{o.name}'"))
        for o in message.outputs
    ]
    shared_memory_outputs(regions, outputs)
    return InferenceRequest(
        model_name=model,
        model_version=message.model_version,
        inputs=inputs,
        outputs=outputs,
        id=message.id,
        parameters=parameters,
    )


def _check_scheduling_parameters(parameters: Mapping[str, pb.InferParameter]) -> None:
    """The wire types Triton accepts for the parameters the scheduler reads."""
    if "priority" in parameters:
        priority = parameters["priority"]
        choice = priority.WhichOneof("parameter_choice")
        if choice not in ("int64_param", "uint64_param"):
            raise InvalidArgumentError(
                "invalid value type for 'priority' parameter, expected int64_param or uint64_param."
            )
        if priority.int64_param < 0:
            raise InvalidArgumentError("invalid value for 'priority', expected value >= 0.")
    if "timeout" in parameters:
        timeout = parameters["timeout"]
        if timeout.WhichOneof("parameter_choice") != "int64_param" or timeout.int64_param < 0:
            raise InvalidArgumentError(
                "invalid value type for 'timeout' parameter, expected a non-negative int64_param."
            )


def _array_from_contents(
    dt: Datatype, shape: Sequence[int], contents: pb.InferTensorContents, what: str
) -> np.ndarray[Any, Any]:
    field = _CONTENTS_FIELD.get(dt.name)
    if field is None:
        raise InvalidArgumentError(f"{what}: {dt.name} data can only be sent as raw_input_contents")
    for other in _ALL_CONTENTS_FIELDS - {field}:
        if len(getattr(contents, other)):
            raise InvalidArgumentError(f"{what}: {other} does not carry {dt.name} data")
    values = getattr(contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise InvalidArgumentError(
            f"{what}: got {len(values)} elements in {field}, shape {list(shape)} needs {count}"
        )
    if dt.is_bytes:
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    kind = dt.dtype.kind
    if kind not in "iu":
        return np.fromiter(values, dtype=dt.dtype, count=count).reshape(shape)
    # int_contents / uint_contents are 32-bit on the wire but also carry 8- and 16-bit
    # types: read them wide and check the range rather than let numpy wrap around.
    wide = np.fromiter(values, dtype=np.int64 if kind == "i" else np.uint64, count=count)
    info = np.iinfo(dt.dtype)
    if count and (wide.min() < info.min or wide.max() > info.max):
        raise InvalidArgumentError(f"{what}: value out of range for {dt.name}")
    return wide.astype(dt.dtype).reshape(shape)


def decode_parameters(parameters: Mapping[str, pb.InferParameter], where: str) -> dict[str, Any]:
    """A parameter map as plain Python values (bool, int, str, float)."""
    decoded: dict[str, Any] = {}
    for key, parameter in parameters.items():
        feature = _UNSUPPORTED_PARAMETERS.get(key)
        if feature is not None:
            raise UnsupportedError(f"{where}: {feature} is not supported by this server")
        choice = parameter.WhichOneof("parameter_choice")
        if choice is None:
            raise InvalidArgumentError(f"{where}: parameter '{key}' has no value")
        decoded[key] = getattr(parameter, choice)
    return decoded


# --- responses -----------------------------------------------------------------------


def encode_response(response: InferenceResponse) -> pb.ModelInferResponse:
    """The reply, every output as raw_output_contents (tritonclient reads nothing else)."""
    reply = response_head(response)
    raw: list[bytes] = []
    for tensor in response.outputs:
        if is_shared_memory_output(tensor.parameters):
            raw.append(b"")
            continue
        data = array_to_raw(tensor.data, tensor.datatype)
        # protobuf takes only bytes: this is the one copy of the output before the wire.
        raw.append(data if isinstance(data, bytes) else bytes(data))
    reply.raw_output_contents.extend(raw)
    return reply


def response_head(response: InferenceResponse) -> pb.ModelInferResponse:
    """The reply without its raw output contents (they follow it in ``raw_output_contents``,
    one entry per output, in order).

    Output tensors carry no parameters: what a requested output asked for (e.g. REST's
    ``binary_data``) means nothing on gRPC, and Triton echoes none of it either. Outputs
    written to shared memory are the exception: they carry where they were written, and
    an empty raw entry keeps ``raw_output_contents`` aligned with ``outputs``.
    """
    reply = pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=response.model_version,
        id=response.id,
    )
    for tensor in response.outputs:
        output = reply.outputs.add(
            name=tensor.name, datatype=tensor.datatype.name, shape=tensor.shape
        )
        if is_shared_memory_output(tensor.parameters):
            encode_parameters(tensor.parameters, output.parameters)
    encode_parameters(response.parameters, reply.parameters)
    return reply


def encode_parameters(values: Mapping[str, Any], target: Any) -> None:
    """Fill a ``map<string, InferParameter>`` from Python values."""
    for key, value in values.items():
        parameter = target[key]
        if isinstance(value, bool):  # before int: bool is an int
            parameter.bool_param = value
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            parameter.int64_param = value
        elif isinstance(value, int) and 0 <= value < 2**64:
            parameter.uint64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        elif isinstance(value, str):
            parameter.string_param = value
        else:
            raise InternalError(f"response parameter '{key}' has no gRPC form: {value!r}")


# --- metadata and config -------------------------------------------------------------


def server_metadata_message(metadata: Mapping[str, Any]) -> pb.ServerMetadataResponse:
    return pb.ServerMetadataResponse(
        name=metadata["name"], version=metadata["version"], extensions=metadata["extensions"]
    )


def model_metadata_message(model: Model, versions: list[str]) -> pb.ModelMetadataResponse:
    # The REST dict's keys are the proto's field names (name, versions, platform,
    # inputs/outputs of name, datatype, shape), so it parses as it is.
    message = pb.ModelMetadataResponse()
    ParseDict(model_metadata(model, versions), message)  # fills ``message`` in place
    return message


def model_config_message(model: Model) -> pb.ModelConfigResponse:
    config = ParseDict(model_config(model), model_config_pb2.ModelConfig())
    return pb.ModelConfigResponse(config=config)


def statistics_message(stats: Sequence[ModelStatistics]) -> pb.ModelStatisticsResponse:
    # The REST document parsed into the message: both transports report the same numbers.
    message = pb.ModelStatisticsResponse()
    ParseDict(statistics_document(stats), message)  # fills ``message`` in place
    return message
