"""A model's metadata and its configuration in Triton's ModelConfig JSON form.

The config dict uses the proto's field names, prints every scalar, names enums
(``TYPE_FP32``, ``KIND_CPU``) and gives int64 values as JSON numbers, which is what
perf_analyzer and tritonclient read. The gRPC front end parses the same dict into the
ModelConfig message, so both transports describe a model identically.
"""

from __future__ import annotations

from typing import Any

from ._generative import GenerativeModel
from ._model import Model, TensorSpec
from ._sequence_batching import SequenceBatching


def model_metadata(model: Model, versions: list[str]) -> dict[str, Any]:
    batch = [-1] if model.batches else []
    return {
        "name": model.name,
        "versions": versions,
        "platform": model.platform,
        "inputs": [_tensor_metadata(t, batch) for t in model.inputs],
        "outputs": [_tensor_metadata(t, batch) for t in model.outputs],
    }


def _tensor_metadata(spec: TensorSpec, batch: list[int]) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": batch + list(spec.dims)}


def model_config(model: Model) -> dict[str, Any]:
    described = model.described_config()
    if described is not None:
        return dict(described)
    config: dict[str, Any] = {
        "name": model.name,
        "platform": model.platform,
        "backend": "python",
        "version_policy": {"specific": {"versions": [int(v) for v in model.versions]}},
        "max_batch_size": model.max_batch_size,
        "input": [
            {
                "name": t.name,
                "data_type": t.wire_datatype.config_name,
                "format": "FORMAT_NONE",
                "dims": list(t.dims),
                "is_shape_tensor": False,
                "allow_ragged_batch": False,
                "optional": t.optional,
            }
            for t in model.inputs
        ],
        "output": [
            {
                "name": t.name,
                "data_type": t.wire_datatype.config_name,
                "dims": list(t.dims),
                "label_filename": "",
                "is_shape_tensor": False,
            }
            for t in model.outputs
        ],
        "instance_group": [
            {
                "name": f"{model.name}_0",
                "kind": "KIND_GPU" if model.device == "gpu" else "KIND_CPU",
                "count": model.instance_count,
                "gpus": [0] if model.device == "gpu" else [],
            }
        ],
        "parameters": {k: {"string_value": v} for k, v in model.parameters.items()},
        # A generative model streams any number of responses per request.
        "model_transaction_policy": {
            "decoupled": model.decoupled or isinstance(model, GenerativeModel)
        },
        "response_cache": {"enable": model.response_cache},
    }
    batching = model.dynamic_batching
    if batching is not None:
        config["dynamic_batching"] = {
            "preferred_batch_size": list(batching.preferred_batch_size),
            "max_queue_delay_microseconds": batching.max_queue_delay_microseconds,
            "preserve_ordering": False,
            "priority_levels": batching.priority_levels,
            "default_priority_level": batching.default_priority_level,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": batching.default_timeout_microseconds,
                "allow_timeout_override": True,
                "max_queue_size": batching.max_queue_size,
            },
        }
    if model.sequence_batching is not None:
        config["sequence_batching"] = _sequence_batching(model.sequence_batching)
    return config


_CONTROL_KINDS = {
    "START": "CONTROL_SEQUENCE_START",
    "END": "CONTROL_SEQUENCE_END",
    "READY": "CONTROL_SEQUENCE_READY",
    "CORRID": "CONTROL_SEQUENCE_CORRID",
}


def _sequence_batching(batching: SequenceBatching) -> dict[str, Any]:
    """Triton's JSON of a ``sequence_batching`` block."""
    delay = batching.max_queue_delay_microseconds
    strategy: dict[str, Any] = {"max_queue_delay_microseconds": delay}
    if batching.strategy == "oldest":
        strategy["max_candidate_sequences"] = batching.max_candidate_sequences
        strategy["preferred_batch_size"] = list(batching.preferred_batch_size)
    controls = []
    for control in batching.controls:
        entry: dict[str, Any] = {"kind": _CONTROL_KINDS[control.kind]}
        if control.kind == "CORRID":
            entry["data_type"] = control.wire_datatype.config_name
        else:
            field = {
                "INT32": "int32_false_true",
                "FP32": "fp32_false_true",
                "BOOL": "bool_false_true",
            }
            entry[field[control.datatype]] = list(control.false_true)
        controls.append({"name": control.name, "control": [entry]})
    states = [
        {
            "input_name": state.input_name,
            "output_name": state.output_name,
            "data_type": state.wire_datatype.config_name,
            "dims": list(state.dims),
        }
        for state in batching.states
    ]
    return {
        "max_sequence_idle_microseconds": batching.max_sequence_idle_microseconds,
        batching.strategy: strategy,
        "control_input": controls,
        "state": states,
    }
