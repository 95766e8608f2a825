"""config.pbtxt's ``sequence_batching`` -> ``SequenceBatching``, with Triton's defaults.

Triton fills in what the block leaves out: the ``direct`` strategy and an idle time of
one second. A control input names one control (its kind and values); a state starts
as zeros (``zero_data``, or no initial state); ``data_file`` initial states are not
supported.
"""

from __future__ import annotations

from typing import Any

from .._sequence_batching import SequenceBatching, SequenceControl, SequenceState
from .._tensor import datatype_from_config
from ._generated.model_config_pb2 import DataType, ModelConfig, ModelSequenceBatching

_DEFAULT_IDLE_MICROSECONDS = 1_000_000
_KINDS = {
    ModelSequenceBatching.Control.CONTROL_SEQUENCE_START: "START",
    ModelSequenceBatching.Control.CONTROL_SEQUENCE_END: "END",
    ModelSequenceBatching.Control.CONTROL_SEQUENCE_READY: "READY",
    ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID: "CORRID",
}


def complete_sequence_batching(config: ModelConfig) -> None:
    """Triton's defaults for a ``sequence_batching`` block."""
    batching = config.sequence_batching
    if not batching.max_sequence_idle_microseconds:
        batching.max_sequence_idle_microseconds = _DEFAULT_IDLE_MICROSECONDS
    if batching.WhichOneof("strategy_choice") is None:
        batching.direct.SetInParent()


def sequence_settings(config: ModelConfig) -> SequenceBatching:
    """The ``SequenceBatching`` a completed block describes; ValueError says why not."""
    batching = config.sequence_batching
    strategy = batching.WhichOneof("strategy_choice")
    chosen: Any = batching.oldest if strategy == "oldest" else batching.direct
    return SequenceBatching(
        strategy="oldest" if strategy == "oldest" else "direct",
        max_sequence_idle_microseconds=batching.max_sequence_idle_microseconds,
        max_candidate_sequences=batching.oldest.max_candidate_sequences,
        max_queue_delay_microseconds=chosen.max_queue_delay_microseconds,
        preferred_batch_size=list(batching.oldest.preferred_batch_size),
        controls=[_control(entry) for entry in batching.control_input],
        states=[_state(state) for state in batching.state],
        iterative_sequence=batching.iterative_sequence,
    )


def _control(entry: Any) -> SequenceControl:
    if len(entry.control) != 1:
        raise ValueError(f"control input '{entry.name}' must have exactly one control")
    control = entry.control[0]
    kind = _KINDS[control.kind]
    if kind == "CORRID":
        name = datatype_from_config(DataType.Name(control.data_type)).name
        return SequenceControl(entry.name, "CORRID", name)
    for field, name in (
        ("int32_false_true", "INT32"),
        ("fp32_false_true", "FP32"),
        ("bool_false_true", "BOOL"),
    ):
        values = list(getattr(control, field))
        if values:
            if len(values) != 2:
                raise ValueError(f"control input '{entry.name}': {field} needs two values")
            return SequenceControl(entry.name, kind, name, (values[0], values[1]))  # type: ignore[arg-type]
    raise ValueError(
        f"control input '{entry.name}' must specify int32_false_true, fp32_false_true or "
        "bool_false_true"
    )


def _state(state: Any) -> SequenceState:
    wire = datatype_from_config(DataType.Name(state.data_type))
    if any(entry.WhichOneof("state_data") == "data_file" for entry in state.initial_state):
        raise ValueError(f"state '{state.input_name}': data_file initial states are not supported")
    return SequenceState(state.input_name, state.output_name, wire.name, list(state.dims))
