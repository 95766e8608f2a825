"""The config object a Python model's ``auto_complete_config`` receives and returns.

As in Triton, it may add inputs and outputs the config does not declare yet, set the
maximum batch size and ask for the dynamic batcher; it never overrides what the
config.pbtxt sets. It works on the config's JSON form (``_config.config_document``), with
the standard library only: in process mode the hook runs in a process of the model's
own (``_pb_inspect``), under the model's Python, which need not have protobuf; the
server reads the completed form back (``_python_backend.completed_config``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


class ModelConfig:
    """``pb_utils.ModelConfig``: a view of the config being completed."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document  # changed in place

    def as_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.document)

    def set_max_batch_size(self, max_batch_size: int) -> None:
        declared = self.document.get("max_batch_size", 0)
        if declared and declared != max_batch_size:
            raise ValueError(
                "auto_complete_config: max_batch_size is already set to "
                f"{declared} by the model configuration"
            )
        self.document["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        self.document.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, policy: Mapping[str, Any]) -> None:
        self.document.setdefault("model_transaction_policy", {}).update(policy)

    def add_input(self, tensor: Mapping[str, Any]) -> None:
        self._add("input", tensor)

    def add_output(self, tensor: Mapping[str, Any]) -> None:
        self._add("output", tensor)

    def _add(self, kind: str, tensor: Mapping[str, Any]) -> None:
        name = tensor.get("name")
        if not name:
            raise ValueError(f"auto_complete_config: an {kind} needs a name")
        tensors = self.document.setdefault(kind, [])
        declared = next((t for t in tensors if t.get("name") == name), None)
        if declared is None:
            tensors.append(dict(tensor))
            return
        if "dims" in tensor:
            had, asked = _dims(declared.get("dims", [])), _dims(tensor["dims"])
            if had != asked:
                raise ValueError(
                    f"auto_complete_config: {kind} '{name}' has dims {had} in the model "
                    f"configuration, not {asked}"
                )


def _dims(dims: Any) -> list[int]:
    return [int(d) for d in dims]
