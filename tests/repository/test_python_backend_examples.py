"""Python-backend models written the way Triton's own examples write them: async BLS with
``asyncio.gather``, decoupled models checking their transaction policy, decoupled BLS
(sync and async), BLS to a model named by a STRING input, every public name of Triton's
``triton_python_backend_utils``, a failing ``execute`` (log line and client error),
auto-complete's fields, and the server's start-up policy (exit on error, strict
readiness); over REST and gRPC with tritonclient."""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig
from trioserve.repository import _pb_utils
from trioserve.testing import server_in_thread

from .._model_repository import write_files, write_model

TIMEOUT = 20  # seconds a test waits for one stream reply; fails a hung test

# Both requests of a pair must be in the model at once: BLS calls made one after the
# other fail to meet (after a timeout). The two instances meet whether they are threads
# of the server or processes of their own: each arrival takes the next ticket (a file
# made exclusively: 0 and 1 are a pair, 2 and 3...), binds a datagram socket named by
# it, and waits for a datagram from its partner's, sending its own once the partner's
# socket is there (the later of the two always finds the earlier one bound).
PAIRED = """
import hashlib
import os
import socket
import numpy as np
import triton_python_backend_utils as pb_utils

TICKETS = os.path.join(os.path.dirname(__file__), "tickets")
# Abstract socket names (no file, no path length limit), unique to this model folder.
PREFIX = "\\0paired-" + hashlib.sha256(TICKETS.encode()).hexdigest()[:16] + "-"

def meet():
    os.makedirs(TICKETS, exist_ok=True)
    number = 0
    while True:
        try:
            os.close(os.open(os.path.join(TICKETS, str(number)), os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            number += 1
    partner = PREFIX + str(number ^ 1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as me:
        me.bind(PREFIX + str(number))
        me.settimeout(10)
        try:
            me.sendto(b"here", partner)
            sent = True
        except OSError:  # not bound yet: it finds this one bound and sends first
            sent = False
        try:
            me.recv(1)
        except socket.timeout:
            raise TimeoutError("the other request of the pair never came") from None
        if not sent:
            me.sendto(b"here", partner)

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            meet()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return responses
"""

DOUBLER = PAIRED.replace("            meet()\n", "")

PAIRED_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

# Decoupled: IN responses counting IN down from the thread it starts, then the final
# flag alone.
SQUARE = """
import json
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("square must be decoupled")

    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            threading.Thread(target=self.answer, args=(request.get_response_sender(), count)).start()
        return None

    def answer(self, sender, count):
        for left in range(count, 0, -1):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([left], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

SQUARE_CONFIG = """
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Async BLS: the model named by MODEL_NAME gets two requests at once; square's stream is
# read with ``for`` and with ``async for``. An async initialize runs on the loop that
# runs execute: the instance's own.
ASYNC_BLS = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def initialize(self, args):
        await asyncio.sleep(0)
        self.loop = asyncio.get_running_loop()

    async def execute(self, requests):
        if asyncio.get_running_loop() is not self.loop:
            raise pb_utils.TritonModelException("execute runs on another loop")
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]
            count = pb_utils.get_input_tensor_by_name(request, "IN")
            pair = [
                pb_utils.InferenceRequest(
                    model_name=name,
                    inputs=[pb_utils.Tensor("X", np.array([i], np.int32))],
                    requested_output_names=["Y"],
                ).async_exec()
                for i in (3, 4)
            ]
            streams = [
                pb_utils.InferenceRequest(
                    model_name="square", inputs=[count], requested_output_names=["OUT"]
                ).async_exec(decoupled=True)
                for _ in range(2)
            ]
            answers = await asyncio.gather(*pair)
            first, second = await asyncio.gather(*streams)
            total = 0
            for response in first:
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                if response.output_tensors():
                    total += int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])
            async for response in second:
                if response.output_tensors():
                    total += int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])
            for answer in answers:
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
            doubled = [int(pb_utils.get_output_tensor_by_name(a, "Y").as_numpy()[0]) for a in answers]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("PAIR", np.array(doubled, np.int32)),
                pb_utils.Tensor("SUM", np.array([total], np.int32)),
            ]))
        return responses
"""

BLS_CONFIG = """
backend: "python"
input [
  { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [
  { name: "PAIR" data_type: TYPE_INT32 dims: [ 2 ] },
  { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] }
]
"""

# Sync BLS: square's stream read with exec(decoupled=True); the unknown model's error
# comes back as a response carrying it.
SYNC_BLS = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]
            count = pb_utils.get_input_tensor_by_name(request, "IN")
            stream = pb_utils.InferenceRequest(
                model_name="square", inputs=[count], requested_output_names=["OUT"]
            ).exec(decoupled=True)
            total = sum(
                int(pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()[0])
                for r in stream if r.output_tensors()
            )
            answer = pb_utils.InferenceRequest(
                model_name=name, inputs=[pb_utils.Tensor("X", np.array([5], np.int32))],
                requested_output_names=["Y"],
            ).exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            y = int(pb_utils.get_output_tensor_by_name(answer, "Y").as_numpy()[0])
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("PAIR", np.array([y, y], np.int32)),
                pb_utils.Tensor("SUM", np.array([total], np.int32)),
            ]))
        return responses
"""

FAILING = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return self.fail()

    def fail(self):
        raise ValueError("the model gave up")
"""
FAILING_LINE = 9  # the raise, in the dedented file

FAILING_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

AUTO = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "X", "data_type": "TYPE_INT32", "dims": [1]})
        config.add_output({"name": "Y", "data_type": "TYPE_INT32", "dims": [1]})
        config.set_max_batch_size(4)
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "X")])
                for r in requests]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, instance_mode: str) -> Iterator[Server]:
    root = write_files(
        tmp_path_factory.mktemp("examples"),
        {
            "paired/config.pbtxt": PAIRED_CONFIG,
            "paired/1/model.py": PAIRED,
            "doubler/config.pbtxt": PAIRED_CONFIG,
            "doubler/1/model.py": DOUBLER,
            "square/config.pbtxt": SQUARE_CONFIG,
            "square/1/model.py": SQUARE,
            "async_bls/config.pbtxt": BLS_CONFIG,
            "async_bls/1/model.py": ASYNC_BLS,
            "sync_bls/config.pbtxt": BLS_CONFIG,
            "sync_bls/1/model.py": SYNC_BLS,
            "failing/config.pbtxt": FAILING_CONFIG,
            "failing/1/model.py": FAILING,
            "auto/1/model.py": AUTO,
        },
    )
    config = ServerConfig(
        model_repositories=[root], http_port=0, grpc_port=0, python_instance_mode=instance_mode
    )
    with server_in_thread(config) as running:
        yield running


def bls_inputs(module: object, model: bytes, count: int) -> list[object]:
    name = module.InferInput("MODEL_NAME", [1], "BYTES")  # type: ignore[attr-defined]
    name.set_data_from_numpy(np.array([model], dtype=object))
    number = module.InferInput("IN", [1], "INT32")  # type: ignore[attr-defined]
    number.set_data_from_numpy(np.array([count], np.int32))
    return [name, number]


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["rest", "grpc"])
@pytest.mark.parametrize(
    ("model", "target", "pair"),
    # async: both BLS calls to paired met at its barrier, so they ran at once.
    [("async_bls", b"paired", [6, 8]), ("sync_bls", b"doubler", [10, 10])],
)
def test_bls_by_a_bytes_name_with_decoupled_streams(
    server: Server, module: object, model: str, target: bytes, pair: list[int]
) -> None:
    port = server.http_port if module is httpclient else server.grpc_port
    client = module.InferenceServerClient(f"127.0.0.1:{port}")  # type: ignore[attr-defined]
    result = client.infer(model, bls_inputs(module, target, 3))
    assert result.as_numpy("PAIR").tolist() == pair
    streams = 2 if model == "async_bls" else 1  # each read square's 3, 2, 1 and final
    assert result.as_numpy("SUM").tolist() == [streams * (3 + 2 + 1)]
    with pytest.raises(InferenceServerException, match="unknown model: 'nowhere'"):
        client.infer(model, bls_inputs(module, b"nowhere", 1))
    client.close()


# Every public name of Triton's module: its Python file, and what its stub adds to it.
TRITON_PUBLIC_NAMES = [
    # triton_python_backend_utils.py
    "TRITON_STRING_TO_NUMPY", "serialize_byte_tensor", "deserialize_bytes_tensor",
    "get_input_tensor_by_name", "get_output_tensor_by_name", "get_input_config_by_name",
    "get_output_config_by_name", "using_decoupled_model_transaction_policy",
    "triton_to_numpy_type", "numpy_to_triton_type", "triton_string_to_numpy", "ModelConfig",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START", "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL", "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    # set by the stub from its C++ module
    "TritonError", "TritonModelException", "Tensor", "InferenceRequest", "InferenceResponse",
    "Logger", "PreferredMemory", "TRITONSERVER_MEMORY_GPU", "TRITONSERVER_MEMORY_CPU",
    "MetricFamily", "load_model", "unload_model", "is_model_ready", "get_model_dir",
    # classes its README documents, reached through the objects above
    "InferenceResponseSender", "ResponseIterator", "InferenceTrace", "Metric",
]  # fmt: skip


def test_every_public_name_of_tritons_module_exists() -> None:
    missing = [name for name in TRITON_PUBLIC_NAMES if not hasattr(_pb_utils, name)]
    assert missing == []
    pb = _pb_utils
    for kind in ("INFO", "WARNING", "ERROR", "VERBOSE"):
        assert getattr(pb.Logger, kind) == getattr(pb.Logger.LogLevel, kind)
    for kind in ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "CANCELLED"):
        assert isinstance(getattr(pb.TritonError, kind), int)
    assert [pb.MetricFamily.COUNTER, pb.MetricFamily.GAUGE] == [pb.COUNTER, pb.GAUGE]
    # Triton's numbers for datatypes, both ways; BYTES is 13.
    assert pb.numpy_to_triton_type(np.float32) == 11
    assert pb.triton_to_numpy_type(13) is np.object_
    assert pb.TRITON_STRING_TO_NUMPY["TYPE_INT8"] is np.int8
    assert pb.Tensor("t", np.zeros(2, np.int64)).triton_dtype() == 9
    words = np.array([b"a", b"", b"xyz"], dtype=object)
    packed = pb.serialize_byte_tensor(words)
    assert packed == b"\x01\x00\x00\x00a\x00\x00\x00\x00\x03\x00\x00\x00xyz"
    assert pb.deserialize_bytes_tensor(packed).tolist() == [b"a", b"", b"xyz"]
    config = {"model_transaction_policy": {"decoupled": True}}
    assert pb.using_decoupled_model_transaction_policy(config)
    assert not pb.using_decoupled_model_transaction_policy({})
    request = pb.InferenceRequest(model_name=b"m", inputs=[], requested_output_names=[])
    assert request.model_name() == "m"
    request.set_release_flags(pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    assert request._rescheduled()  # acted on once execute returns (test_request_rescheduling)
    request.set_release_flags(pb.TRITONSERVER_REQUEST_RELEASE_ALL)
    assert not request._rescheduled()
    with pytest.raises(pb.TritonModelException, match="only from a model's"):
        request.exec()  # not from a model: no server to reach


def test_a_decoupled_model_checking_its_policy_streams(server: Server) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    replies: queue.Queue[object] = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put(error or result))
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([3], np.int32))
    client.async_stream_infer("square", [tensor], enable_empty_final_response=True)
    received = [replies.get(timeout=TIMEOUT) for _ in range(4)]
    assert [r.as_numpy("OUT").tolist() for r in received[:3]] == [[3], [2], [1]]  # type: ignore[attr-defined]
    final = received[3].get_response()  # type: ignore[attr-defined]
    assert final.parameters["triton_final_response"].bool_param
    client.stop_stream()
    client.close()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["rest", "grpc"])
def test_a_failing_execute_is_logged_and_told_with_its_line(
    server: Server, module: object, caplog: pytest.LogCaptureFixture
) -> None:
    port = server.http_port if module is httpclient else server.grpc_port
    client = module.InferenceServerClient(f"127.0.0.1:{port}")  # type: ignore[attr-defined]
    tensor = module.InferInput("X", [1], "INT32")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(np.array([1], np.int32))
    with (
        caplog.at_level(logging.ERROR, logger="trioserve.python_backend"),
        pytest.raises(InferenceServerException) as raised,
    ):
        client.infer("failing", [tensor])
    failed = "Failed to process the request(s) for model instance 'failing_0', message: "
    frames = (
        "ValueError: the model gave up\n\nAt:\n"
        f"  {{file}}({FAILING_LINE}): fail\n  {{file}}({FAILING_LINE - 3}): execute\n"
    )
    # The client reads the file by its place in the repository, the log by its path.
    assert raised.value.message() == failed + frames.format(file="failing/1/model.py")
    model_file = Path(server.config.model_repositories[0]) / "failing" / "1" / "model.py"
    logged = [r.getMessage() for r in caplog.records if r.name == "trioserve.python_backend"]
    expected = f"model 'failing' version 1: {failed}{frames.format(file=model_file)}"
    assert logged == [expected]  # once, for the batch
    client.close()


def test_auto_complete_fills_what_triton_fills(server: Server) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    config = client.get_model_config("auto")
    assert config["max_batch_size"] == 4
    assert config["dynamic_batching"]["preferred_batch_size"] == [4]
    assert config["default_model_filename"] == "model.py"
    optimization = config["optimization"]
    assert optimization["input_pinned_memory"] == {"enable": True}
    assert optimization["output_pinned_memory"] == {"enable": True}
    assert optimization["priority"] == "PRIORITY_DEFAULT"
    client.close()


BROKEN = {"broken/config.pbtxt": FAILING_CONFIG, "broken/1/model.py": "import no_such_module\n"}


def test_exit_on_error_stops_trioserve_run(tmp_path: Path) -> None:
    root = write_files(tmp_path, BROKEN)
    command = [sys.executable, "-m", "trioserve", "run", "--model-repository", str(root)]
    command += ["--http-port", "0", "--grpc-port", "0", "--allow-metrics", "false"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode != 0
    assert "failed to load 'broken'" in finished.stderr
    assert "no_such_module" in finished.stderr
    assert finished.stderr.endswith(
        "error: creating server: Internal - failed to load all models\n"
    )


@pytest.mark.parametrize("strict", [True, False])
def test_strict_readiness_with_a_broken_model(tmp_path: Path, strict: bool) -> None:
    root = write_files(tmp_path, BROKEN)
    write_model(root, "doubler", PAIRED_CONFIG, DOUBLER)
    config = ServerConfig(
        model_repositories=[root],
        http_port=0,
        grpc_port=0,
        exit_on_error=False,
        strict_readiness=strict,
    )
    with server_in_thread(config) as server:
        rest = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        assert rest.is_server_live() and grpc.is_server_live()
        assert rest.is_server_ready() is not strict
        assert grpc.is_server_ready() is not strict
        assert rest.is_model_ready("doubler")
        rest.close()
        grpc.close()
