"""Alike INFERs sent as one INFERS and queued as one request.

Under load a worker's write carries tens of INFERs, and most are alike: to the same
model and version, through the same endpoint, with the same parameters (a priority and
timeout, the binary extension's flags), inputs of the same names, datatypes, shapes and
parameters carried in the frame, the same outputs and load report asked for, and no
trace context. The worker sends them as one INFERS (``grouped``, as its channel writes
them): their calls and ids, what they share once, and each input's rows of all of them
joined. Where the model stacks a batch's rows itself (``ModelRunner.coalesces``), the
core queues them as one request (``stacked``), as many as the model's batch holds, and
answers them with one OUTCOME of their calls and the outputs' rows of all
(``inline_outputs``), which the worker cuts into each one's (``outcomes_of_rows``): the
model's batcher would have stacked them the same way, and what each request costs the
core (admission, validation, ticket, queue place, response, its part of the frames) is
paid once for them all, the cutting and joining by the workers. Each still counts as a
request in the statistics, the load and the metrics. Elsewhere the core submits each on
its own (``each``).
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
from ..ipc import Outgoing
from ._wire import INFER, INFERS, INLINE_BYTES, NO_CALL, OUTCOME

Infer = tuple[Any, ...]
"""An INFER message: (INFER, call, endpoint, model, version, id, parameters, inputs,
outputs, report, trace_context)."""

Infers = tuple[Any, ...]
"""An INFERS message: (INFERS, calls, endpoint, model, version, ids, parameters, inputs,
outputs, report), each input (name, datatype, one's shape, the rows of all, parameters)."""


def grouped(frames: list[Outgoing]) -> list[Outgoing]:
    """The frames of one write with the INFERs alike merged into one INFERS each, in
    the place of the first of them; the others as they were, in their order."""
    if len(frames) < 2:
        return frames
    groups: dict[Hashable, list[Infer]] = {}
    placed: list[Outgoing | list[Infer]] = []
    for frame in frames:
        message, fds = frame
        key = _key(message) if message[0] == INFER and not fds else None
        try:
            group = groups.get(key) if key is not None else None
        except TypeError:  # a parameter's value that is a list, say
            key = group = None
        if group is not None:
            group.append(message)
        elif key is not None:
            placed.append(groups.setdefault(key, [message]))
        else:
            placed.append(frame)
    if len(placed) == len(frames):  # none alike
        return frames
    return [
        (_merged(entry) if len(entry) > 1 else entry[0], ()) if isinstance(entry, list) else entry
        for entry in placed
    ]


def _key(message: Infer) -> Hashable | None:
    """What alike INFERs share; None for one that goes alone: one with a trace context or
    no input, an input that is not in the frame or is of BYTES (whose rows differ in
    size), or inputs whose rows are not one same number (the model refuses it alone)."""
    _, _, endpoint, model, version, _, parameters, inputs, outputs, report, trace = message
    if trace is not None or not inputs:
        return None
    params = tuple(parameters.items()) if parameters else ()
    key: list[Hashable] = [model, version, endpoint, report, params]
    rows = inputs[0][2][0] if inputs[0][2] else 0
    for name, type_name, shape, payload, tensor_parameters in inputs:
        if type(payload) is not bytes or type_name == "BYTES" or not shape or shape[0] != rows:
            return None
        key.append((name, type_name, shape, tuple(tensor_parameters.items())))
    if outputs:
        key.append(tuple((name, tuple(params.items())) for name, params in outputs))
    return tuple(key) if rows > 0 else None


def _merged(members: list[Infer]) -> Infers:
    """The INFERS of ``members`` (alike INFERs)."""
    first = members[0]
    inputs = [
        (name, type_name, shape, b"".join([member[7][index][3] for member in members]), params)
        for index, (name, type_name, shape, _, params) in enumerate(first[7])
    ]
    calls = tuple([member[1] for member in members])
    ids = tuple([member[5] for member in members])
    return (INFERS, calls, first[2], first[3], first[4], ids, first[6], inputs, first[8], first[9])


def rows_of(message: Infers) -> int:
    """The batch rows each INFER of an INFERS carries (those of its first input)."""
    return int(message[7][0][2][0])


def each(message: Infers, start: int, stop: int) -> Iterator[Infer]:
    """The INFERs ``start`` to ``stop`` of an INFERS, each as it was sent alone, with
    parameters of its own (a model may change one request's without touching another's)."""
    _, calls, endpoint, model, version, ids, parameters, inputs, outputs, report = message
    sizes = [len(joined) // len(calls) for *_, joined, _ in inputs]
    for index in range(start, stop):
        own = [
            (name, type_name, shape, joined[index * size : (index + 1) * size], dict(params))
            for (name, type_name, shape, joined, params), size in zip(inputs, sizes, strict=True)
        ]  # fmt: skip
        asked = [(name, dict(params)) for name, params in outputs]
        yield (
            INFER, calls[index], endpoint, model, version, ids[index], dict(parameters), own,
            asked, report, None,
        )  # fmt: skip


def stacked(message: Infers, start: int, stop: int) -> InferenceRequest:
    """One request whose inputs stack the rows of the INFERs ``start`` to ``stop`` of an
    INFERS, in order."""
    whole = stop - start == len(message[1])
    inputs = {}
    for name, type_name, shape, joined, parameters in message[7]:
        datatype = DATATYPES[type_name]  # the worker's name for it
        raw = joined
        if not whole:
            size = len(joined) // len(message[1])
            raw = joined[start * size : stop * size]
        rows = (shape[0] * (stop - start), *shape[1:])
        data = array_from_own_raw(datatype, rows, raw)
        inputs[name] = InputTensor(name, datatype, rows, data, parameters)  # alike in all
    outputs = [RequestedOutput(name, params) for name, params in message[8]]
    return InferenceRequest(message[3], message[4], inputs, outputs, "", message[6])


def inline_outputs(response: InferenceResponse, count: int, rows: int) -> list[Any] | None:
    """The outputs of a request stacking ``count`` INFERs of ``rows`` rows each, as the
    OUTCOME of them all carries them: each output's bytes once, under one INFER's shape;
    None if an output does not ride in the frame (large, BYTES, to convert) or has not
    one row per input row (``responses`` then slices it, as the batcher would)."""
    tensors = []
    for tensor in response.outputs:
        data, datatype = tensor.data, tensor.datatype
        if (
            datatype.is_bytes or data.dtype != datatype.dtype or not data.shape
            or data.shape[0] != rows * count or data.nbytes >= INLINE_BYTES * count
        ):  # fmt: skip
            return None
        shape = (rows, *data.shape[1:])
        tensors.append((tensor.name, datatype.name, shape, data.tobytes(), tensor.parameters))
    return tensors


def responses(
    response: InferenceResponse, ids: tuple[str, ...], rows: int
) -> Iterator[InferenceResponse]:
    """Each INFER's response, in order: its rows of the stacked request's outputs, under
    its id (as the model's batcher splits a batch's outputs by its requests' rows)."""
    outputs = response.outputs
    for index, request_id in enumerate(ids):
        part = slice(index * rows, (index + 1) * rows)
        yield InferenceResponse(
            response.model_name, response.model_version,
            [OutputTensor(t.name, t.datatype, t.data[part], t.parameters) for t in outputs],
            request_id, response.parameters,
        )  # fmt: skip


def outcomes_of_rows(
    calls: tuple[int, ...], outcome: tuple[Any, ...]
) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """Each call with its own OUTCOME, cut from the OUTCOME of them all (its id, its
    rows of each output); none for a call withdrawn meanwhile (``NO_CALL``)."""
    _, _, model, version, ids, parameters, tensors, report = outcome
    count = len(calls)
    cut = [(name, kind, shape, raw, len(raw) // count, p) for name, kind, shape, raw, p in tensors]
    for index, call in enumerate(calls):
        if call == NO_CALL:
            continue
        own = [
            (name, kind, shape, raw[index * size : (index + 1) * size], p)
            for name, kind, shape, raw, size, p in cut
        ]  # fmt: skip
        yield call, (OUTCOME, None, model, version, ids[index], parameters, own, report)
