"""Request rescheduling (``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``) in Python-backend
models with ``sequence_batching { iterative_sequence: true }``, in both instance modes,
with tritonclient: a decoupled countdown streams a response per execution over gRPC, a
non-decoupled model answers after its last execution over REST and gRPC, and the
configurations Triton does not accept fail with its words."""

from __future__ import annotations

import queue
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

TIMEOUT = 20  # seconds a test waits for one stream reply; fails a hung test

# Counts down from IN, one step per execution, in the manner of Triton's
# request-rescheduling example: each step answers (LEFT, the IN it still sees) and
# reschedules the request, the last one answers with the final flag.
COUNTDOWN = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.left = {}

    def execute(self, requests):
        for request in requests:
            start = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().flat[0])
            key = request.correlation_id()
            first = request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
            if first or key not in self.left:
                self.left[key] = start
            self.left[key] -= 1
            response = pb_utils.InferenceResponse([
                pb_utils.Tensor("LEFT", np.array([[self.left[key]]], np.int32)),
                pb_utils.Tensor("SEEN", np.array([[start]], np.int32)),
            ])
            sender = request.get_response_sender()
            if self.left.get(key, 0) > 0:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(response)
            else:
                del self.left[key]
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

COUNTDOWN_CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "LEFT" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "SEEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching { iterative_sequence: true }
model_transaction_policy { decoupled: true }
"""

# Takes STEPS executions, answering None for the rescheduled ones, then the sum and the
# difference of its inputs and how many executions it took.
ADDSUB = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.steps = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            key = request.correlation_id()
            self.steps[key] = self.steps.get(key, 0) + 1
            wanted = int(pb_utils.get_input_tensor_by_name(request, "STEPS").as_numpy().flat[0])
            if self.steps[key] < wanted:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
                continue
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            taken = np.array([[self.steps.pop(key)]], np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b),
                pb_utils.Tensor("TAKEN", taken),
            ]))
        return responses
"""

ADDSUB_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "STEPS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "TAKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching { iterative_sequence: true }
"""

# Reschedules every request and answers it all the same.
STUBBORN = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.zeros((1, 4), np.float32)),
                                            pb_utils.Tensor("OUTPUT1", np.zeros((1, 4), np.float32)),
                                            pb_utils.Tensor("TAKEN", np.zeros((1, 1), np.int32))])
                for _ in requests]
"""

NOT_ITERATIVE = ADDSUB_CONFIG.replace("sequence_batching { iterative_sequence: true }", "")
STREAM_NOT_ITERATIVE = COUNTDOWN_CONFIG.replace(
    "sequence_batching { iterative_sequence: true }", ""
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, instance_mode: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("rescheduling")
    write_model(root, "countdown", COUNTDOWN_CONFIG, COUNTDOWN)
    write_model(root, "countdown_plain", STREAM_NOT_ITERATIVE, COUNTDOWN)
    write_model(root, "addsub", ADDSUB_CONFIG, ADDSUB)
    write_model(root, "addsub_plain", NOT_ITERATIVE, ADDSUB)
    write_model(root, "stubborn", ADDSUB_CONFIG, STUBBORN)
    config = ServerConfig(
        model_repositories=[root], http_port=0, grpc_port=0, python_instance_mode=instance_mode
    )
    with server_in_thread(config) as running:
        yield running


def addsub_inputs(module: Any, steps: int) -> tuple[list[Any], np.ndarray[Any, Any]]:
    a = np.arange(4, dtype=np.float32)[np.newaxis]
    tensors = []
    for name, data, datatype in (
        ("INPUT0", a, "FP32"),
        ("INPUT1", a * 10, "FP32"),
        ("STEPS", np.array([[steps]], np.int32), "INT32"),
    ):
        tensor = module.InferInput(name, list(data.shape), datatype)
        tensor.set_data_from_numpy(data)
        tensors.append(tensor)
    return tensors, a


def client_of(server: Server, module: Any) -> Any:
    port = server.http_port if module is httpclient else server.grpc_port
    return module.InferenceServerClient(f"127.0.0.1:{port}")


def stats_of(client: Any, name: str) -> dict[str, Any]:
    stats = client.get_inference_statistics(name)
    return stats["model_stats"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["rest", "grpc"])
def test_a_non_decoupled_request_answers_after_its_last_execution(
    server: Server, module: Any
) -> None:
    client = client_of(server, module)
    inputs, a = addsub_inputs(module, steps=3)
    result = client.infer("addsub", inputs, request_id="r-7")
    assert result.as_numpy("OUTPUT0").tolist() == (a + a * 10).tolist()
    assert result.as_numpy("OUTPUT1").tolist() == (a - a * 10).tolist()
    assert result.as_numpy("TAKEN").tolist() == [[3]]
    response = result.get_response()
    assert (response["id"] if module is httpclient else response.id) == "r-7"
    client.close()


def test_decoupled_responses_flow_at_every_execution(server: Server) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    replies: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put(error or result))
    for request_id, start in (("five", 5), ("three", 3)):
        tensor = grpcclient.InferInput("IN", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[start]], np.int32))
        client.async_stream_infer("countdown", [tensor], request_id=request_id)
    received: dict[str, list[tuple[int, int]]] = {"five": [], "three": []}
    for _ in range(5 + 3):
        reply = replies.get(timeout=TIMEOUT)
        assert not isinstance(reply, InferenceServerException), reply
        seen = (int(reply.as_numpy("LEFT")[0][0]), int(reply.as_numpy("SEEN")[0][0]))
        received[reply.get_response().id].append(seen)
    # Each execution saw the request's own input; the stream stays open until the last.
    assert received == {"five": [(4, 5), (3, 5), (2, 5), (1, 5), (0, 5)],
                        "three": [(2, 3), (1, 3), (0, 3)]}  # fmt: skip
    client.stop_stream()
    # A request counts when its last execution ends, just after its final response left
    # (which the client may read first): ask until it has counted, a round trip at a time.
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    for _ in range(1000):
        stats = stats_of(http, "countdown")
        if stats["inference_stats"]["success"]["count"] >= 2:
            break
    assert stats["inference_stats"]["success"]["count"] == 2
    assert stats["execution_count"] >= 5  # the two requests' steps, batched together or not
    client.close()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["rest", "grpc"])
def test_rescheduling_without_iterative_sequences_fails_the_request(
    server: Server, module: Any
) -> None:
    client = client_of(server, module)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("addsub_plain", addsub_inputs(module, steps=2)[0])
    assert "model 'addsub_plain' rescheduled a request" in str(raised.value)
    assert "sequence_batching { iterative_sequence: true }" in str(raised.value)
    # A request it does not reschedule is answered.
    inputs, a = addsub_inputs(module, 1)
    assert client.infer("addsub_plain", inputs).as_numpy("OUTPUT0").tolist() == (a * 11).tolist()
    client.close()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["rest", "grpc"])
def test_a_response_for_a_rescheduled_request_fails_it(server: Server, module: Any) -> None:
    client = client_of(server, module)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("stubborn", addsub_inputs(module, steps=1)[0])
    assert (
        "Expected a None object in the execute function return list for reschduled request, "
        "got InferenceResponse"
    ) in str(raised.value)
    client.close()


def test_a_decoupled_model_without_iterative_sequences_ends_the_stream(server: Server) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    replies: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put(error or result))
    tensor = grpcclient.InferInput("IN", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[3]], np.int32))
    client.async_stream_infer("countdown_plain", [tensor])
    first = replies.get(timeout=TIMEOUT)  # sent before execute returned
    assert first.as_numpy("LEFT").tolist() == [[2]]
    error = replies.get(timeout=TIMEOUT)
    assert isinstance(error, InferenceServerException)
    assert "model 'countdown_plain' rescheduled a request" in str(error)
    client.stop_stream()
    client.close()
