"""BLS requests made with ``trace=request.trace()`` are traced under the request that
made them (Triton's parent_id); those made without it are not, as in Triton."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from trioserve import ServerConfig
from trioserve.testing import server_in_thread
from trioserve.tracing import TraceConfig

from .._model_repository import write_model

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 2 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 2 ] }} ]
"""

ADD_ONE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + 1)]
            )
            for r in requests
        ]
"""

TWICE_THROUGH = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            traced = pb_utils.InferenceRequest(
                model_name="add_one", inputs=[x], requested_output_names=["Y"],
                request_id="traced", trace=request.trace(),
            ).exec()
            y = pb_utils.get_output_tensor_by_name(traced, "Y")
            untraced = pb_utils.InferenceRequest(
                model_name="add_one", inputs=[pb_utils.Tensor("X", y.as_numpy())],
                requested_output_names=["Y"], request_id="untraced",
            ).exec()
            responses.append(pb_utils.InferenceResponse(untraced.output_tensors()))
        return responses
"""


def test_a_bls_request_given_the_trace_is_its_child(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    write_model(repository, "add_one", CONFIG.format(name="add_one"), ADD_ONE)
    write_model(repository, "twice_through", CONFIG.format(name="twice_through"), TWICE_THROUGH)
    path = tmp_path / "trace.json"
    config = ServerConfig(
        model_repositories=[repository],
        http_port=0,
        grpc_port=None,
        trace=TraceConfig(level=("TIMESTAMPS",), rate=1, file=str(path)),
    )
    with server_in_thread(config) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        tensor = httpclient.InferInput("X", [2], "INT32")
        tensor.set_data_from_numpy(np.array([1, 2], np.int32))
        result = client.infer("twice_through", [tensor], request_id="outer")
        assert result.as_numpy("Y").tolist() == [3, 4]
        client.close()
    records = json.loads(path.read_text())
    traces = {r["request_id"]: r for r in records if "model_name" in r}
    assert set(traces) == {"outer", "traced"}
    outer, child = traces["outer"], traces["traced"]
    assert outer["model_name"] == "twice_through" and "parent_id" not in outer
    assert (child["model_name"], child["parent_id"]) == ("add_one", outer["id"])
    stamps = {r["id"]: [t["name"] for t in r["timestamps"]] for r in records if "timestamps" in r}
    full = [
        "REQUEST_START",
        "QUEUE_START",
        "COMPUTE_START",
        "COMPUTE_INPUT_END",
        "COMPUTE_OUTPUT_START",
        "COMPUTE_END",
        "REQUEST_END",
    ]
    assert stamps[outer["id"]] == stamps[child["id"]] == full
