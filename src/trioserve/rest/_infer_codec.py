"""HTTP inference bodies: JSON and Triton's binary tensor data extension.

A request body is a JSON header, optionally followed by raw tensors (its length given by
``Inference-Header-Content-Length``), in the order the inputs that carry
``binary_data_size`` appear in the JSON. A header length of 0 means the whole body is the
raw data of the model's single input. Raw input data becomes read-only numpy views of
the body (which may be a bytearray received whole: the views keep it alive). A response's
raw output data is left as the outputs' own memory, to be sent after the JSON header.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from .._errors import InvalidArgumentError, UnsupportedError
from .._model import Model
from .._tensor import (
    JSON_SLICE,
    Datatype,
    array_from_json,
    array_from_raw,
    array_to_json,
    array_to_raw,
    check_shape,
    datatype,
    element_count,
)
from .._types import (
    UINT64_MAX,
    InferenceRequest,
    InferenceResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
)
from ..shm import (
    RequestRegions,
    is_shared_memory_output,
    shared_memory_input,
    shared_memory_outputs,
)
from ._json_body import COMPACT, json_object

# model_name and model_version are not the protocol's, but KServe's clients always send
# the name: taken when they repeat the URL (as KServe's own server takes them).
_JSON_KEYS = frozenset({"id", "parameters", "inputs", "outputs", "model_name", "model_version"})


def decode_request(
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    model: Model,
    model_name: str,
    model_version: str,
    regions: RequestRegions | None = None,
) -> InferenceRequest:
    """The request a body holds; ``header_length`` is the binary extension's header.

    ``regions``: where tensors placed in shared memory are read from (and leased).
    """
    view = memoryview(body)
    if not view.readonly:  # a bytearray body, received whole: inputs must not be writable
        view = view.toreadonly()
    if header_length == 0:
        return _decode_raw_body(view, model, model_name, model_version)
    if header_length is None:
        header, binary = view, view[:0]
    else:
        if header_length > len(body):
            raise InvalidArgumentError(
                f"Inference-Header-Content-Length {header_length} exceeds the body length {len(body)}"
            )
        header, binary = view[:header_length], view[header_length:]
    document = _parse_json(header)
    _check_names(document, model_name, model_version)
    inputs, used = _decode_inputs(document.get("inputs"), binary, regions)
    if used != len(binary):
        raise InvalidArgumentError(
            f"the body carries {len(binary)} bytes of binary data, the inputs declare {used}"
        )
    outputs = _decode_outputs(document.get("outputs"))
    shared_memory_outputs(regions, outputs)
    parameters = _parameters(document.get("parameters"), "request")
    _check_flag(parameters, "binary_data_output", "request")
    _check_sequence_id(parameters.get("sequence_id"))
    return InferenceRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=inputs,
        outputs=outputs,
        id=_decode_id(document.get("id")),
        parameters=parameters,
    )


def _parse_json(header: memoryview) -> dict[str, Any]:
    try:
        # Decoded here: given bytes, json.loads would first sniff for UTF-16 and UTF-32.
        text = str(header, "utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"malformed JSON in the request: {exc}") from None
    document = json_object(text)
    unknown = document.keys() - _JSON_KEYS
    if unknown:
        raise InvalidArgumentError(f"unexpected keys in the request: {sorted(unknown)}")
    return document


def _check_names(document: dict[str, Any], model_name: str, model_version: str) -> None:
    """A model name or version in the body must be the URL's (null or absent: no claim).
    Without a version in the URL, the server's policy picks the version, whatever the
    body says, as for the URL's own requests."""
    for key, url_value in (("model_name", model_name), ("model_version", model_version)):
        value = document.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidArgumentError(f"request '{key}' must be a string")
        if value != url_value and (key == "model_name" or url_value):
            raise InvalidArgumentError(
                f"request '{key}' {value!r} does not match the URL's {url_value!r}"
            )


def _decode_id(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidArgumentError("request 'id' must be a string")
    return value


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{where} 'parameters' must be a JSON object")
    return value


def _check_flag(parameters: dict[str, Any], key: str, where: str) -> None:
    """A flag parameter is true or false: the string "false" is no way to say false."""
    if type(parameters.get(key, False)) is not bool:
        raise InvalidArgumentError(f"{where} parameter '{key}' must be a boolean")


def _check_sequence_id(value: Any) -> None:
    """A numeric correlation id is a uint64, as on gRPC: JSON numbers beyond it would
    otherwise wrap around onto another sequence (2**64 + 5 continuing sequence 5)."""
    if type(value) is int and not 0 <= value <= UINT64_MAX:
        raise InvalidArgumentError(
            f"request parameter 'sequence_id' must be an unsigned 64-bit integer, not {value}"
        )


def _decode_inputs(
    value: Any, binary: memoryview, regions: RequestRegions | None
) -> tuple[dict[str, InputTensor], int]:
    # As Triton: the list must be there, and may be empty (a model without inputs).
    if not isinstance(value, list):
        raise InvalidArgumentError("the request must have an 'inputs' list")
    inputs: dict[str, InputTensor] = {}
    offset = 0
    for entry in value:
        if not isinstance(entry, dict):
            raise InvalidArgumentError("each input must be a JSON object")
        name = entry.get("name")
        if not isinstance(name, str):
            raise InvalidArgumentError("each input needs a string 'name'")
        if name in inputs:
            raise InvalidArgumentError(f"input '{name}' appears twice")
        what = f"input '{name}'"
        dt = datatype(entry.get("datatype"))
        shape = check_shape(entry.get("shape"), what)
        parameters = _parameters(entry.get("parameters"), what)
        size = parameters.get("binary_data_size")
        in_shared_memory = None
        if parameters:  # most inputs have none: nothing can place them in shared memory
            has_data = size is not None or "data" in entry
            in_shared_memory = shared_memory_input(regions, parameters, dt, shape, what, has_data)
        if in_shared_memory is not None:
            array = in_shared_memory
        elif size is not None:
            if "data" in entry:
                raise InvalidArgumentError(f"{what} has both 'data' and binary_data_size")
            if type(size) is not int or size < 0 or offset + size > len(binary):
                raise InvalidArgumentError(f"{what}: binary_data_size {size!r} runs past the body")
            array = array_from_raw(dt, shape, binary[offset : offset + size], what)
            offset += size
        elif "data" in entry:
            array = array_from_json(dt, shape, entry["data"], what)
        else:
            raise InvalidArgumentError(f"{what} has no data")
        inputs[name] = InputTensor(name, dt, shape, array, parameters)
    return inputs, offset


def _decode_outputs(value: Any) -> list[RequestedOutput]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidArgumentError("'outputs' must be a list")
    outputs = []
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InvalidArgumentError("each requested output needs a string 'name'")
        what = f"output '{entry['name']}'"
        parameters = _parameters(entry.get("parameters"), what)
        _check_flag(parameters, "binary_data", what)
        if parameters.get("binary_data") and "shared_memory_region" in parameters:
            # Exclusive, as in Triton (the request-wide binary_data_output gives way).
            raise InvalidArgumentError(
                f"{what} can't set both 'shared_memory_region' and 'binary_data'"
            )
        if "classification" in parameters:
            raise UnsupportedError("the classification extension is not supported")
        outputs.append(RequestedOutput(entry["name"], parameters))
    return outputs


def _decode_raw_body(
    body: memoryview, model: Model, model_name: str, model_version: str
) -> InferenceRequest:
    """Inference-Header-Content-Length: 0: the body is the single input's raw bytes."""
    if len(model.inputs) != 1:
        raise InvalidArgumentError(
            f"a raw binary request needs a model with one input; '{model.name}' has "
            f"{len(model.inputs)}"
        )
    spec = model.inputs[0]
    dt = spec.wire_datatype
    shape = _raw_shape(spec.dims, dt, body, model.batches, spec.name)
    array = array_from_raw(dt, shape, body, f"input '{spec.name}'")
    return InferenceRequest(
        model_name=model_name,
        model_version=model_version,
        inputs={spec.name: InputTensor(spec.name, dt, shape, array)},
        parameters={"binary_data_output": True},
    )


def _raw_shape(
    dims: Sequence[int], dt: Datatype, body: memoryview, batches: bool, name: str
) -> tuple[int, ...]:
    shape = ([1] if batches else []) + list(dims)
    variable = [i for i, d in enumerate(shape) if d == -1]
    if not variable:
        return tuple(shape)
    if len(variable) > 1:
        raise InvalidArgumentError(
            f"a raw binary request cannot infer the shape of input '{name}' with "
            f"{len(variable)} variable dimensions"
        )
    if dt.is_bytes:
        count = _count_bytes_elements(body)
    else:
        count, rest = divmod(len(body), dt.dtype.itemsize)
        if rest:
            raise InvalidArgumentError(f"input '{name}': {len(body)} bytes is not whole {dt.name}s")
    known = element_count([d for d in shape if d != -1])
    if known == 0 or count % known:
        raise InvalidArgumentError(f"input '{name}': {count} elements do not fit its shape")
    shape[variable[0]] = count // known
    return tuple(shape)


def _count_bytes_elements(body: memoryview) -> int:
    """How many length-prefixed elements the body holds (``array_from_raw`` parses them)."""
    count = offset = 0
    while offset + 4 <= len(body):
        offset += 4 + int.from_bytes(body[offset : offset + 4], "little")
        count += 1
    if offset != len(body):
        raise InvalidArgumentError("raw BYTES data is not a sequence of length-prefixed elements")
    return count


def encode_response(
    response: InferenceResponse, request: InferenceRequest
) -> tuple[bytes, list[bytes | memoryview]]:
    """The JSON header, and the raw data of the binary outputs to follow it (none: the
    header is the whole body): bytes, or byte views of the outputs' arrays, not copied.

    The header is assembled from fragments: only the data and the parameters go through
    the JSON encoder. Every inference response is written here, and building the whole
    document as dicts for one ``json`` call costs about twice as much.
    """
    default_binary = bool(request.parameters.get("binary_data_output", False))
    parts = [
        '{"model_name":', _string(response.model_name),
        ',"model_version":', _string(response.model_version),
    ]  # fmt: skip
    if response.id:
        parts += (',"id":', _string(response.id))
    if response.parameters:
        parts += (',"parameters":', _encode(dict(response.parameters)))
    parts.append(',"outputs":[')
    raw_parts: list[bytes | memoryview] = []
    for index, tensor in enumerate(response.outputs):
        parts += (
            '{"name":' if index == 0 else ',{"name":', _string(tensor.name),
            ',"datatype":"', tensor.datatype.name,
            '","shape":[', ",".join(map(str, tensor.data.shape)),
        )  # fmt: skip
        if is_shared_memory_output(tensor.parameters):
            # Where it was written, and no data.
            parts += ('],"parameters":', _encode(dict(tensor.parameters)), "}")
        elif bool(tensor.parameters.get("binary_data", default_binary)):
            raw = array_to_raw(tensor.data, tensor.datatype)
            parts += ('],"parameters":{"binary_data_size":', str(len(raw)), "}}")
            raw_parts.append(raw)  # bytes, or a uint8 view
        else:
            parts += ('],"data":', _json_data(tensor), "}")
    parts.append("]}")
    return "".join(parts).encode(), raw_parts


def _json_data(tensor: OutputTensor) -> str:
    what = f"output '{tensor.name}'"
    flat = tensor.data.reshape(-1)
    if flat.size <= JSON_SLICE:
        return _json_list(array_to_json(flat, tensor.datatype, what), tensor.datatype)
    # Large outputs are encoded in a worker thread; one encoder call per slice lets the
    # event loop have the GIL between them.
    slices = (
        _json_list(array_to_json(flat[i : i + JSON_SLICE], tensor.datatype, what), tensor.datatype)
        for i in range(0, flat.size, JSON_SLICE)
    )
    return "[" + ",".join(text[1:-1] for text in slices) + "]"


def _json_list(data: list[Any], dt: Datatype) -> str:
    if dt.dtype.kind in "iu":
        return repr(data)  # a list of ints reads as JSON, and repr writes it quicker
    return _encode(data)


def _unserializable(value: object) -> object:
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _make_encoder() -> Callable[[Any], str]:
    """Compact JSON text of a value: one C encoder built once (``JSONEncoder.encode``
    builds one per call)."""
    if c_make_encoder is None:  # a Python without the C accelerator
        return COMPACT.encode
    encoder = c_make_encoder(
        None, _unserializable, encode_basestring_ascii, None, ":", ",", False, False, True
    )
    return lambda value: "".join(encoder(value, 0))


_encode = _make_encoder()
_string = encode_basestring_ascii  # a str as a JSON string literal
