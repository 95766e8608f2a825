"""A faulty model fails only its own requests: the server, its other models, and the
model's next good request are served as before.

- A model that raises, returns no output, an output that cannot take its declared
  datatype, or no InferenceResponse: 500 / INTERNAL naming the model.
- An output of another shape than its config says is passed on as produced, as Triton
  does (it checks no output shape after inference).
- In a batch, a response that does not fit fails its own request, not the batch.
- A model that hangs: the python backend has no execution timeout (neither has Triton's);
  the client's timeout or gRPC deadline frees the client while the rest of the server
  keeps serving, and the model serves again once its execution returns.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig
from trioserve.models import reference_zoo
from trioserve.testing import server_in_thread

from ._model_repository import write_model

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: {batch}
{batching}
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""
# Its fault depends on X: 0 answers X, others misbehave each in one way.
FAULTY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        x = [int(array.flat[0]) for array in arrays]
        if 1 in x:
            raise RuntimeError("the model broke")
        if 5 in x:
            return ["not a response" for _ in requests]
        if 6 in x:
            return []
        answers = []
        for value, y in zip(x, arrays):
            if value == 2:
                outputs = []
            elif value == 3:
                outputs = [pb_utils.Tensor("Y", np.array(["three"], dtype=object))]
            elif value == 4:
                outputs = [pb_utils.Tensor("Y", np.array([4, 4, 4], np.int32))]
            else:
                outputs = [pb_utils.Tensor("Y", y)]
            answers.append(pb_utils.InferenceResponse(outputs))
        return answers
"""
# Blocks its worker thread until the test sets the event that the module RELEASE carries
# (the python backend runs the model in this process).
RELEASE = "trioserve_test_model_faults_release"
HANGS = f"""
import importlib
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        importlib.import_module({RELEASE!r}).released.wait(60)
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""
# Collects two requests into one batch (preferred size 2, a long delay otherwise).
BATCHING = "dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 30000000 }"


@pytest.fixture
def release() -> Iterator[threading.Event]:
    released = threading.Event()
    module = types.ModuleType(RELEASE)
    module.released = released  # type: ignore[attr-defined]
    sys.modules[RELEASE] = module
    yield released
    released.set()  # whatever happened, the hung thread may end
    del sys.modules[RELEASE]


@pytest.fixture
def server(tmp_path: Path, release: threading.Event) -> Iterator[Server]:
    root = tmp_path / "models"
    for name, code, batch, batching in (
        ("faulty", FAULTY, 0, ""),
        ("faulty_batched", FAULTY, 4, BATCHING),
        ("hangs", HANGS, 0, ""),
    ):
        write_model(root, name, CONFIG.format(name=name, batch=batch, batching=batching), code)
    config = ServerConfig(
        models=[m for m in reference_zoo() if m.name == "simple"],
        model_repositories=[root],
        http_port=0,
        grpc_port=0,
    )
    with server_in_thread(config) as running:
        yield running


def x_input(module: object, value: int, batched: bool = False) -> object:
    tensor = module.InferInput("X", [1, 1] if batched else [1], "INT32")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(np.array([[value]] if batched else [value], np.int32))
    return tensor


def simple_works(http: httpclient.InferenceServerClient) -> None:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(np.ones((1, 16), np.int32))
        inputs.append(tensor)
    assert http.infer("simple", inputs).as_numpy("OUTPUT0").tolist() == [[2] * 16]


FAULTS = {
    1: "RuntimeError: the model broke",
    2: "did not produce output 'Y'",
    3: "invalid literal for int() with base 10: 'three'",
    5: "not an InferenceResponse",
    6: "execute returned 0 responses for 1 requests",
}


@pytest.mark.parametrize("value", sorted(FAULTS))
def test_a_fault_fails_its_request_only(server: Server, value: int) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    with pytest.raises(InferenceServerException) as failed:
        http.infer("faulty", [x_input(httpclient, value)])
    assert failed.value.status() == "500"
    assert "'faulty" in failed.value.message()  # the model, or its instance 'faulty_0'
    assert FAULTS[value] in failed.value.message()
    with pytest.raises(InferenceServerException) as failed:
        grpc.infer("faulty", [x_input(grpcclient, value)])
    assert failed.value.status() == "StatusCode.INTERNAL"
    assert "'faulty" in failed.value.message()  # the model, or its instance 'faulty_0'
    # The same model's next good request, and the rest of the server.
    assert http.infer("faulty", [x_input(httpclient, 7)]).as_numpy("Y").tolist() == [7]
    assert grpc.infer("faulty", [x_input(grpcclient, 8)]).as_numpy("Y").tolist() == [8]
    simple_works(http)
    statistics = http.get_inference_statistics("faulty")["model_stats"][0]
    assert statistics["inference_stats"]["fail"]["count"] == 2
    assert statistics["inference_stats"]["success"]["count"] == 2
    http.close()
    grpc.close()


def test_an_output_of_another_shape_is_passed_on(server: Server) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    assert http.infer("faulty", [x_input(httpclient, 4)]).as_numpy("Y").tolist() == [4, 4, 4]
    http.close()


def test_a_bad_response_in_a_batch_fails_its_own_request(server: Server) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", concurrency=2)
    good = http.async_infer("faulty_batched", [x_input(httpclient, 9, batched=True)])
    bad = http.async_infer("faulty_batched", [x_input(httpclient, 2, batched=True)])
    assert good.get_result().as_numpy("Y").tolist() == [[9]]
    with pytest.raises(InferenceServerException, match="did not produce output 'Y'"):
        bad.get_result()
    statistics = http.get_inference_statistics("faulty_batched")["model_stats"][0]
    assert statistics["execution_count"] == 1  # the two ran as one batch
    http.close()


def test_a_hung_model_frees_its_clients_and_holds_up_no_one_else(
    server: Server, release: threading.Event
) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    with pytest.raises(InferenceServerException) as failed:
        grpc.infer("hangs", [x_input(grpcclient, 1)], client_timeout=0.5)
    assert failed.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    body = {"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [2]}]}
    url = f"http://127.0.0.1:{server.http_port}/v2/models/hangs/infer"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=0.5)
    # Meanwhile the rest of the server answers, over both protocols.
    simple_works(http)
    assert http.infer("faulty", [x_input(httpclient, 3 + 4)]).as_numpy("Y").tolist() == [7]
    assert grpc.infer("faulty", [x_input(grpcclient, 5 + 4)]).as_numpy("Y").tolist() == [9]
    assert grpc.is_server_ready() and http.is_model_ready("hangs")
    # Released, the model serves again.
    answered: list[object] = []
    waiting = threading.Thread(
        target=lambda: answered.append(httpx.post(url, json=body, timeout=30).json())
    )
    waiting.start()
    release.set()
    waiting.join(30)
    assert answered == [
        {
            "model_name": "hangs",
            "model_version": "1",
            "outputs": [{"name": "Y", "datatype": "INT32", "shape": [1], "data": [2]}],
        }
    ]
    http.close()
    grpc.close()
