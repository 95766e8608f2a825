"""Decoupled models: zero, one or many responses per request over ModelStreamInfer, with
the packaged ``repeat_int32`` driven the way tritonclient's streaming API drives it, on
both gRPC front ends; unary endpoints refuse them with Triton's message."""

from __future__ import annotations

import contextlib
import os
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig, UnsupportedError, serve
from trioserve.models import TRITON_EXAMPLES
from trioserve.testing import server_in_thread

from .._model_repository import write_model

TIMEOUT = 20  # seconds a test waits for one stream reply; fails a hung test


@pytest.fixture
def server(grpc_server: str, instance_mode: str) -> Iterator[Server]:
    config = ServerConfig(
        model_repositories=[TRITON_EXAMPLES],
        http_port=0,
        grpc_port=0,
        grpc_server=grpc_server,
        python_instance_mode=instance_mode,
    )
    with server_in_thread(config) as running:
        yield running


def repeat_inputs(values: list[int], delay_ms: int, wait_ms: int) -> list[Any]:
    count = len(values)
    tensors = []
    for name, data, datatype in (
        ("IN", np.array(values, dtype=np.int32), "INT32"),
        ("DELAY", np.full([count], delay_ms, dtype=np.uint32), "UINT32"),
        ("WAIT", np.array([wait_ms], dtype=np.uint32), "UINT32"),
    ):
        tensor = grpcclient.InferInput(name, list(data.shape), datatype)
        tensor.set_data_from_numpy(data)
        tensors.append(tensor)
    return tensors


class Stream:
    """A tritonclient stream whose callback results land in a queue."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.replies: queue.Queue[Any] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.replies.put(error or result))

    def next(self) -> Any:
        return self.replies.get(timeout=TIMEOUT)

    def close(self, *, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def test_repeat_int32_answers_each_element_in_order(server: Server) -> None:
    # What simple_grpc_custom_repeat.py does, with short delays.
    stream = Stream(f"127.0.0.1:{server.grpc_port}")
    values = list(range(100, 110))
    stream.client.async_stream_infer(
        model_name="repeat_int32",
        inputs=repeat_inputs(values, delay_ms=1, wait_ms=1),
        outputs=[grpcclient.InferRequestedOutput("OUT")],
    )
    received = [stream.next() for _ in values]
    assert not [r for r in received if isinstance(r, InferenceServerException)]
    assert [r.as_numpy("OUT").tolist() for r in received] == [[v] for v in values]
    # Only OUT was asked for; no response is final (the final flag comes alone).
    assert all(r.as_numpy("IDX") is None for r in received)
    assert [r.get_response().parameters["triton_final_response"].bool_param for r in received] == [
        False
    ] * 10
    stream.close()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    stats = client.get_inference_statistics("repeat_int32")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 1
    assert stats["execution_count"] == 1
    client.close()


def test_zero_responses_and_the_empty_final_response(server: Server) -> None:
    stream = Stream(f"127.0.0.1:{server.grpc_port}")
    stream.client.async_stream_infer(
        model_name="repeat_int32",
        inputs=repeat_inputs([], delay_ms=0, wait_ms=0),
        request_id="empty",
        enable_empty_final_response=True,
    )
    final = stream.next()
    assert final.get_response().id == "empty"
    assert final.get_response().parameters["triton_final_response"].bool_param
    assert final.get_response().outputs == []
    # Without asking for it, a request answered by the flag alone gets nothing; the
    # next request's response is the next reply.
    stream.client.async_stream_infer(
        model_name="repeat_int32", inputs=repeat_inputs([], delay_ms=0, wait_ms=0)
    )
    stream.client.async_stream_infer(
        model_name="repeat_int32", inputs=repeat_inputs([7], 0, 0), request_id="seven"
    )
    reply = stream.next()
    assert reply.get_response().id == "seven"
    assert reply.as_numpy("OUT").tolist() == [7]
    assert reply.as_numpy("IDX").tolist() == [0]
    stream.close()


def test_an_error_response_names_its_request(server: Server) -> None:
    stream = Stream(f"127.0.0.1:{server.grpc_port}")
    inputs = repeat_inputs([1, 2], delay_ms=0, wait_ms=0)
    inputs[1] = grpcclient.InferInput("DELAY", [1], "UINT32")
    inputs[1].set_data_from_numpy(np.zeros([1], np.uint32))
    stream.client.async_stream_infer(model_name="repeat_int32", inputs=inputs, request_id="bad")
    error = stream.next()
    assert isinstance(error, InferenceServerException)
    assert "expected DELAY to have 2 elements, got 1" in error.message()
    stream.close()


def test_unary_endpoints_refuse_decoupled_models(server: Server) -> None:
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    with pytest.raises(InferenceServerException) as raised:
        grpc.infer("repeat_int32", repeat_inputs([1], 0, 0))
    assert raised.value.status() == "StatusCode.UNIMPLEMENTED"
    assert raised.value.message() == (
        "ModelInfer RPC doesn't support models with decoupled transaction policy"
    )
    grpc.close()
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.ones([1], np.int32))
    with pytest.raises(InferenceServerException) as raised:
        http.infer("repeat_int32", [tensor])
    assert raised.value.status() == "501"
    assert raised.value.message() == (
        "HTTP end point doesn't support models with decoupled transaction policy"
    )
    config = http.get_model_config("repeat_int32")
    assert config["model_transaction_policy"] == {"decoupled": True}
    http.close()


SENDER_MODEL = """
import hashlib
import os
import socket
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

# Shared by the model's two instances, threads or processes: the watcher of the
# cancelled request makes this file, then tells the waiting request by a datagram to an
# abstract socket named for it (if that one is already waiting).
CANCELLED = os.path.join(os.path.dirname(__file__), "cancelled")
WAITER = "\\0sender-" + hashlib.sha256(CANCELLED.encode()).hexdigest()[:16]


def saw_cancelled(timeout):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waiter:
        waiter.bind(WAITER)
        if os.path.exists(CANCELLED):  # told before this one listened
            return True
        waiter.settimeout(timeout)
        try:
            waiter.recv(1)
        except socket.timeout:
            return False
        return True


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0]
            sender = request.get_response_sender()
            out = pb_utils.Tensor("OUT", np.array([mode], np.int32))
            if mode == 0:  # one response, final with it
                sender.send(pb_utils.InferenceResponse([out]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                try:
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except pb_utils.TritonModelException:
                    pass  # a second final is refused
                else:
                    raise AssertionError("a second final flag was accepted")
            elif mode == 1:  # answer, then wait for the client to cancel
                sender.send(pb_utils.InferenceResponse([out]))
                threading.Thread(target=self._watch, args=(request, sender)).start()
            elif mode == 2:
                return [pb_utils.InferenceResponse([out])]  # not allowed when decoupled
            else:  # state whether the earlier request saw its cancellation
                seen = np.array([int(saw_cancelled(10))], np.int32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", seen)]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _watch(self, request, sender):
        while not request.is_cancelled():  # the backend's API is a poll
            threading.Event().wait(0.001)
        open(CANCELLED, "w").close()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as teller:
            try:
                teller.sendto(b"!", WAITER)
            except OSError:  # nobody waits yet: the file tells
                pass
"""

SENDER_CONFIG = """
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "MODE" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


@pytest.fixture
def sender_server(tmp_path: Path, grpc_server: str, instance_mode: str) -> Iterator[Server]:
    write_model(tmp_path, "sender", SENDER_CONFIG, SENDER_MODEL)
    config = ServerConfig(
        model_repositories=[tmp_path],
        http_port=0,
        grpc_port=0,
        grpc_server=grpc_server,
        python_instance_mode=instance_mode,
    )
    with server_in_thread(config) as running:
        yield running


def mode_input(mode: int) -> list[Any]:
    tensor = grpcclient.InferInput("MODE", [1], "INT32")
    tensor.set_data_from_numpy(np.array([mode], np.int32))
    return [tensor]


def test_final_with_a_response_and_returning_responses(sender_server: Server) -> None:
    stream = Stream(f"127.0.0.1:{sender_server.grpc_port}")
    stream.client.async_stream_infer(model_name="sender", inputs=mode_input(0))
    reply = stream.next()
    assert reply.as_numpy("OUT").tolist() == [0]
    assert reply.get_response().parameters["triton_final_response"].bool_param
    stream.client.async_stream_infer(model_name="sender", inputs=mode_input(2))
    error = stream.next()
    assert isinstance(error, InferenceServerException)
    assert "is decoupled: execute must return None" in error.message()
    stream.close()


def test_cancelling_the_stream_cancels_the_request(sender_server: Server) -> None:
    url = f"127.0.0.1:{sender_server.grpc_port}"
    stream = Stream(url)
    stream.client.async_stream_infer(model_name="sender", inputs=mode_input(1))
    assert stream.next().as_numpy("OUT").tolist() == [1]
    stream.close(cancel=True)
    other = Stream(url)
    other.client.async_stream_infer(model_name="sender", inputs=mode_input(3))
    assert other.next().as_numpy("OUT").tolist() == [1]  # the model saw it cancelled
    other.close()


async def test_in_process_inference_refuses_decoupled_models(nursery: trio.Nursery) -> None:
    config = ServerConfig(model_repositories=[TRITON_EXAMPLES], http_port=None, grpc_port=None)
    server = await nursery.start(serve, config)
    inputs = {"IN": np.ones([1], np.int32), "DELAY": np.zeros([1], np.uint32)}
    inputs["WAIT"] = np.zeros([1], np.uint32)
    with pytest.raises(UnsupportedError) as raised:
        await server.infer("repeat_int32", inputs)
    assert raised.value.message == (
        "Server.infer doesn't support models with decoupled transaction policy"
    )


SIZES_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            out = pb_utils.Tensor("OUT", np.arange(count, dtype=np.float32))
            request.get_response_sender().send(
                pb_utils.InferenceResponse([out]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        return None
"""

SIZES_CONFIG = """
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _mapped_instance_segments() -> int:
    """This process's descriptors of Python-backend arenas' segments (the server maps
    an instance process's segments as their first blocks reach it)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(
                "/memfd:trioserve-python-backend"
            )
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_decoupled_response_sends_small_outputs_in_its_frame(tmp_path: Path) -> None:
    write_model(tmp_path, "sizes", SIZES_CONFIG, SIZES_MODEL)
    config = ServerConfig(
        model_repositories=[tmp_path], http_port=None, grpc_port=0, python_instance_mode="process"
    )
    with server_in_thread(config) as running:
        stream = Stream(f"127.0.0.1:{running.grpc_port}")
        mapped = _mapped_instance_segments()
        for count in (1, 1000, 64 * 1024):  # 4 bytes, 4 KiB inline; 256 KiB in a block
            tensor = grpcclient.InferInput("COUNT", [1], "INT32")
            tensor.set_data_from_numpy(np.array([count], np.int32))
            stream.client.async_stream_infer(model_name="sizes", inputs=[tensor])
            reply = stream.next()
            assert np.array_equal(reply.as_numpy("OUT"), np.arange(count, dtype=np.float32))
            if count == 1000:  # no segment of the instance's arena mapped for either yet
                assert _mapped_instance_segments() == mapped
        assert _mapped_instance_segments() == mapped + 1
        stream.close()
