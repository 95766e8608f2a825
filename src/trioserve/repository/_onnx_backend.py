"""The ONNX Runtime backend (``platform: "onnxruntime_onnx"``, ``backend: "onnxruntime"``).

Needs the ``onnx`` extra (``pip install 'trioserve[onnx]'``). A version's ``model.onnx``
(a file, or a folder holding ``model.onnx`` and its external data) runs in an
``InferenceSession``, in a worker thread; a model's instances share it (ONNX Runtime
runs one session from several threads at once). Auto-complete reads the graph as
Triton does: inputs and outputs with their types and dims; when every input and output
has a variable first dimension, the model batches (``max_batch_size`` 4 or
``--backend-config onnxruntime,default-max-batch-size``, that dimension
dropped from the dims) and gets the dynamic batcher. A tensor left without dims gets
``dims: [1]``, and in a batching model ``reshape: { shape: [] }`` too.

Shapes between the protocol and the graph (``reshape``, rank 0, batches split back):
``_onnx_tensors``. Session options, providers and the shared thread pools:
``_onnx_options``. Sessions are created in worker threads, several at once when models
load in parallel: nothing here is shared between them but the global pools' lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._model import Model, Result
from .._types import InferenceRequest
from ._config import CONFIG_FILE, ConfigError, complete_config, config_document, model_settings
from ._generated.model_config_pb2 import DataType, ModelConfig
from ._layout import Reading, chosen_versions, version_folders
from ._onnx_options import SessionPlan, base_options, default_max_batch_size, runtime, session_plan
from ._onnx_tensors import Batch, Layout, check_reshape, string_output_error

# ONNX Runtime's type strings -> Triton's config types
_TYPES = {
    "tensor(bool)": "TYPE_BOOL", "tensor(uint8)": "TYPE_UINT8", "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32", "tensor(uint64)": "TYPE_UINT64", "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16", "tensor(int32)": "TYPE_INT32", "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16", "tensor(float)": "TYPE_FP32", "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
}  # fmt: skip


def _model_path(path: Path) -> Path:
    return path / "model.onnx" if path.is_dir() else path


def _session(path: Path, options: Any, providers: Sequence[Any] = ()) -> Any:
    try:
        return runtime().InferenceSession(
            str(_model_path(path)), sess_options=options, providers=list(providers) or None
        )
    except Exception as exc:
        raise ConfigError(f"{path}: ONNX Runtime cannot load the model: {exc}") from None


def auto_complete_onnx(config: ModelConfig, path: Path) -> None:
    """Triton's auto-complete: with inputs and outputs both declared, nothing; otherwise
    the batching, and the list of inputs or outputs left empty, from the graph."""
    if config.input and config.output:
        return
    # Only the graph's signature is read: no optimization, no threads of its own.
    options = base_options({"intra_op_thread_count": 1, "inter_op_thread_count": 1})
    options.graph_optimization_level = runtime().GraphOptimizationLevel.ORT_DISABLE_ALL
    session = _session(path, options, ["CPUExecutionProvider"])
    graph_inputs, graph_outputs = session.get_inputs(), session.get_outputs()
    batching = all(
        len(t.shape) > 0 and not isinstance(t.shape[0], int)
        for t in (*graph_inputs, *graph_outputs)
    )
    if batching:
        if config.max_batch_size == 0:
            config.max_batch_size = default_max_batch_size()
        scheduled = config.HasField("dynamic_batching") or config.HasField("sequence_batching")
        if config.max_batch_size > 1 and not scheduled:
            config.dynamic_batching.SetInParent()
    elif config.max_batch_size:
        raise ConfigError(
            f"{path}: the model cannot batch (not every input and output has a variable "
            f"first dimension), yet max_batch_size is {config.max_batch_size}"
        )
    skip = 1 if config.max_batch_size > 0 else 0
    for declared, tensors in ((config.input, graph_inputs), (config.output, graph_outputs)):
        if declared:  # a list the config gives is left as it is
            continue
        for tensor in tensors:
            if tensor.type not in _TYPES:
                raise ConfigError(f"{path}: tensor '{tensor.name}' has unsupported {tensor.type}")
            added = declared.add()
            added.name = tensor.name
            added.data_type = DataType.Value(_TYPES[tensor.type])
            added.dims.extend(d if isinstance(d, int) else -1 for d in tensor.shape[skip:])
            if not added.dims:  # Triton's dims cannot be empty: [1], reshaped to the graph's
                added.dims.append(1)
                if skip:  # a scalar per batch element: each request's [B, 1] runs as [B]
                    added.reshape.SetInParent()


def read_onnx(reading: Reading) -> list[Model]:
    """A folder's ONNX Runtime models, one per version (``_backends``' row)."""
    config, folder = reading.config, reading.folder
    versions = chosen_versions(config, folder)
    folders = version_folders(folder)
    paths = {v: reading.model_file(folders[v]) for v in versions}
    if not reading.strict:
        auto_complete_onnx(config, paths[versions[-1]])
    complete_config(config, folder)
    check_reshapes(config, folder)
    settings = model_settings(config, folder)
    return [OnnxModel(paths[v], config, v, **settings) for v in versions]


def check_reshapes(config: ModelConfig, folder: Path) -> None:
    """Refuse a ``reshape`` that cannot stand for its tensor's ``dims``."""
    for tensor in (*config.input, *config.output):
        if tensor.HasField("reshape"):
            problem = check_reshape(tensor.name, tensor.dims, tensor.reshape.shape)
            if problem:
                raise ConfigError(f"{folder / CONFIG_FILE}: field 'reshape' of {problem}")


class OnnxModel(Model):
    """One version of an ONNX model, served by an ONNX Runtime session."""

    def __init__(self, path: Path, config: ModelConfig, version: int, **settings: Any) -> None:
        super().__init__(versions=(str(version),), **settings)
        self._path = path
        self._config = config
        self._document = config_document(config)
        self._session: Any = None
        # Read now, so that a setting ONNX Runtime cannot honour fails the model's load.
        self._plan: SessionPlan = session_plan(config, str(path))
        self._run_options = self._plan.run_options()
        self._inputs: dict[str, Layout] = {}
        self._outputs: list[Layout] = []

    def described_config(self) -> dict[str, Any]:
        return self._document

    def load(self) -> None:
        session = _session(self._path, self._plan.options, self._plan.providers)
        graph = {t.name: t for t in (*session.get_inputs(), *session.get_outputs())}
        graph.update({t.name: t for t in session.get_overridable_initializers()})
        ranks = {name: len(t.shape) for name, t in graph.items()}
        for kind, tensors in (("input", self._config.input), ("output", self._config.output)):
            for tensor in tensors:
                _check_against_graph(kind, tensor, graph.get(tensor.name), self._path, self.batches)
        declared = {t.name for t in self._config.input}
        sequences = self._config.sequence_batching  # inputs the sequence batcher sets
        declared |= {c.name for c in sequences.control_input}
        declared |= {state.input_name for state in sequences.state}
        for node in session.get_inputs():
            if node.name not in declared:  # ONNX Runtime would refuse every request
                raise ConfigError(
                    f"{self._path}: the model's input '{node.name}' is not in the config"
                )
        self._inputs = {t.name: _layout(t, ranks) for t in self._config.input}
        self._outputs = [_layout(t, ranks) for t in self._config.output]
        answered = {layout.name for layout in self._outputs}
        self._outputs += [  # what the sequence batcher keeps as the next request's state
            Layout(state.output_name, tuple(state.dims), None, ranks.get(state.output_name) == 0)
            for state in sequences.state
            if state.output_name not in answered
        ]
        self._session = session

    def unload(self) -> None:
        self._session = None

    def execute(self, requests: Sequence[InferenceRequest]) -> list[Result]:
        """One session run for the whole batch (the batcher only groups requests whose
        inputs agree in shape), split back into each request's outputs."""
        batch = Batch(requests, self._inputs, self.batches)
        if not batch.runs:
            return batch.results([], [], self.name)
        names = [layout.name for layout in self._outputs]
        try:
            arrays = self._session.run(names, batch.feeds, self._run_options)
        except UnicodeDecodeError as exc:
            error = string_output_error(self.name, exc)
            return [error for _ in requests]
        return batch.results(self._outputs, arrays, self.name)


def _check_against_graph(kind: str, tensor: Any, node: Any, path: Path, batching: bool) -> None:
    """Triton's load-time checks of a config tensor against the graph's: it exists, has
    the type, and its shape (the reshape if any, after the batch dimension) agrees."""
    where = f"{path}: {kind} '{tensor.name}'"
    if node is None:
        raise ConfigError(f"{where}: the model has no such {kind}")
    declared = DataType.Name(tensor.data_type)
    if _TYPES.get(node.type) != declared:
        raise ConfigError(f"{where}: the config says {declared}, the model has {node.type}")
    config_dims = list(tensor.reshape.shape if tensor.HasField("reshape") else tensor.dims)
    graph_dims = [d if isinstance(d, int) else -1 for d in node.shape]
    if not graph_dims:  # a scalar: the config's dims can only be ones
        if batching or any(d != 1 for d in config_dims):
            raise ConfigError(
                f"{where}: the model's tensor is a scalar; the config says {config_dims}"
            )
        return
    if batching:
        if graph_dims[0] != -1:
            raise ConfigError(
                f"{where}: the model's first dimension is {graph_dims[0]}, not a variable "
                "batch dimension (max_batch_size > 0)"
            )
        graph_dims = graph_dims[1:]
    agrees = len(graph_dims) == len(config_dims) and all(
        -1 in (g, c) or g == c for g, c in zip(graph_dims, config_dims, strict=True)
    )
    if not agrees:
        raise ConfigError(
            f"{where}: the model's shape is {graph_dims} (batch dimension left out), the "
            f"config's {config_dims}"
        )


def _layout(tensor: Any, ranks: dict[str, int]) -> Layout:
    reshape = tuple(tensor.reshape.shape) if tensor.HasField("reshape") else None
    scalar = reshape is None and ranks.get(tensor.name) == 0
    return Layout(tensor.name, tuple(tensor.dims), reshape, scalar)
