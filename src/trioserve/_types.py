"""The transport-neutral values that travel between the front ends and the models.

A front end (REST or gRPC) decodes its wire form into an ``InferenceRequest``; the
model's scheduler answers with an ``InferenceResponse``. Neither knows any transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._errors import InvalidArgumentError
from ._tensor import Datatype

if TYPE_CHECKING:
    from .tracing._trace import Trace

Parameters = Mapping[str, Any]


@dataclass(slots=True)
class InputTensor:
    """One request input: its declared datatype and shape, and the data as numpy."""

    name: str
    datatype: Datatype
    shape: tuple[int, ...]
    data: np.ndarray[Any, Any]
    parameters: Parameters = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for, with the parameters it attached (binary_data...)."""

    name: str
    parameters: Parameters = field(default_factory=dict)
    # Where it goes in a client's system shared-memory region, for a model whose own
    # process writes it there (``shm.RequestRegions(windows=True)``): ``shm.OutputWindow``.
    place: Any = None


class ResponseSender(Protocol):
    """How a decoupled model answers one request: any number of ``send`` calls, the
    last with ``final=True`` (it may carry no outputs). Safe from any thread."""

    def send(
        self, outputs: Mapping[str, Any] | Exception | None = None, *, final: bool = False
    ) -> None:
        """Send outputs (name -> array), or an error for this response, or nothing."""
        ...

    @property
    def cancelled(self) -> bool:
        """Whether the client gave up: later responses are dropped."""
        ...


@dataclass(slots=True)
class InferenceRequest:
    model_name: str
    model_version: str  # "" when the client named no version
    inputs: dict[str, InputTensor]
    outputs: list[RequestedOutput] = field(default_factory=list)  # empty: all outputs
    id: str = ""
    parameters: Parameters = field(default_factory=dict)
    # A decoupled model's way to answer: set by the scheduler before ``execute``.
    response_sender: ResponseSender | None = field(default=None, repr=False, compare=False)
    # Set when the request is traced (``tracing``): the runner stamps its queue and compute.
    trace: Trace | None = field(default=None, repr=False, compare=False)
    # Set by the model's execute to run the request again in a later batch instead of
    # releasing it (an iterative sequence's step; the runner clears it).
    rescheduled: bool = field(default=False, repr=False, compare=False)

    @property
    def priority(self) -> int:
        """Requested priority level; 0 means the model's default."""
        return _int_parameter(self.parameters, "priority")

    @property
    def timeout_us(self) -> int:
        """Queue timeout in microseconds; 0 means the model's default."""
        return _int_parameter(self.parameters, "timeout")


UINT64_MAX = 2**64 - 1  # the widest integer the protocols carry (gRPC's uint64)


def _int_parameter(parameters: Parameters, key: str) -> int:
    value = parameters.get(key, 0)
    if type(value) is not int or not 0 <= value <= UINT64_MAX:
        raise InvalidArgumentError(f"parameter '{key}' must be an integer from 0 to {UINT64_MAX}")
    return value


@dataclass(slots=True)
class OutputTensor:
    name: str
    datatype: Datatype
    data: np.ndarray[Any, Any]
    parameters: Parameters = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)


@dataclass(slots=True)
class InferenceResponse:
    model_name: str
    model_version: str
    outputs: list[OutputTensor]
    id: str = ""
    parameters: Parameters = field(default_factory=dict)

    def as_numpy(self, name: str) -> np.ndarray[Any, Any]:
        """The data of output ``name`` (KeyError when the response has no such output)."""
        for tensor in self.outputs:
            if tensor.name == name:
                return tensor.data
        raise KeyError(f"the response has no output '{name}'")
