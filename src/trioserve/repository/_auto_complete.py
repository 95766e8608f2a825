"""The config object a Python model's ``auto_complete_config`` receives and returns.

As in Triton, it may add inputs and outputs the config does not declare yet, set the
maximum batch size and ask for the dynamic batcher; it never overrides what the
config.pbtxt sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from ._config import config_document
from ._generated.model_config_pb2 import ModelConfig as ModelConfigMessage


class ModelConfig:
    """``pb_utils.ModelConfig``: a view of the config being completed."""

    def __init__(self, message: ModelConfigMessage) -> None:
        self._message = message

    def as_dict(self) -> dict[str, Any]:
        return config_document(self._message)

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if self._message.max_batch_size and self._message.max_batch_size != max_batch_size:
            raise ValueError(
                "auto_complete_config: max_batch_size is already set to "
                f"{self._message.max_batch_size} by the model configuration"
            )
        self._message.max_batch_size = max_batch_size

    def set_dynamic_batching(self) -> None:
        if not self._message.HasField("dynamic_batching"):
            self._message.dynamic_batching.SetInParent()

    def set_model_transaction_policy(self, policy: Mapping[str, Any]) -> None:
        json_format.ParseDict(dict(policy), self._message.model_transaction_policy)

    def add_input(self, tensor: Mapping[str, Any]) -> None:
        self._add(self._message.input, tensor, "input")

    def add_output(self, tensor: Mapping[str, Any]) -> None:
        self._add(self._message.output, tensor, "output")

    @staticmethod
    def _add(tensors: Any, tensor: Mapping[str, Any], kind: str) -> None:
        name = tensor.get("name")
        if not name:
            raise ValueError(f"auto_complete_config: an {kind} needs a name")
        declared = next((t for t in tensors if t.name == name), None)
        if declared is None:
            json_format.ParseDict(dict(tensor), tensors.add())
        elif "dims" in tensor and list(declared.dims) != list(tensor["dims"]):
            raise ValueError(
                f"auto_complete_config: {kind} '{name}' has dims {list(declared.dims)} in "
                f"the model configuration, not {list(tensor['dims'])}"
            )
