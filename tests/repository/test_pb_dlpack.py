"""DLPack in Python models, as Triton's ``pb_utils.Tensor`` offers it, in both instance
modes: an input (read-only) shared through ``to_dlpack`` / ``from_dlpack`` and
``numpy.from_dlpack`` without a copy; outputs and BLS inputs made from DLPack capsules
and from objects with ``__dlpack__`` cross to the server as any tensor; a BLS answer's
output through DLPack. Over REST and gRPC with tritonclient."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from trioserve import Server, ServerConfig
from trioserve.testing import server_in_thread

from .._model_repository import write_model

# SAME: X through DLPack; QUAD: 4 X, twice doubled (here, then by "twice" through BLS)
# with DLPack each way; SHARED: whether X's DLPack views shared its memory.
MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            same = pb_utils.Tensor.from_dlpack("SAME", x.to_dlpack())
            viewed = np.from_dlpack(x)
            shared = np.shares_memory(same.as_numpy(), x.as_numpy()) and np.shares_memory(
                viewed, x.as_numpy()
            )
            doubled = pb_utils.Tensor.from_dlpack("X", x.as_numpy() * 2)
            answer = pb_utils.InferenceRequest(
                model_name="twice", requested_output_names=["Y"], inputs=[doubled]
            ).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            y = pb_utils.get_output_tensor_by_name(answer, "Y")
            quad = pb_utils.Tensor.from_dlpack("QUAD", y.to_dlpack())
            flag = pb_utils.Tensor("SHARED", np.array([shared]))
            responses.append(pb_utils.InferenceResponse([same, quad, flag]))
        return responses
"""

CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "SAME" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "QUAD" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "SHARED" data_type: TYPE_BOOL dims: [ 1 ] } ]
"""

# Y = 2 X, made from a DLPack capsule.
TWICE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            y = pb_utils.Tensor.from_dlpack("Y", (x * 2).__dlpack__())
            responses.append(pb_utils.InferenceResponse([y]))
        return responses
"""

TWICE_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

CLIENTS = {"rest": httpclient, "grpc": grpcclient}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, instance_mode: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("dlpack")
    write_model(root, "through_dlpack", CONFIG, MODEL)
    write_model(root, "twice", TWICE_CONFIG, TWICE)
    config = ServerConfig(
        model_repositories=[root], http_port=0, grpc_port=0, python_instance_mode=instance_mode
    )
    with server_in_thread(config) as running:
        yield running


@pytest.mark.parametrize("protocol", CLIENTS)
@pytest.mark.parametrize("count", [16, 1 << 18], ids=["64B", "1MiB"])
def test_tensors_through_dlpack(server: Server, protocol: str, count: int) -> None:
    module: Any = CLIENTS[protocol]
    port = server.http_port if protocol == "rest" else server.grpc_port
    client = module.InferenceServerClient(f"127.0.0.1:{port}")
    x = np.arange(count, dtype=np.float32)
    tensor = module.InferInput("X", [count], "FP32")
    tensor.set_data_from_numpy(x)
    try:
        result = client.infer("through_dlpack", [tensor])
    finally:
        client.close()
    np.testing.assert_array_equal(result.as_numpy("SAME"), x)
    np.testing.assert_array_equal(result.as_numpy("QUAD"), x * 4)
    assert result.as_numpy("SHARED").tolist() == [True]
