"""The model API users implement.

The simple case is one function::

    @trioserve.model(
        name="add",
        inputs=[trioserve.TensorSpec("A", "FP32", [4]), trioserve.TensorSpec("B", "FP32", [4])],
        outputs=[trioserve.TensorSpec("SUM", "FP32", [4])],
        max_batch_size=8,
        dynamic_batching=trioserve.DynamicBatching(max_queue_delay_microseconds=500),
    )
    def add(A, B):
        return {"SUM": A + B}

The function receives each input as a numpy array (batched requests stacked along the
first axis) and returns a mapping of output name to array. ``async def`` functions run
in trio; plain functions run in a worker thread so they never block the event loop.

The full case subclasses ``Model`` and implements ``execute(requests)``, which sees each
request of a batch with its parameters and returns one output mapping per request.
A ``decoupled`` model answers each request through its ``response_sender`` instead.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Any, ClassVar, Literal

import numpy as np

from ._errors import InferenceServerError, InternalError, InvalidArgumentError
from ._sequence_batching import SequenceBatching
from ._stats import MemoryUsage
from ._tensor import Datatype, datatype
from ._types import InferenceRequest

# The model instance (0 .. instance_count - 1) running the current execution: each runs
# one execution at a time, and a sequence's requests all run on the same one.
MODEL_INSTANCE: contextvars.ContextVar[int] = contextvars.ContextVar("model_instance", default=0)

Outputs = Mapping[str, Any]
# What execute returns for one request: its outputs, or the error that failed it alone.
Result = Outputs | InferenceServerError


class ResponseOutputs(dict[str, Any]):
    """A request's outputs and the parameters its response carries to the client (what a
    Python-backend model's ``InferenceResponse(parameters=...)`` sets): values are
    bool, int, float or str, as both protocols can carry them."""

    def __init__(self, outputs: Outputs, parameters: Mapping[str, Any]) -> None:
        super().__init__(outputs)
        for key, value in parameters.items():
            if not isinstance(key, str) or not isinstance(value, bool | int | float | str):
                raise InternalError(
                    f"response parameter {key!r}: values must be bool, int, float or str, "
                    f"not {type(value).__name__}"
                )
        self.parameters = dict(parameters)


@dataclass(frozen=True)
class TensorSpec:
    """A declared input or output. ``dims`` excludes the batch dimension; -1 is variable."""

    name: str
    datatype: str
    dims: Sequence[int]
    optional: bool = False

    wire_datatype: Datatype = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not all(type(d) is int and d >= -1 for d in self.dims):
            raise ValueError(f"tensor {self.name!r}: dims must be integers >= -1")
        object.__setattr__(self, "dims", tuple(self.dims))
        # Looked up once here (it raises for an unknown name), not on every request.
        object.__setattr__(self, "wire_datatype", datatype(self.datatype))


@dataclass(frozen=True)
class DynamicBatching:
    """Triton's dynamic batcher settings (same names and meanings as config.pbtxt)."""

    preferred_batch_size: Sequence[int] = ()
    max_queue_delay_microseconds: int = 0
    max_queue_size: int = 0  # 0: unbounded
    default_timeout_microseconds: int = 0  # 0: requests wait as long as needed
    priority_levels: int = 0  # 0: one level
    default_priority_level: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "preferred_batch_size", tuple(sorted(self.preferred_batch_size)))
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError("default_priority_level must be within 1..priority_levels")


@dataclass(eq=False)  # models compare by identity
class Model:
    """A served model. Subclass it and implement ``execute`` (sync or ``async``).

    ``execute`` receives the requests of one batch (one request when the model does not
    batch) and returns one mapping of output name to array per request. With
    ``instance_count > 1`` it runs concurrently, so it must be thread-safe.
    """

    name: str
    inputs: Sequence[TensorSpec]
    outputs: Sequence[TensorSpec]
    max_batch_size: int = 0
    dynamic_batching: DynamicBatching | None = None
    instance_count: int = 1
    device: Literal["cpu", "gpu"] = "cpu"
    versions: Sequence[str] = ("1",)
    platform: str = "python"
    parameters: Mapping[str, str] = field(default_factory=dict)
    response_cache: bool = False  # answer repeated requests from the server's response cache
    # Decoupled: ``execute`` answers through each request's ``response_sender`` (zero or
    # more responses, then the final flag), possibly after it returned; what it returns
    # is ignored. Served only over streams (gRPC ModelStreamInfer).
    decoupled: bool = False
    # Stateful: requests carry correlation ids and run in order per sequence.
    sequence_batching: SequenceBatching | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 0 or self.instance_count < 1:
            raise ValueError("max_batch_size must be >= 0 and instance_count >= 1")
        if not self.versions or not all(v.isdigit() for v in self.versions):
            raise ValueError("versions must be non-empty numeric strings")
        names = [t.name for t in (*self.inputs, *self.outputs)]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name!r}: tensor names must be unique")
        sequences = self.sequence_batching
        # An iterative sequence is one request: a decoupled model answers it as it goes.
        stateless = sequences is None or (sequences.iterative_sequence and not sequences.states)
        if self.decoupled and (self.response_cache or not stateless):
            raise ValueError(
                f"model {self.name!r}: a decoupled model cannot use the response cache, "
                "implicit state or the sequence batcher (but for iterative sequences)"
            )
        if self.sequence_batching is not None:
            if self.dynamic_batching is not None or self.response_cache:
                raise ValueError(
                    f"model {self.name!r}: the sequence batcher excludes dynamic batching and "
                    "the response cache (a sequence's answers depend on its state)"
                )
            added = [c.name for c in self.sequence_batching.controls]
            added += [s.input_name for s in self.sequence_batching.states]
            clashes = set(added) & {t.name for t in self.inputs}
            if clashes:
                raise ValueError(
                    f"model {self.name!r}: {sorted(clashes)} are sequence inputs the "
                    "batcher sets, not inputs the client sends"
                )

    # An ``async`` model that does not batch may have its execution cancelled when its
    # request's client gives up (a composition of models stops its remaining steps).
    withdraw_cancels_execution: ClassVar[bool] = False

    def load(self) -> Awaitable[None] | None:
        """Called once before the model serves; may be ``async``."""
        return None

    def unload(self) -> Awaitable[None] | None:
        """Called once after the model stopped serving; may be ``async``."""
        return None

    def unavailable(self) -> str | None:
        """Why the loaded model cannot serve any more (None: it can); the repository
        index shows it UNAVAILABLE with this reason, and it is not ready."""
        return None

    def instance_down(self, index: int) -> Callable[[], Awaitable[None]] | None:
        """None while model instance ``index`` can execute a batch; else what to await
        until that may have changed (its process started again, say). Meanwhile the
        runner gives the batches to the model's other instances."""
        return None

    def memory_usage(self) -> Sequence[MemoryUsage]:
        """What the model holds once loaded, as the statistics extension reports it."""
        return ()

    def execute(
        self, requests: Sequence[InferenceRequest]
    ) -> Sequence[Result] | Awaitable[Sequence[Result]]:
        raise NotImplementedError(f"{type(self).__name__} must implement execute()")

    def described_config(self) -> Mapping[str, Any] | None:
        """The configuration to report when it was read from a model repository's
        config.pbtxt; None derives it from the fields (``_model_config``)."""
        return None

    @cached_property
    def input_specs(self) -> dict[str, TensorSpec]:
        return {spec.name: spec for spec in self.inputs}

    @cached_property
    def output_specs(self) -> dict[str, TensorSpec]:
        return {spec.name: spec for spec in self.outputs}

    @cached_property
    def fixed_batch_key(self) -> frozenset[tuple[str, tuple[int, ...]]] | None:
        """The batch key of every valid request that sends all the inputs, when no input's
        dims vary (no -1): ``validate_request`` then builds none. None otherwise."""
        if any(-1 in spec.dims for spec in self.inputs):
            return None
        return frozenset((spec.name, tuple(spec.dims)) for spec in self.inputs)

    @property
    def batches(self) -> bool:
        """Whether inputs carry a leading batch dimension."""
        return self.max_batch_size > 0

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.execute)

    @property
    def reads_client_windows(self) -> bool:
        """Whether ``execute`` takes a fixed-size input that a client placed in a system
        shared-memory region as a ``shm.WindowInput`` (its bytes left there, for the
        model's own process to read) rather than as an array of the bytes."""
        return False


class FunctionModel(Model):
    """A model whose ``execute`` stacks the batch, calls one function and splits the result."""

    def __init__(self, function: Callable[..., Any], **settings: Any) -> None:
        super().__init__(**settings)
        self.function = function
        self._async = inspect.iscoroutinefunction(function)

    @property
    def is_async(self) -> bool:
        return self._async

    def execute(
        self, requests: Sequence[InferenceRequest]
    ) -> Sequence[Outputs] | Awaitable[Sequence[Outputs]]:
        """The function's outputs per request; awaitable when the function is async."""
        if self._async:
            return self._execute_async(requests)
        arguments, rows = self._stack(requests)
        return self._split(rows, self.function(**arguments))

    async def _execute_async(self, requests: Sequence[InferenceRequest]) -> Sequence[Outputs]:
        arguments, rows = self._stack(requests)
        return self._split(rows, await self.function(**arguments))

    def _stack(
        self, requests: Sequence[InferenceRequest]
    ) -> tuple[dict[str, np.ndarray[Any, Any]], list[slice] | None]:
        """The function's arguments, and each request's rows of them (None: one request)."""
        if len(requests) == 1:
            return {name: t.data for name, t in requests[0].inputs.items()}, None
        if not requests[0].inputs:
            raise InvalidArgumentError("request has no inputs")
        # The batcher only groups requests whose inputs match in name and shape, and
        # batch size: each request's rows are those of its first input, counted in C.
        arguments = {}
        rows = None
        for name in requests[0].inputs:
            parts = [r.inputs[name].data for r in requests]
            arguments[name] = np.concatenate(parts)
            if rows is None:
                ends = list(accumulate(map(len, parts)))
                rows = list(map(slice, [0, *ends[:-1]], ends))
        return arguments, rows

    def _split(self, rows: list[slice] | None, outputs: Any) -> list[Outputs]:
        if not isinstance(outputs, Mapping):
            raise TypeError(f"model {self.name!r} returned {type(outputs).__name__}, not a mapping")
        if rows is None:
            return [outputs]
        if not outputs:
            return [{} for _ in rows]
        # Each output's rows per request sliced in C (``map`` over the slices), and one
        # ``dict(zip(...))`` per request: a loop per request and output cost each request
        # of a batch some fifty bytecodes.
        names = list(outputs)
        pieces = [map(np.asarray(array).__getitem__, rows) for array in outputs.values()]
        return [dict(zip(names, row, strict=True)) for row in zip(*pieces, strict=True)]


def batch_size(request: InferenceRequest) -> int:
    """The batch elements a request of a batching model carries (first input's first dim)."""
    for tensor in request.inputs.values():
        return tensor.shape[0] if tensor.shape else 1
    raise InvalidArgumentError("request has no inputs")


def model(
    *,
    name: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    **settings: Any,
) -> Callable[[Callable[..., Any]], FunctionModel]:
    """Declare a model from one function; see the module docstring."""

    def wrap(function: Callable[..., Any]) -> FunctionModel:
        return FunctionModel(function, name=name, inputs=inputs, outputs=outputs, **settings)

    return wrap
