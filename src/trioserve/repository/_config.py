"""A model folder's ``config.pbtxt``, read into Triton's ``ModelConfig`` and completed.

The file is protobuf text format, parsed by protobuf's own ``text_format``. What the file
leaves out is filled in as Triton does: the name from the folder, the version policy
(latest 1), one CPU instance group, group names and counts. A backend fills in what it
can tell from the model itself (its ``read``, a row of ``_backends``) before
``model_settings`` turns the config into the settings of a served ``Model``.

Every problem is a ``ConfigError`` naming the file, the field and the reason; it fails
that model only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from .._model import DynamicBatching, TensorSpec
from .._tensor import datatype_from_config
from ._generated.model_config_pb2 import DataType, ModelConfig, ModelInstanceGroup
from ._sequence_config import complete_sequence_batching, sequence_settings

CONFIG_FILE = "config.pbtxt"


class ConfigError(Exception):
    """A model's configuration cannot be served; the message says where and why."""


def read_config(folder: Path, override: str | None = None) -> ModelConfig:
    """The folder's config.pbtxt (or ``override``, a JSON ModelConfig that replaces it,
    as the repository API's load sends it); an empty config when there is neither."""
    config = ModelConfig()
    if override is not None:
        try:
            json_format.Parse(override, config)
        except json_format.ParseError as exc:
            raise ConfigError(f"the config override is not a valid ModelConfig: {exc}") from None
        return config
    path = folder / CONFIG_FILE
    if not path.is_file():
        return config
    try:
        text_format.Parse(path.read_text(encoding="utf-8"), config)
    except (text_format.ParseError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config


def complete_config(config: ModelConfig, folder: Path, *, gpu_available: bool = False) -> None:
    """Triton's defaults for what the config leaves out, and its checks on the name."""
    where = folder / CONFIG_FILE
    if not config.name:
        config.name = folder.name
    elif config.name != folder.name:
        raise ConfigError(
            f"{where}: field 'name': '{config.name}' does not match the model folder "
            f"'{folder.name}'"
        )
    if not config.HasField("model_transaction_policy"):
        config.model_transaction_policy.decoupled = False
        config.model_transaction_policy.SetInParent()
    if config.max_batch_size < 0:
        raise ConfigError(f"{where}: field 'max_batch_size': must be >= 0")
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if not config.instance_group:
        config.instance_group.add()
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{index}" if index else config.name
        if group.count < 0:
            raise ConfigError(f"{where}: field 'instance_group.count': must be >= 1")
        if group.count == 0:
            group.count = 1
        if group.kind == ModelInstanceGroup.KIND_AUTO:
            gpu = gpu_available or bool(group.gpus)
            group.kind = ModelInstanceGroup.KIND_GPU if gpu else ModelInstanceGroup.KIND_CPU
        if group.kind == ModelInstanceGroup.KIND_GPU and not group.gpus:
            group.gpus.append(0)
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for tensor in tensors:
            if not tensor.name:
                raise ConfigError(f"{where}: field '{kind}.name': must not be empty")
            if not tensor.dims:
                raise ConfigError(f"{where}: field '{kind}.dims' of '{tensor.name}': missing")
    if config.HasField("sequence_batching"):
        complete_sequence_batching(config)
    batching = config.dynamic_batching
    # Triton prefers full batches when the config names no preferred size.
    if config.HasField("dynamic_batching") and not batching.preferred_batch_size:
        batching.preferred_batch_size.extend([config.max_batch_size] * (config.max_batch_size > 0))
    # Triton's default optimization: host buffers pinned for inputs and outputs.
    for field in ("input_pinned_memory", "output_pinned_memory"):
        if not config.optimization.HasField(field):
            getattr(config.optimization, field).enable = True


def model_settings(config: ModelConfig, folder: Path) -> dict[str, Any]:
    """The keyword arguments of ``Model`` that a completed config describes."""
    where = folder / CONFIG_FILE
    settings: dict[str, Any] = {
        "name": config.name,
        "inputs": [_spec(where, "input", t, t.optional) for t in config.input],
        "outputs": [_spec(where, "output", t, False) for t in config.output],
        "max_batch_size": config.max_batch_size,
        "instance_count": sum(group.count for group in config.instance_group),
        "device": _device(config),
        "platform": config.platform or config.backend,
        "parameters": {k: v.string_value for k, v in config.parameters.items()},
        "response_cache": config.response_cache.enable,
        "decoupled": config.model_transaction_policy.decoupled,
    }
    if config.HasField("sequence_batching"):
        try:
            settings["sequence_batching"] = sequence_settings(config)
        except ValueError as exc:
            raise ConfigError(f"{where}: field 'sequence_batching': {exc}") from None
    if config.HasField("dynamic_batching"):
        batching = config.dynamic_batching
        queue = batching.default_queue_policy
        try:
            settings["dynamic_batching"] = DynamicBatching(
                preferred_batch_size=list(batching.preferred_batch_size),
                max_queue_delay_microseconds=batching.max_queue_delay_microseconds,
                max_queue_size=queue.max_queue_size,
                default_timeout_microseconds=queue.default_timeout_microseconds,
                priority_levels=batching.priority_levels,
                default_priority_level=batching.default_priority_level,
            )
        except ValueError as exc:
            raise ConfigError(f"{where}: field 'dynamic_batching': {exc}") from None
    return settings


def _spec(where: Path, kind: str, tensor: Any, optional: bool) -> TensorSpec:
    try:
        wire = datatype_from_config(DataType.Name(tensor.data_type))
        return TensorSpec(tensor.name, wire.name, list(tensor.dims), optional)
    except Exception as exc:
        raise ConfigError(f"{where}: field '{kind}' '{tensor.name}': {exc}") from None


def _device(config: ModelConfig) -> str:
    kinds = {group.kind for group in config.instance_group}
    return "gpu" if ModelInstanceGroup.KIND_GPU in kinds else "cpu"


def config_document(config: ModelConfig) -> dict[str, Any]:
    """The config as Triton's JSON form: proto field names, every scalar printed, enums
    by name, 64-bit integers as JSON numbers (protobuf's JSON would print strings)."""
    document: dict[str, Any] = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _int64_as_numbers(config, document)
    return document


_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def _int64_as_numbers(message: Message, document: dict[str, Any]) -> None:
    for field in message.DESCRIPTOR.fields:
        key = field.name
        if key not in document:
            continue
        value = getattr(message, key)
        if field.type in _INT64:
            document[key] = [int(v) for v in value] if _repeated(field) else int(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            entry = field.message_type
            if entry.GetOptions().map_entry:
                value_field = entry.fields_by_name["value"]
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    for k, v in value.items():
                        _int64_as_numbers(v, document[key][str(k)])
            elif _repeated(field):
                for item, sub in zip(value, document[key], strict=True):
                    _int64_as_numbers(item, sub)
            else:
                _int64_as_numbers(value, document[key])


def _repeated(field: FieldDescriptor) -> bool:
    # ``is_repeated``, not ``label``: protobuf 7 dropped ``FieldDescriptor.label``.
    return bool(field.is_repeated)


def config_json(config: ModelConfig) -> str:
    """The config as the JSON string Triton hands a Python model's ``initialize``."""
    return json.dumps(config_document(config))
