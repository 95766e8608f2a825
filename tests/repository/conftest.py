"""ONNX models for the repository tests, built with ``onnx.helper``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

WriteOnnx = Callable[..., Path]


@pytest.fixture(scope="session")
def write_onnx() -> WriteOnnx:
    """``write_onnx(path, nodes, inputs, outputs, initializers=(), opset=13)``: saves a
    graph (its value infos given as ``(name, TensorProto type, shape)``) to ``path``."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    helper = onnx.helper

    def write(
        path: Path,
        nodes: Sequence[Any],
        inputs: Sequence[tuple[str, int, Sequence[str | int]]],
        outputs: Sequence[tuple[str, int, Sequence[str | int]]],
        initializers: Sequence[Any] = (),
        opset: int = 13,
    ) -> Path:
        graph = helper.make_graph(
            list(nodes),
            path.parent.parent.name or "model",
            [helper.make_tensor_value_info(*t) for t in inputs],
            [helper.make_tensor_value_info(*t) for t in outputs],
            initializer=list(initializers),
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(path))
        return path

    return write


@pytest.fixture(scope="module", params=["thread", "process"])
def instance_mode(request: pytest.FixtureRequest) -> str:
    """Where Python-backend model instances run (``ServerConfig.python_instance_mode``):
    a test that takes it runs in both modes."""
    return str(request.param)
