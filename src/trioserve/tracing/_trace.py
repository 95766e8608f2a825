"""One request's trace: Triton's timestamps, its tensors, and the traces of the requests
it made (an ensemble's steps, a model's BLS requests).

A trace is created when its request is sampled (``TraceControl.sample``), stamped where
the server already knows each moment, and ended by whoever created it; a root trace then
goes to its ``TraceSink`` (the Triton trace file, or the OpenTelemetry exporter) with
every child trace it gathered. Timestamps are integer nanoseconds of trio's clock, the
scheduler's clock (``scheduler/_clock.py``), so ``MockClock`` tests see exact values.

The names are Triton's:

- ``REQUEST_START``: the front end has the request (before decoding it);
- ``QUEUE_START``: it entered its model's queue;
- ``COMPUTE_START``: it left the queue in a batch for an instance;
- ``COMPUTE_INPUT_END``: the batch's inputs are ready, the model is called;
- ``COMPUTE_OUTPUT_START``: the model returned;
- ``COMPUTE_END``: the batch's responses are built;
- ``REQUEST_END``: its outputs are written (the front end encodes the response next).

This module imports nothing of trioserve: ``_types.InferenceRequest`` carries a trace.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import trio

REQUEST_START = "REQUEST_START"
QUEUE_START = "QUEUE_START"
COMPUTE_START = "COMPUTE_START"
COMPUTE_INPUT_END = "COMPUTE_INPUT_END"
COMPUTE_OUTPUT_START = "COMPUTE_OUTPUT_START"
COMPUTE_END = "COMPUTE_END"
REQUEST_END = "REQUEST_END"

# Triton's activities of the TENSORS level.
QUEUE_INPUT = "TENSOR_QUEUE_INPUT"
BACKEND_OUTPUT = "TENSOR_BACKEND_OUTPUT"


class TraceSink(Protocol):
    """Where finished root traces go."""

    def collect(self, trace: Trace) -> None: ...


class _Tensor(Protocol):
    """What a traced tensor shows (an ``InputTensor`` or an ``OutputTensor``)."""

    @property
    def name(self) -> str: ...

    @property
    def datatype(self) -> Any: ...  # a ``Datatype``: its ``name`` is the wire name

    @property
    def data(self) -> Any: ...


def now_ns() -> int:
    """trio's clock in integer nanoseconds (the scheduler's clock, on the event loop)."""
    return round(trio.current_time() * 1e9)


class TracedTensor:
    """One tensor as a TENSORS trace shows it: Triton's comma-separated strings."""

    __slots__ = ("activity", "data", "datatype", "name", "shape")

    def __init__(self, activity: str, tensor: _Tensor) -> None:
        data = tensor.data
        if not isinstance(data, np.ndarray) and hasattr(data, "get"):
            data = data.get()  # a device (cupy) array: its copy on the host
        array = np.asarray(data)
        self.activity = activity
        self.name = tensor.name
        self.datatype = str(tensor.datatype.name)
        self.shape = ",".join(map(str, array.shape))
        self.data = ",".join(_element(x) for x in array.reshape(-1).tolist())


def _element(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


class Trace:
    """A traced request of model ``model_name`` (its version), with Triton's trace id;
    ``parent``: the trace of the request that made this one (0 for none)."""

    __slots__ = (
        "_ids",
        "children",
        "context",
        "ended_by_request",
        "generation",
        "id",
        "model_name",
        "model_version",
        "parent_id",
        "request_id",
        "sink",
        "tensors",
        "timestamps",
        "trace_tensors",
    )

    def __init__(
        self,
        sink: TraceSink,
        ids: Iterator[int],
        model_name: str,
        model_version: str,
        *,
        request_id: str = "",
        parent_id: int = 0,
        trace_tensors: bool = False,
        context: Mapping[str, str] | None = None,
    ) -> None:
        self.sink = sink
        self._ids = ids
        self.id = next(ids)
        self.model_name = model_name
        self.model_version = model_version
        self.request_id = request_id
        self.parent_id = parent_id
        self.trace_tensors = trace_tensors
        # The W3C trace context the client sent (traceparent, tracestate), if any.
        self.context = context
        self.timestamps: list[tuple[str, int]] = [(REQUEST_START, now_ns())]
        self.tensors: list[TracedTensor] = []
        self.children: list[Trace] = []
        self.generation: GenerationRecord | None = None
        # A tensor request's trace (OIP inference, of a generative model too): the
        # pipeline ends it when the request is answered, not the engine.
        self.ended_by_request = False

    def stamp(self, name: str, ns: int) -> None:
        self.timestamps.append((name, ns))

    def queued(self, queued_ns: int, execution: Any) -> None:
        """What a tensor runner knows when the request ends: its queue entry and, if a
        batch answered it, that batch's ``ExecutionTimes``."""
        stamps = self.timestamps
        stamps.append((QUEUE_START, queued_ns))
        if execution is not None:
            stamps.append((COMPUTE_START, execution.dequeued_ns))
            stamps.append((COMPUTE_INPUT_END, execution.input_ready_ns))
            stamps.append((COMPUTE_OUTPUT_START, execution.executed_ns))
            stamps.append((COMPUTE_END, execution.output_ready_ns))

    def inputs(self, tensors: Iterable[_Tensor]) -> None:
        if self.trace_tensors:
            self.tensors.extend(TracedTensor(QUEUE_INPUT, t) for t in tensors)

    def child(self, model_name: str, model_version: str, request_id: str = "") -> Trace:
        """The trace of a request this one's model makes (Triton links it by
        ``parent_id``); it starts now and goes to the sink with this one (its maker
        ends it)."""
        child = Trace(
            self.sink,
            self._ids,
            model_name,
            model_version,
            request_id=request_id,
            parent_id=self.id,
            trace_tensors=self.trace_tensors,
            context=self.context,
        )
        self.children.append(child)
        return child

    def outputs(self, tensors: Iterable[_Tensor]) -> None:
        if self.trace_tensors:
            self.tensors.extend(TracedTensor(BACKEND_OUTPUT, t) for t in tensors)

    def end(self) -> None:
        """The request is answered (or failed): a root trace goes to its sink, with its
        children."""
        self.timestamps.append((REQUEST_END, now_ns()))
        if not self.parent_id:
            self.sink.collect(self)

    def walk(self) -> Iterator[Trace]:
        """This trace and every trace under it, parents first."""
        yield self
        for child in self.children:
            yield from child.walk()

    def generation_finished(self, record: GenerationRecord) -> None:
        """The engine's account of a generation that ended: it ends the trace, unless the
        trace is a tensor request's, which then only takes the engine's times."""
        self.generation = record
        start = (
            self.timestamps[0] if self.ended_by_request else (REQUEST_START, _ns(record.arrival))
        )
        self.timestamps = [start]
        self.stamp(QUEUE_START, _ns(record.queued))
        if record.scheduled is not None:
            self.stamp(COMPUTE_START, _ns(record.scheduled))
        if record.last_token is not None:
            self.stamp(COMPUTE_END, _ns(record.last_token))
        if self.ended_by_request:
            return
        self.timestamps.append((REQUEST_END, _ns(record.end)))
        self.sink.collect(self)


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    """A generation's end as the engine tells it (seconds of trio's clock); vLLM's
    ``llm_request`` span is made of it."""

    request_id: str
    arrival: float  # the front end received it
    queued: float  # the engine queued it (its prompt tokenized)
    scheduled: float | None  # first taken into a step
    first_token: float | None
    last_token: float | None
    end: float
    prompt_tokens: int
    completion_tokens: int  # over all samples
    finish_reason: str
    sampling: Any  # the request's ``SamplingParams``


class _Served(Protocol):
    """A served model version (``_served.ServedModel``)."""

    @property
    def model(self) -> Any: ...

    @property
    def version(self) -> str: ...

    async def infer(self, request: Any, /) -> Any: ...


async def infer_child(served: _Served, request: Any, parent: Trace | None) -> Any:
    """``served.infer(request)`` for a request that a model makes (an ensemble's step,
    a BLS request): traced under ``parent``, the trace of the request it serves, if
    that one is traced."""
    if parent is None:
        return await served.infer(request)
    trace = request.trace = parent.child(served.model.name, served.version, request.id)
    trace.inputs(request.inputs.values())
    try:
        response = await served.infer(request)
        trace.outputs(response.outputs)
        return response
    finally:
        trace.end()


def trace_ids() -> Iterator[int]:
    """A server's trace ids: 1, 2, ... (Triton numbers its traces from 1)."""
    return itertools.count(1)
