"""Process mode: the thread that reads a batch runs the model, so a model that waits on
threads of its own for the server's answers (BLS requests, ``is_cancelled``) must still
get them: another thread reads meanwhile. Inputs and outputs small enough to ride in
the frames and big enough to go through the arenas cross the same way, both in a batch
and in the BLS requests it makes. Over REST with tritonclient."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from trioserve import Server, ServerConfig
from trioserve.testing import server_in_thread

from .._model_repository import write_model

# Each request's X goes to doubler twice, from two threads of a pool started by execute,
# which waits for both (the threads run with a copy of its context, as BLS from a thread
# requires): Y = 4 X. The pool's threads also ask whether the request was cancelled
# (another answer only the server gives).
FANOUT = """
import contextvars
from concurrent.futures import ThreadPoolExecutor
import triton_python_backend_utils as pb_utils

def doubled(request, x):
    if request.is_cancelled():
        raise pb_utils.TritonModelException("cancelled")
    answer = pb_utils.InferenceRequest(
        model_name="doubler", requested_output_names=["Y"], inputs=[pb_utils.Tensor("X", x)]
    ).exec()
    if answer.has_error():
        raise pb_utils.TritonModelException(answer.error().message())
    return pb_utils.get_output_tensor_by_name(answer, "Y").as_numpy()

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        with ThreadPoolExecutor(2) as pool:
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
                first, second = [
                    pool.submit(contextvars.copy_context().run, doubled, request, x)
                    for _ in range(2)
                ]
                y = first.result() + second.result()
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""

DOUBLER = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)])
            for r in requests
        ]
"""

CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("turns")
    for name, model in (("fanout", FANOUT), ("doubler", DOUBLER)):
        write_model(root, name, CONFIG, model)
    config = ServerConfig(
        model_repositories=[Path(root)], http_port=0, grpc_port=None,
        python_instance_mode="process",
    )  # fmt: skip
    with server_in_thread(config) as running:
        yield running


# 16 bytes ride in the frames; 256 KiB go through the arenas.
@pytest.mark.parametrize("count", [4, 64 * 1024], ids=["inline", "arena"])
def test_bls_from_the_models_own_threads_is_answered(server: Server, count: int) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=60.0)
    x = np.arange(count, dtype=np.float32)
    for _ in range(3):  # the reading turn passes back and forth
        tensor = httpclient.InferInput("X", [count], "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        y = client.infer("fanout", [tensor]).as_numpy("Y")
        np.testing.assert_array_equal(y, x * 4)
