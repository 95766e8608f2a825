"""Alike INFERs of one frame, queued as one request (``ModelRunner.submit_coalesced``).

Under load a worker's frame carries tens of INFERs, and most are alike: to the same
model and version, with the same parameters (a priority and timeout, the binary
extension's flags), inputs of the same names, datatypes, shapes and parameters carried
in the frame, the same outputs asked for, and no trace context. Where their
model stacks a batch's rows itself (``ModelRunner.coalesces``), the core stacks theirs
into one request, as many as the model's max batch size holds, and answers each with its
rows of the response's outputs: the model's batcher would have stacked them the same
way, and the steps that each request costs the pipeline (admission, validation, ticket,
queue place, response) are taken once for them all. Each still counts as a request in
the statistics, the load and the metrics.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

from .._tensor import DATATYPES, array_from_own_raw
from .._types import (
    InferenceRequest,
    InferenceResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
)
from ._wire import INLINE_BYTES

Infer = tuple[Any, ...]
"""An INFER message: (INFER, call, endpoint, model, version, id, parameters, inputs,
outputs, report, trace_context)."""


def alike(messages: list[Infer]) -> Iterator[list[Infer]]:
    """The frame's INFERs in groups of alike ones, in the order each group's first
    came; one that is like no other, or may not be coalesced, is a group of its own."""
    groups: dict[Hashable, list[Infer]] = {}
    for message in messages:
        key = _key(message)
        try:
            group = groups.get(key) if key is not None else None
        except TypeError:  # a parameter's value that is a list, say
            key = group = None
        if group is not None:
            group.append(message)
        elif key is not None:
            groups[key] = [message]
        else:
            groups[object()] = [message]  # alone, in its place
    return iter(groups.values())


def _key(message: Infer) -> Hashable | None:
    """What alike INFERs share; None for one that goes alone: one with a trace context or
    no input, an input that is not in the frame or is of BYTES (whose rows differ in
    size), or inputs whose rows are not one same number (the model refuses it alone)."""
    _, _, _, model, version, _, parameters, inputs, outputs, _, trace_context = message
    if trace_context is not None or not inputs:
        return None
    key: list[Hashable] = [model, version, tuple(parameters.items()) if parameters else ()]
    rows = inputs[0][2][0] if inputs[0][2] else 0
    for name, type_name, shape, payload, tensor_parameters in inputs:
        if type(payload) is not bytes or type_name == "BYTES" or not shape or shape[0] != rows:
            return None
        key.append((name, type_name, shape, tuple(tensor_parameters.items())))
    if outputs:
        key.append(tuple((name, tuple(params.items())) for name, params in outputs))
    return tuple(key) if rows > 0 else None


def rows_of(message: Infer) -> int:
    """The batch rows each of a group's requests carries (those of its first input)."""
    return int(message[7][0][2][0])


def stacked(members: list[Infer]) -> InferenceRequest:
    """One request whose inputs stack the rows of ``members`` (alike INFERs), in order."""
    first = members[0]
    count = len(members)
    inputs = {}
    for index, (name, type_name, shape, _, parameters) in enumerate(first[7]):
        datatype = DATATYPES[type_name]  # the worker's name for it
        rows = (shape[0] * count, *shape[1:])
        raw = b"".join([member[7][index][3] for member in members])
        data = array_from_own_raw(datatype, rows, raw)
        inputs[name] = InputTensor(name, datatype, rows, data, parameters)  # alike in all
    outputs = [RequestedOutput(name, params) for name, params in first[8]]
    return InferenceRequest(first[3], first[4], inputs, outputs, "", first[6])


def inline_outputs(response: InferenceResponse, members: list[Infer]) -> list[list[Any]] | None:
    """Each member's outputs as a frame carries them (``_wire.inline_tensors``), cut from
    one copy of each output's bytes rather than copied member by member; None if an
    output does not ride in the frame (large, BYTES, to convert) or has not one row per
    input row (``responses`` then slices it, as the batcher would)."""
    count = len(members)
    rows = rows_of(members[0])
    cut = []
    for tensor in response.outputs:
        data, datatype = tensor.data, tensor.datatype
        if (
            datatype.is_bytes or data.dtype != datatype.dtype or not data.shape
            or data.shape[0] != rows * count or data.nbytes >= INLINE_BYTES * count
        ):  # fmt: skip
            return None
        raw, size = data.tobytes(), data.nbytes // count
        shape = (rows, *data.shape[1:])
        cut.append((tensor.name, datatype.name, shape, raw, size, tensor.parameters))
    return [
        [(name, type_name, shape, raw[i * size : (i + 1) * size], params)
         for name, type_name, shape, raw, size, params in cut]
        for i in range(count)
    ]  # fmt: skip


def responses(
    response: InferenceResponse, members: list[Infer]
) -> Iterator[tuple[Infer, InferenceResponse]]:
    """Each member with its response: its rows of the stacked request's outputs, under
    its id (as the model's batcher splits a batch's outputs by its requests' rows)."""
    rows = rows_of(members[0])
    outputs = response.outputs
    for index, member in enumerate(members):
        part = slice(index * rows, (index + 1) * rows)
        yield member, InferenceResponse(
            response.model_name, response.model_version,
            [OutputTensor(t.name, t.datatype, t.data[part], t.parameters) for t in outputs],
            member[5], response.parameters,
        )  # fmt: skip
