"""Response parameters a Python-backend model sets (``InferenceResponse(parameters=...)``)
reach the client over REST and gRPC, from the model and from the response cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig
from trioserve.testing import server_in_thread

from .._model_repository import write_model

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Answers the request's "tag" parameter back, with values of each type; IN < 0 asks for
# a parameter value no protocol carries.
MODEL = """
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            tag = json.loads(request.parameters()).get("tag", "none")
            parameters = {"tag": tag, "doubled": int(value[0]) * 2, "odd": bool(value[0] % 2)}
            if value[0] < 0:
                parameters["bad"] = [1, 2]
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUT", value)], parameters=parameters
            ))
        return responses
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, instance_mode: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repository")
    for name, extra in (("tagged", ""), ("cached", "response_cache { enable: true }")):
        write_model(root, name, CONFIG.replace("{name}", name) + extra, MODEL)
    config = ServerConfig(
        model_repositories=[root],
        http_port=0,
        grpc_port=0,
        response_cache_bytes=1 << 20,
        python_instance_mode=instance_mode,
    )
    with server_in_thread(config) as running:
        yield running


def _input(module: Any, value: int) -> Any:
    tensor = module.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], np.int32))
    return tensor


@pytest.mark.parametrize("model", ["tagged", "cached"])
def test_response_parameters_over_rest(server: Server, model: str) -> None:
    with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        for _ in range(2):  # "cached": the second answer comes from the cache
            result = client.infer(model, [_input(httpclient, 7)], parameters={"tag": "t1"})
            assert result.get_response()["parameters"] == {"tag": "t1", "doubled": 14, "odd": True}
            assert result.as_numpy("OUT").tolist() == [7]
        [stats] = client.get_inference_statistics(model)["model_stats"]
        assert stats["inference_stats"]["cache_hit"]["count"] == (model == "cached")


def test_response_parameters_over_grpc(server: Server) -> None:
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
        result = client.infer("tagged", [_input(grpcclient, 4)], parameters={"tag": "t2"})
        assert result.get_response(as_json=True)["parameters"] == {
            "tag": {"string_param": "t2"},
            "doubled": {"int64_param": "8"},
            "odd": {"bool_param": False},
        }


def test_a_parameter_value_no_protocol_carries_fails_the_request(server: Server) -> None:
    with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        with pytest.raises(InferenceServerException, match="response parameter 'bad'"):
            client.infer("tagged", [_input(httpclient, -1)])
        assert client.infer("tagged", [_input(httpclient, 1)]).as_numpy("OUT").tolist() == [1]
