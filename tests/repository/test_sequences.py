"""The sequence batcher end to end: the packaged sequence models driven the way
tritonclient's sequence examples drive them (HTTP and gRPC, one request at a time, and
three sequences interleaved on one stream), and Triton's sequence errors."""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig
from trioserve.models import TRITON_EXAMPLES
from trioserve.testing import server_in_thread

from .._model_repository import write_model

VALUES = [11, 7, 5, 3, 2, 0, 1]
TIMEOUT = 20  # seconds a test waits for one stream reply


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    config = ServerConfig(model_repositories=[TRITON_EXAMPLES], http_port=0, grpc_port=0)
    with server_in_thread(config) as running:
        yield running


@pytest.fixture
def grpc_url(grpc_server: str) -> Iterator[str]:
    config = ServerConfig(
        model_repositories=[TRITON_EXAMPLES], http_port=None, grpc_port=0, grpc_server=grpc_server
    )
    with server_in_thread(config) as running:
        yield f"127.0.0.1:{running.grpc_port}"


def sequences(dyna: bool) -> list[tuple[str, int | str, list[int]]]:
    """(model, correlation id, inputs) of the three sequences the examples send."""
    int_model = "simple_dyna_sequence" if dyna else "simple_sequence"
    string_model = "simple_string_dyna_sequence" if dyna else "simple_sequence"
    string_id = "1002" if dyna else str(uuid.uuid4())
    negated = [-v for v in VALUES]
    return [
        (int_model, 1000, [0, *VALUES]),
        (int_model, 1001, [100, *negated]),
        (string_model, string_id, [20, *negated]),
    ]


def expected(dyna: bool, correlation_id: int | str, inputs: list[int]) -> list[int]:
    """What the examples check: an integer sequence answers its input (plus 1 on the
    first request, plus the id on the last with dyna); the string one on the dyna models
    answers the running sum (plus the id on the last)."""
    answers = []
    total = 0
    for index, value in enumerate(inputs):
        last = index == len(inputs) - 1
        if dyna and isinstance(correlation_id, str):
            total += value
            answers.append(total + (int(correlation_id) if last else 0))
        else:
            answer = value + (1 if index == 0 else 0)
            answers.append(answer + (int(correlation_id) if dyna and last else 0))
    return answers


def tensor(module: Any, value: int) -> list[Any]:
    data = np.full([1, 1], value, dtype=np.int32)
    infer_input = module.InferInput("INPUT", list(data.shape), "INT32")
    infer_input.set_data_from_numpy(data)
    return [infer_input]


@pytest.mark.parametrize("dyna", [False, True])
@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_sync_sequences(server: Server, module: Any, dyna: bool) -> None:
    port = server.http_port if module is httpclient else server.grpc_port
    client = module.InferenceServerClient(f"127.0.0.1:{port}")
    for model, correlation_id, inputs in sequences(dyna):
        results = []
        for index, value in enumerate(inputs):
            result = client.infer(
                model,
                tensor(module, value),
                outputs=[module.InferRequestedOutput("OUTPUT")],
                sequence_id=correlation_id,
                sequence_start=index == 0,
                sequence_end=index == len(inputs) - 1,
            )
            results.append(int(result.as_numpy("OUTPUT")[0][0]))
        assert results == expected(dyna, correlation_id, inputs), (model, correlation_id)
    client.close()


@pytest.mark.parametrize("dyna", [False, True])
def test_interleaved_sequences_on_one_stream(grpc_url: str, dyna: bool) -> None:
    client = grpcclient.InferenceServerClient(grpc_url)
    replies: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put(error or result))
    sent = sequences(dyna)
    for model, correlation_id, inputs in sent:
        for index, value in enumerate(inputs):
            client.async_stream_infer(
                model,
                tensor(grpcclient, value),
                request_id=f"{correlation_id}_{index + 1}",
                outputs=[grpcclient.InferRequestedOutput("OUTPUT")],
                sequence_id=correlation_id,
                sequence_start=index == 0,
                sequence_end=index == len(inputs) - 1,
            )
    received: dict[str, list[int]] = {str(c): [] for _, c, _ in sent}
    for _ in range(sum(len(inputs) for _, _, inputs in sent)):
        reply = replies.get(timeout=TIMEOUT)
        assert not isinstance(reply, InferenceServerException), reply
        correlation_id = reply.get_response().id.rsplit("_", 1)[0]
        received[correlation_id].append(int(reply.as_numpy("OUTPUT")[0][0]))
    client.stop_stream()
    client.close()
    for _, correlation_id, inputs in sent:  # each sequence answered in its order
        assert received[str(correlation_id)] == expected(dyna, correlation_id, inputs)


@pytest.mark.parametrize("bad", [2**64 + 501, -501, 2**65])
def test_rest_refuses_correlation_ids_beyond_uint64(server: Server, bad: int) -> None:
    """A JSON number is not bounded as gRPC's uint64 is: 2**64 + 501 must not continue
    sequence 501."""
    url = f"http://127.0.0.1:{server.http_port}/v2/models/simple_sequence/infer"

    def infer(sequence_id: int, start: bool = False, end: bool = False) -> httpx.Response:
        parameters = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
        data = {"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}
        return httpx.post(url, json={"inputs": [data], "parameters": parameters}, timeout=20)

    assert infer(501, start=True).status_code == 200
    refused = infer(bad)
    assert refused.status_code == 400
    assert refused.json() == {
        "error": f"request parameter 'sequence_id' must be an unsigned 64-bit integer, not {bad}"
    }
    assert infer(501, end=True).status_code == 200  # sequence 501 went on untouched
    assert infer(2**64 - 1, start=True, end=True).status_code == 200  # the largest id


def test_triton_sequence_errors(server: Server) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")

    def infer(**sequence: Any) -> Any:
        return client.infer("simple_sequence", tensor(httpclient, 1), **sequence)

    with pytest.raises(InferenceServerException) as raised:
        infer()
    assert raised.value.status() == "400"
    assert raised.value.message() == (
        "inference request to model 'simple_sequence' must specify a non-zero or non-empty "
        "correlation ID"
    )
    with pytest.raises(InferenceServerException) as raised:
        infer(sequence_id=77)
    assert raised.value.message() == (
        "inference request for sequence 77 to model 'simple_sequence' must specify the START "
        "flag on the first request of the sequence"
    )
    infer(sequence_id=78, sequence_start=True, sequence_end=True)
    with pytest.raises(InferenceServerException) as raised:
        infer(sequence_id=78)  # ended
    assert "must specify the START flag" in raised.value.message()
    batch = httpclient.InferInput("INPUT", [2, 1], "INT32")
    batch.set_data_from_numpy(np.ones([2, 1], np.int32))
    with pytest.raises(InferenceServerException) as raised:
        client.infer("simple_sequence", [batch], sequence_id=79, sequence_start=True)
    assert raised.value.message() == (
        "inference request to model 'simple_sequence' must specify batch-size 1 due to "
        "requirements of sequence batcher"
    )
    with pytest.raises(InferenceServerException) as raised:
        client.infer(
            "simple_dyna_sequence", tensor(httpclient, 1), sequence_id="x", sequence_start=True
        )
    assert raised.value.message() == (
        "sequence batching control 'CORRID' of model 'simple_dyna_sequence' expects an "
        "integer correlation ID"
    )
    config = client.get_model_config("simple_sequence")
    assert config["sequence_batching"]["max_sequence_idle_microseconds"] == 1_000_000
    assert "direct" in config["sequence_batching"]
    assert "sequence" in client.get_server_metadata()["extensions"]
    metadata = client.get_model_metadata("simple_sequence")
    assert [i["name"] for i in metadata["inputs"]] == ["INPUT"]  # no control inputs
    client.close()


INSTANCE_STATE_MODEL = """
import httpx
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}  # this instance's sequences: Triton runs a sequence on one instance

    def execute(self, requests):
        responses = []
        for request in requests:
            key = request.correlation_id()
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.sums[key] = 0
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            self.sums[key] += int(value.sum())  # KeyError on another instance
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                total = self.sums.pop(key)
            else:
                total = self.sums[key]
            out = np.full(value.shape, total, np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
"""

INSTANCE_STATE_CONFIG = """
backend: "python"
max_batch_size: 2
sequence_batching {{ {strategy} }}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 3 kind: KIND_CPU }} ]
"""


@pytest.mark.parametrize(
    "strategy",
    ["direct { }", "oldest { max_candidate_sequences: 8 max_queue_delay_microseconds: 500 }"],
)
def test_a_sequence_stays_on_its_model_instance(tmp_path: Path, strategy: str) -> None:
    write_model(
        tmp_path,
        "instance_sum",
        INSTANCE_STATE_CONFIG.format(strategy=strategy),
        INSTANCE_STATE_MODEL,
    )
    config = ServerConfig(model_repositories=[tmp_path], http_port=None, grpc_port=0)
    with server_in_thread(config) as running:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{running.grpc_port}")
        replies: queue.Queue[Any] = queue.Queue()
        client.start_stream(callback=lambda result, error: replies.put(error or result))
        steps = 6
        for step in range(steps):  # eight sequences, interleaved
            for corrid in range(1, 9):
                client.async_stream_infer(
                    "instance_sum",
                    tensor(grpcclient, corrid),
                    request_id=f"{corrid}_{step}",
                    sequence_id=corrid,
                    sequence_start=step == 0,
                    sequence_end=step == steps - 1,
                )
        sums: dict[int, list[int]] = {c: [] for c in range(1, 9)}
        for _ in range(steps * 8):
            reply = replies.get(timeout=TIMEOUT)
            assert not isinstance(reply, InferenceServerException), reply
            sums[int(reply.get_response().id.split("_")[0])].append(
                int(reply.as_numpy("OUTPUT")[0][0])
            )
        client.stop_stream()
        client.close()
    assert sums == {c: [c * (k + 1) for k in range(steps)] for c in range(1, 9)}


BLS_SEQUENCE_MODEL = """
import httpx
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            inner = pb_utils.InferenceRequest(
                model_name="simple_dyna_sequence",
                inputs=[pb_utils.Tensor("INPUT", value)],
                requested_output_names=["OUTPUT"],
                correlation_id=request.correlation_id(),
                flags=request.flags(),
            ).exec()
            if inner.has_error():
                raise pb_utils.TritonModelException(inner.error().message())
            responses.append(pb_utils.InferenceResponse(inner.output_tensors()))
        return responses
"""

BLS_SEQUENCE_CONFIG = """
backend: "python"
max_batch_size: 8
sequence_batching { }
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def test_bls_requests_carry_their_sequence(tmp_path: Path) -> None:
    write_model(tmp_path, "relay", BLS_SEQUENCE_CONFIG, BLS_SEQUENCE_MODEL)
    config = ServerConfig(
        model_repositories=[tmp_path, TRITON_EXAMPLES], http_port=0, grpc_port=None
    )
    with server_in_thread(config) as running:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        answers = [
            int(
                client.infer(
                    "relay",
                    tensor(httpclient, value),
                    sequence_id=42,
                    sequence_start=index == 0,
                    sequence_end=index == 2,
                ).as_numpy("OUTPUT")[0][0]
            )
            for index, value in enumerate([5, 6, 7])
        ]
        client.close()
    assert answers == [5 + 1, 6, 7 + 42]  # simple_dyna_sequence saw START, then END and id
