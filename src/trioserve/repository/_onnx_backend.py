"""The ONNX Runtime backend (``platform: "onnxruntime_onnx"``, ``backend: "onnxruntime"``).

Needs the ``onnx`` extra (``pip install 'trioserve[onnx]'``). A version's ``model.onnx``
(a file, or a folder holding ``model.onnx`` and its external data) runs in an
``InferenceSession``, in a worker thread. Auto-complete reads the graph as Triton does:
inputs and outputs with their types and dims; when every input and output has a
variable first dimension, the model batches (``max_batch_size`` 4, that dimension
dropped from the dims) and gets the dynamic batcher. The config's parameters
``intra_op_thread_count`` and ``inter_op_thread_count`` size the session's thread pools;
the CUDA execution provider serves KIND_GPU instances when ONNX Runtime has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._model import Model, Outputs, batch_size
from .._types import InferenceRequest
from ._config import ConfigError, config_document
from ._generated.model_config_pb2 import DataType, ModelConfig

# ONNX Runtime's type strings -> Triton's config types
_TYPES = {
    "tensor(bool)": "TYPE_BOOL", "tensor(uint8)": "TYPE_UINT8", "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32", "tensor(uint64)": "TYPE_UINT64", "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16", "tensor(int32)": "TYPE_INT32", "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16", "tensor(float)": "TYPE_FP32", "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
}  # fmt: skip
_DEFAULT_MAX_BATCH_SIZE = 4  # what Triton's auto-complete picks for a batching model


def _runtime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError(
            "the onnxruntime backend needs ONNX Runtime: pip install 'trioserve[onnx]'"
        ) from None
    return onnxruntime


def _model_path(path: Path) -> Path:
    return path / "model.onnx" if path.is_dir() else path


def _session(path: Path, options: Any = None, providers: Sequence[str] = ()) -> Any:
    runtime = _runtime()
    try:
        return runtime.InferenceSession(
            str(_model_path(path)), sess_options=options, providers=list(providers) or None
        )
    except Exception as exc:
        raise ConfigError(f"{path}: ONNX Runtime cannot load the model: {exc}") from None


def auto_complete_onnx(config: ModelConfig, path: Path) -> None:
    """Fill in the inputs, outputs and batching the config leaves out, from the graph."""
    session = _session(path)
    graph_inputs, graph_outputs = session.get_inputs(), session.get_outputs()
    batching = all(
        len(t.shape) > 0 and not isinstance(t.shape[0], int)
        for t in (*graph_inputs, *graph_outputs)
    )
    if config.max_batch_size == 0 and batching and not config.input and not config.output:
        config.max_batch_size = _DEFAULT_MAX_BATCH_SIZE
        if not config.HasField("dynamic_batching") and not config.HasField("sequence_batching"):
            config.dynamic_batching.SetInParent()
    skip = 1 if config.max_batch_size > 0 else 0
    for declared, tensors in ((config.input, graph_inputs), (config.output, graph_outputs)):
        names = {t.name for t in declared}
        for tensor in tensors:
            if tensor.name in names:
                continue
            if tensor.type not in _TYPES:
                raise ConfigError(f"{path}: tensor '{tensor.name}' has unsupported {tensor.type}")
            added = declared.add()
            added.name = tensor.name
            added.data_type = DataType.Value(_TYPES[tensor.type])
            added.dims.extend(d if isinstance(d, int) else -1 for d in tensor.shape[skip:])
            if not added.dims:  # a scalar per batch element
                added.dims.append(1)


class OnnxModel(Model):
    """One version of an ONNX model, served by an ONNX Runtime session."""

    def __init__(self, path: Path, config: ModelConfig, version: int, **settings: Any) -> None:
        super().__init__(versions=(str(version),), **settings)
        self._path = path
        self._document = config_document(config)
        self._session: Any = None

    def described_config(self) -> dict[str, Any]:
        return self._document

    def load(self) -> None:
        runtime = _runtime()
        options = runtime.SessionOptions()
        threads = {"intra_op_thread_count": "intra_op", "inter_op_thread_count": "inter_op"}
        for key, name in threads.items():
            if key in self.parameters:
                setattr(options, f"{name}_num_threads", int(self.parameters[key]))
        providers = ["CPUExecutionProvider"]
        if self.device == "gpu" and "CUDAExecutionProvider" in runtime.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self._session = _session(self._path, options, providers)

    def unload(self) -> None:
        self._session = None

    def execute(self, requests: Sequence[InferenceRequest]) -> list[Outputs]:
        """One session run for the whole batch (the batcher only groups requests whose
        inputs agree in shape), split back into each request's outputs."""
        names = [spec.name for spec in self.outputs]
        first = requests[0].inputs
        feeds = {
            name: _feed(np.concatenate([r.inputs[name].data for r in requests]))
            if len(requests) > 1
            else _feed(first[name].data)
            for name in first
        }
        arrays = self._session.run(names, feeds)
        results: list[Outputs] = []
        start = 0
        for request in requests:
            stop = start + batch_size(request) if len(requests) > 1 else None
            results.append({n: a[start:stop] for n, a in zip(names, arrays, strict=True)})
            start = stop or 0
        return results


def _feed(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """BYTES inputs go to ONNX Runtime as strings."""
    if array.dtype == np.object_:
        return np.array([x.decode() for x in array.reshape(-1)], dtype=object).reshape(array.shape)
    return array
