"""The sequence batcher's settings: stateful models, one sequence of requests at a time.

The same names and meanings as Triton's ``sequence_batching`` in config.pbtxt. A client
marks the requests of one sequence with a correlation id (``sequence_id``, an unsigned
integer or a string) and flags its first and last requests (``sequence_start``,
``sequence_end``). The model sees a sequence's requests one at a time, in order, with
the control inputs it asked for added to each:

    START    true on the first request of a sequence
    END      true on its last request
    READY    true on every request that carries data (always, here)
    CORRID   the correlation id (an integer type, or BYTES for string ids)

and, for each ``SequenceState``, an input holding what the model output under the state's
output name on the sequence's previous request (``initial`` on its first one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ._tensor import Datatype, datatype

ControlKind = Literal["START", "END", "READY", "CORRID"]
_FLAG_DATATYPES = ("FP32", "INT32", "BOOL")
_CORRID_DATATYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")


@dataclass(frozen=True)
class SequenceControl:
    """A control input the sequence batcher sets on each request.

    A flag (START, END, READY) is ``false_true[1]`` when set and ``false_true[0]`` when
    not, of ``datatype`` FP32, INT32 or BOOL; CORRID carries the correlation id."""

    name: str
    kind: ControlKind
    datatype: str = "INT32"
    false_true: tuple[Any, Any] = (0, 1)

    def __post_init__(self) -> None:
        allowed = _CORRID_DATATYPES if self.kind == "CORRID" else _FLAG_DATATYPES
        if self.kind not in ("START", "END", "READY", "CORRID"):
            raise ValueError(f"control '{self.name}': unknown kind {self.kind!r}")
        if self.datatype not in allowed:
            raise ValueError(
                f"control '{self.name}' ({self.kind}): datatype must be one of {allowed}"
            )
        object.__setattr__(self, "false_true", tuple(self.false_true))

    @property
    def wire_datatype(self) -> Datatype:
        return datatype(self.datatype)


@dataclass(frozen=True)
class SequenceState:
    """Implicit state: the model's output ``output_name`` on one request of a sequence
    is its input ``input_name`` on the next. ``initial`` (zeros by default) starts it."""

    input_name: str
    output_name: str
    datatype: str
    dims: Sequence[int]
    initial: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.dims))
        if any(d < 0 for d in self.dims):
            raise ValueError(f"state '{self.input_name}': dims must be fixed (no -1)")
        wire = datatype(self.datatype)
        if self.initial is None:
            initial = np.zeros(self.dims, dtype=wire.dtype)
        else:
            initial = np.asarray(self.initial, dtype=wire.dtype).reshape(self.dims)
        object.__setattr__(self, "initial", initial)

    @property
    def wire_datatype(self) -> Datatype:
        return datatype(self.datatype)


@dataclass(frozen=True)
class SequenceBatching:
    """Triton's sequence batcher settings.

    ``direct`` gives each sequence a batch slot of its own for its whole life (model
    instances x max_batch_size slots); ``oldest`` keeps up to ``max_candidate_sequences``
    sequences and batches the oldest requests among them, waiting up to
    ``max_queue_delay_microseconds`` for a fuller batch. Sequences beyond the slots
    wait in order for one to free. A sequence that sends nothing for
    ``max_sequence_idle_microseconds`` is released: its later requests are refused.

    ``iterative_sequence``: a request without a correlation id starts a sequence of its
    own (the batcher gives it an id and the START flag) that the model may reschedule
    (``InferenceRequest.rescheduled``): it then runs again, in a later batch, on the
    same instance, until an execution releases it.
    """

    strategy: Literal["direct", "oldest"] = "direct"
    max_sequence_idle_microseconds: int = 1_000_000
    max_candidate_sequences: int = 0  # oldest: 0 is unbounded
    max_queue_delay_microseconds: int = 0
    preferred_batch_size: Sequence[int] = ()
    controls: Sequence[SequenceControl] = ()
    states: Sequence[SequenceState] = field(default=())
    iterative_sequence: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in ("direct", "oldest"):
            raise ValueError(f"unknown sequence batching strategy {self.strategy!r}")
        if self.max_sequence_idle_microseconds <= 0:
            raise ValueError("max_sequence_idle_microseconds must be > 0")
        object.__setattr__(self, "preferred_batch_size", tuple(sorted(self.preferred_batch_size)))
        object.__setattr__(self, "controls", tuple(self.controls))
        object.__setattr__(self, "states", tuple(self.states))
        names = [c.name for c in self.controls] + [s.input_name for s in self.states]
        if len(set(names)) != len(names):
            raise ValueError("control and state input names must be unique")
