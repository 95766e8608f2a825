"""ONNX Runtime models: served with no config.pbtxt, the config auto-completed from the graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from trioserve import ServerConfig
from trioserve.testing import server_in_thread

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402


def write_add_model(write_onnx, path: Path, batch: str | int) -> None:
    """Z = X + Y over FP32 [batch, 3]."""
    shape = [batch, 3]
    float_tensor = (TensorProto.FLOAT, shape)
    write_onnx(
        path,
        [helper.make_node("Add", ["X", "Y"], ["Z"])],
        [("X", *float_tensor), ("Y", *float_tensor)],
        [("Z", *float_tensor)],
    )


@pytest.mark.parametrize(("batch", "max_batch_size", "dims"), [("N", 4, [3]), (2, 0, [2, 3])])
def test_onnx_model_without_config(write_onnx, tmp_path: Path, batch, max_batch_size, dims) -> None:
    write_add_model(write_onnx, tmp_path / "add" / "1" / "model.onnx", batch)
    config = ServerConfig(model_repositories=[tmp_path], http_port=0, grpc_port=None)
    with server_in_thread(config) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        described = client.get_model_config("add")
        assert described["platform"] == "onnxruntime_onnx"
        assert described["backend"] == "onnxruntime"
        assert described["max_batch_size"] == max_batch_size
        assert ("dynamic_batching" in described) == (max_batch_size > 0)
        assert [(t["name"], t["data_type"], t["dims"]) for t in described["input"]] == [
            ("X", "TYPE_FP32", dims),
            ("Y", "TYPE_FP32", dims),
        ]
        assert [(t["name"], t["dims"]) for t in described["output"]] == [("Z", dims)]
        assert client.get_model_metadata("add")["platform"] == "onnxruntime_onnx"
        inputs = []
        for name, value in (("X", 1.5), ("Y", 2.0)):
            tensor = httpclient.InferInput(name, [2, 3], "FP32")
            tensor.set_data_from_numpy(np.full((2, 3), value, np.float32))
            inputs.append(tensor)
        assert client.infer("add", inputs).as_numpy("Z").tolist() == [[3.5] * 3] * 2
        client.close()
