"""A client's region whose object is shrunk under the server: no access to it can fault.

Any process that can open a POSIX shared-memory object can truncate it, and a page of a
mapping past the new end of the file faults on access (SIGBUS), which kills the process.
The server reads inputs and writes outputs through the object's descriptor instead, so
a shrunk object costs only the requests that meet its end: 400 / INVALID_ARGUMENT naming
the region. So does a model's own process, which reads its inputs from the region
itself (process mode; each test runs in both modes). Before, a model reading its input after a truncation killed the server
(exit -7): it runs in a subprocess here, so that such a fault ends it and fails the test
instead of ending pytest.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from .._model_repository import write_model

MODEL_CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
"""
# X + 1: reads every byte of its input. ``holds`` first says so on stderr and waits for a
# line on the server's stdin, so a test can shrink the object while the model holds X.
MODEL = """
import sys
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            if {holds}:
                print("the model holds its input", file=sys.stderr, flush=True)
                sys.stdin.readline()
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.as_numpy() + 1)]))
        return answers
"""
MODELS = {"reads": False, "holds": True, "other": False}

# What a hostile process does to an object it can open: shrink it to nothing and give it
# its size back, every millisecond (its pace, not a wait for anything), until killed.
TRUNCATE_IN_A_LOOP = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
size = int(sys.argv[2])
print("truncating", flush=True)
while True:
    os.ftruncate(fd, 0)
    os.ftruncate(fd, size)
    time.sleep(0.001)
"""
STORM_BYTES = 16 * 1024 * 1024
STORM_CLIENTS = 3
STORM_ROUNDS = 4  # inferences per client and protocol
SMALL = np.arange(4096, dtype=np.float32)  # four pages


@dataclass
class RunningServer:
    """``trioserve run`` in a subprocess: its ports, its stderr line by line, its stdin."""

    process: subprocess.Popen[str]
    lines: queue.Queue[str | None]
    urls: dict[str, str]

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The next stderr line matching ``pattern``: waits for a line, not for a time."""
        while (line := self.lines.get(timeout=120)) is not None:
            found = re.search(pattern, line)
            if found:
                return found
        raise AssertionError(
            f"the server ended (exit code {self.process.wait()}) without logging {pattern!r}"
        )

    def release_the_model(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def client(self, protocol: str) -> Any:
        return _module(protocol).InferenceServerClient(self.urls[protocol])


@pytest.fixture(scope="module", params=["thread", "process"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The models' instances in the server's threads, or each in a process of its own
    (which reads its inputs from the region itself)."""
    repository = tmp_path_factory.mktemp("repository")
    for name, holds in MODELS.items():
        write_model(repository, name, MODEL_CONFIG.format(name=name), MODEL.format(holds=holds))
    command = [
        sys.executable, "-m", "trioserve", "run", "--model-repository", str(repository),
        "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
        "--allow-metrics", "false", "--python-instance-mode", request.param,
    ]  # fmt: skip
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
    ) as process:  # closes the pipes on the way out
        lines: queue.Queue[str | None] = queue.Queue()

        def read_stderr() -> None:  # drained always: the server never blocks on a full pipe
            assert process.stderr is not None
            for line in process.stderr:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        running = RunningServer(process, lines, {})
        try:
            for protocol, kind in (("http", "HTTP"), ("grpc", "gRPC")):
                listening = rf"{kind} service listening on 127\.0\.0\.1:(\d+)"
                running.urls[protocol] = f"127.0.0.1:{running.wait_for(listening).group(1)}"
            running.wait_for("serving models")
            yield running
            assert process.poll() is None, f"the server died (exit code {process.returncode})"
        finally:
            process.terminate()
            process.wait(timeout=60)
            reader.join(timeout=60)


def _module(protocol: str) -> Any:
    return httpclient if protocol == "http" else grpcclient


def _register(server: RunningServer, name: str, key: str, byte_size: int) -> None:
    client = server.client("http")
    client.register_system_shared_memory(name, key, byte_size)
    client.close()


def _unregister(server: RunningServer) -> None:
    client = server.client("http")
    client.unregister_system_shared_memory()
    client.close()


def _truncate(key: str, size: int) -> None:
    fd = os.open(_path(key), os.O_RDWR)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _path(key: str) -> str:
    return f"/dev/shm/{key.lstrip('/')}"


def _infer(
    server: RunningServer,
    protocol: str,
    model: str,
    count: int,
    placed: tuple[str, int, int] | None,
    output: tuple[str, int, int] | None = None,
) -> Any:
    """``model`` on ``count`` FP32 elements placed (region, byte size, offset) in shared
    memory (or SMALL's on the wire without ``placed``), Y placed by ``output`` or not; on a
    client of its own (tritonclient's HTTP client belongs to the thread that made it)."""
    module = _module(protocol)
    x = module.InferInput("X", [count], "FP32")
    if placed is None:
        x.set_data_from_numpy(SMALL[:count])
    else:
        x.set_shared_memory(*placed)
    y = module.InferRequestedOutput("Y")
    if output is not None:
        y.set_shared_memory(*output)
    client = server.client(protocol)
    try:
        return client.infer(model, [x], outputs=[y])
    finally:
        client.close()


def _refusal(caught: InferenceServerException, protocol: str) -> str:
    """The message of a 400 / INVALID_ARGUMENT; AssertionError for any other failure."""
    expected = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
    assert caught.status() == expected, f"{protocol}: {caught}"
    return str(caught.message())


def test_a_region_truncated_and_restored_in_a_loop_during_inferences(server, regions):
    """Three clients infer 16 MiB through a region (input and output) while another process
    shrinks its object and restores it every millisecond: each request is answered or
    refused naming the region, and afterwards the server, the region and the other models
    serve as before."""
    handle, key = regions.create("storm", 2 * STORM_BYTES)
    data = np.arange(STORM_BYTES // 4, dtype=np.float32)
    count = data.size
    shm.set_shared_memory_region(handle, [data])
    placed, output = ("storm", STORM_BYTES, 0), ("storm", STORM_BYTES, STORM_BYTES)
    _register(server, "storm", key, 2 * STORM_BYTES)

    def client_loop() -> list[str]:
        outcomes = []
        for protocol in ("http", "grpc") * STORM_ROUNDS:
            try:
                _infer(server, protocol, "reads", count, placed, output)
                outcomes.append("answered")
            except InferenceServerException as caught:
                message = _refusal(caught, protocol)
                assert "shared memory region 'storm'" in message, message
                outcomes.append("refused")
        return outcomes

    hostile = [sys.executable, "-c", TRUNCATE_IN_A_LOOP, _path(key), str(2 * STORM_BYTES)]
    with subprocess.Popen(hostile, stdout=subprocess.PIPE, text=True) as truncator:
        try:
            assert truncator.stdout is not None and truncator.stdout.readline() == "truncating\n"
            with ThreadPoolExecutor(STORM_CLIENTS) as pool:
                loops = [pool.submit(client_loop) for _ in range(STORM_CLIENTS)]
                outcomes = [outcome for loop in loops for outcome in loop.result()]
        finally:
            truncator.kill()
    assert len(outcomes) == STORM_CLIENTS * STORM_ROUNDS * 2
    assert server.process.poll() is None

    # The object whole again, the region serves again, over both protocols.
    _truncate(key, 2 * STORM_BYTES)
    shm.set_shared_memory_region(handle, [data])
    for protocol in ("http", "grpc"):
        shm.set_shared_memory_region(handle, [np.zeros_like(data)], offset=STORM_BYTES)
        _infer(server, protocol, "reads", count, placed, output)
        written = shm.get_contents_as_numpy(handle, np.float32, [count], offset=STORM_BYTES)
        np.testing.assert_array_equal(written, data + 1)
        result = _infer(server, protocol, "other", 16, None)  # another model, on the wire
        np.testing.assert_array_equal(result.as_numpy("Y"), SMALL[:16] + 1)
    _unregister(server)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_input_whose_object_shrinks_while_the_model_holds_it(server, regions, protocol):
    """The model reads the bytes the region held when the request was decoded, and the
    object may be gone meanwhile: they are the request's own copy."""
    handle, key = regions.create("held", SMALL.nbytes)
    shm.set_shared_memory_region(handle, [SMALL])
    _register(server, "held", key, SMALL.nbytes)
    try:
        placed = ("held", SMALL.nbytes, 0)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_infer, server, protocol, "holds", SMALL.size, placed)
            server.wait_for("the model holds its input")
            _truncate(key, 0)
            server.release_the_model()
            np.testing.assert_array_equal(answer.result().as_numpy("Y"), SMALL + 1)
        assert server.process.poll() is None
    finally:
        _unregister(server)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_region_shrunk_before_an_inference(server, regions, protocol):
    """An input past the object's new end is refused naming the region and the bytes; once
    the object has its size back, the region serves again (the object's size is no state
    of the region)."""
    handle, key = regions.create("shrunk", SMALL.nbytes)
    shm.set_shared_memory_region(handle, [SMALL])
    _register(server, "shrunk", key, SMALL.nbytes)
    try:
        _truncate(key, 4096)
        placed = ("shrunk", 4096, 8192)  # the third page, wholly past the new end
        with pytest.raises(InferenceServerException) as caught:
            _infer(server, protocol, "reads", 1024, placed)
        assert _refusal(caught.value, protocol) == (
            f"input 'X': shared memory region 'shrunk' no longer holds its bytes 8192 to "
            f"12288: its object '{key}' was shrunk after registration"
        )
        result = _infer(server, protocol, "reads", 1024, ("shrunk", 4096, 0))  # still held
        np.testing.assert_array_equal(result.as_numpy("Y"), SMALL[:1024] + 1)
        _truncate(key, SMALL.nbytes)
        shm.set_shared_memory_region(handle, [SMALL])
        result = _infer(server, protocol, "reads", 1024, placed)
        np.testing.assert_array_equal(result.as_numpy("Y"), SMALL[2048:3072] + 1)
    finally:
        _unregister(server)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_output_region_shrunk_while_the_model_runs(server, regions, protocol):
    """An output whose window the object no longer holds is refused before anything is
    written, and the object stays as the client left it; grown back, it takes outputs."""
    handle, key = regions.create("out", SMALL.nbytes)
    _register(server, "out", key, SMALL.nbytes)
    try:
        output = ("out", SMALL.nbytes, 0)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_infer, server, protocol, "holds", SMALL.size, None, output)
            server.wait_for("the model holds its input")
            _truncate(key, 4096)
            server.release_the_model()
            with pytest.raises(InferenceServerException) as caught:
                answer.result()
        assert _refusal(caught.value, protocol) == (
            f"output 'Y': shared memory region 'out' no longer holds its bytes 0 to "
            f"{SMALL.nbytes}: its object '{key}' was shrunk after registration"
        )
        assert os.stat(_path(key)).st_size == 4096  # not grown back by a write
        _truncate(key, SMALL.nbytes)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_infer, server, protocol, "holds", SMALL.size, None, output)
            server.wait_for("the model holds its input")
            server.release_the_model()
            answer.result()
        written = shm.get_contents_as_numpy(handle, np.float32, [SMALL.size])
        np.testing.assert_array_equal(written, SMALL + 1)
    finally:
        _unregister(server)
