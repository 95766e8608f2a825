"""Inputs a client placed in system shared memory reach a Python model that runs in a
process of its own by region and offset: the server hands the process the region's
descriptor (once) and reads none of the bytes; the process reads them itself, and lets
go of the descriptor once the region is unregistered and no request uses it. Over REST
and gRPC with tritonclient's shared-memory utilities, POSIX objects of its own.

The model answers, with X + 1, the shared-memory objects its process holds a descriptor
of when it runs: what the server handed it, and what it let go of."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig
from trioserve.testing import server_in_thread

from .._model_repository import write_model

# X + 1, and the /dev/shm objects the process holds open (and maps, if any). With a FIFO path in WAIT it
# first writes its pid into WAIT + ".started", then waits for a line on WAIT; with DIE,
# its process ends; with F64, Y is float64 (FP32 declared: the server converts it).
MODEL = """
import os
import numpy as np
import triton_python_backend_utils as pb_utils

def held():
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if path.startswith("/dev/shm/"):
            found.append(path.encode())
    with open("/proc/self/maps") as maps:  # a mapped object would show as "mapped:PATH"
        found += {("mapped:" + line.split()[-1]).encode() for line in maps if "/dev/shm/" in line}
    return np.array(sorted(found) or [b""], dtype=object)

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if pb_utils.get_input_tensor_by_name(request, "DIE") is not None:
                os._exit(3)
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT")
            if wait is not None:
                path = wait.as_numpy()[0].decode()
                with open(path + ".started", "w") as started:
                    started.write(str(os.getpid()))
                with open(path) as go:
                    go.readline()
            y = x + 1
            if pb_utils.get_input_tensor_by_name(request, "F64") is not None:
                y = y.astype(np.float64)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", y), pb_utils.Tensor("HELD", held())
            ]))
        return responses
"""

CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] },
        { name: "WAIT" data_type: TYPE_STRING dims: [ 1 ] optional: true },
        { name: "DIE" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
        { name: "F64" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
        { name: "FLAGS" data_type: TYPE_BOOL dims: [ -1 ] optional: true } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "HELD" data_type: TYPE_STRING dims: [ -1 ] } ]
parameters { key: "TRIOSERVE_INSTANCE_MODE" value { string_value: "process" } }
"""

CLIENTS = {"rest": httpclient, "grpc": grpcclient}
DATA = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: a large window


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("windows")
    write_model(root, "plus_one", CONFIG, MODEL)
    config = ServerConfig(model_repositories=[root], http_port=0, grpc_port=0)
    with server_in_thread(config) as running:
        yield running


def client_of(server: Server, protocol: str) -> Any:
    port = server.http_port if protocol == "rest" else server.grpc_port
    return CLIENTS[protocol].InferenceServerClient(f"127.0.0.1:{port}")


def infer(
    server: Server, protocol: str, placed: tuple[str, int, int] | None, count: int,
    wait: Path | None = None, die: bool = False, output: tuple[str, int, int] | None = None,
    f64: bool = False,
) -> tuple[np.ndarray[Any, Any] | None, set[str]]:  # fmt: skip
    """Y (None if ``output`` placed it in shared memory), and the objects the model's
    process held; X placed (region, bytes, offset) in shared memory, or DATA's first
    ``count`` on the wire."""
    module = CLIENTS[protocol]
    x = module.InferInput("X", [count], "FP32")
    if placed is None:
        x.set_data_from_numpy(DATA[:count])
    else:
        x.set_shared_memory(*placed)
    inputs = [x]
    if wait is not None:
        fifo = module.InferInput("WAIT", [1], "BYTES")
        fifo.set_data_from_numpy(np.array([str(wait).encode()], dtype=object))
        inputs.append(fifo)
    for flag, name in ((die, "DIE"), (f64, "F64")):
        if flag:
            inputs.append(module.InferInput(name, [1], "INT32"))
            inputs[-1].set_data_from_numpy(np.zeros(1, np.int32))
    outputs = [module.InferRequestedOutput("Y"), module.InferRequestedOutput("HELD")]
    if output is not None:
        outputs[0].set_shared_memory(*output)
    client = client_of(server, protocol)
    try:
        result = client.infer("plus_one", inputs, outputs=outputs)
    finally:
        client.close()
    held = {p.decode() for p in result.as_numpy("HELD").tolist() if p}
    return (None if output else result.as_numpy("Y")), held


def register(server: Server, name: str, key: str, byte_size: int) -> None:
    client = client_of(server, "rest")
    client.register_system_shared_memory(name, key, byte_size)
    client.close()


def unregister(server: Server, name: str) -> None:
    client = client_of(server, "rest")
    client.unregister_system_shared_memory(name)
    client.close()


@contextlib.contextmanager
def registered(
    server: Server, regions: Any, name: str, byte_size: int, data: Any = None
) -> Iterator[tuple[Any, str]]:
    """A new object of ``byte_size`` (``data`` at its start), registered as ``name`` while
    in use: its handle and key."""
    handle, key = regions.create(name, byte_size)
    if data is not None:
        shm.set_shared_memory_region(handle, [data])
    register(server, name, key, byte_size)
    try:
        yield handle, key
    finally:
        unregister(server, name)


def path_of(key: str) -> str:
    return f"/dev/shm/{key.lstrip('/')}"


@pytest.mark.parametrize("protocol", CLIENTS)
def test_inputs_are_handed_over_by_region_and_offset(server, regions, protocol):
    with registered(server, regions, "inputs", 3 * DATA.nbytes, DATA) as (handle, key):
        shm.set_shared_memory_region(handle, [DATA[::-1][:16].copy()], offset=2 * DATA.nbytes + 4)
        y, held = infer(server, protocol, ("inputs", DATA.nbytes, 0), DATA.size)
        np.testing.assert_array_equal(y, DATA + 1)
        assert path_of(key) in held  # the process reads the object itself
        assert not any(p.startswith("mapped:") for p in held)  # through its descriptor
        # The server holds its one descriptor of the region, no copy of it.
        assert regions.held(key) == 1
        # A small window, at an unaligned offset: the descriptor was handed over once.
        y, held = infer(server, protocol, ("inputs", 64, 2 * DATA.nbytes + 4), 16)
        np.testing.assert_array_equal(y, DATA[::-1][:16] + 1)
        assert regions.held(key) == 1
    assert regions.held(key) == 0
    y, held = infer(server, protocol, None, 16)  # after its unwindow frame, in order
    assert path_of(key) not in held
    np.testing.assert_array_equal(y, DATA[:16] + 1)


@pytest.mark.parametrize("protocol", CLIENTS)
def test_a_region_unregistered_and_shrunk_while_its_request_runs(
    server, regions, protocol, tmp_path
):
    """The model holds the copy its process read: the region may be unregistered and its
    object shrunk meanwhile. The process lets go of the region once the request is done,
    and a region registered again under the name is another region to it."""
    handle, key = regions.create("flight", DATA.nbytes)
    shm.set_shared_memory_region(handle, [DATA])
    register(server, "flight", key, DATA.nbytes)
    wait = tmp_path / "go"
    os.mkfifo(wait)
    os.mkfifo(f"{wait}.started")
    answer: list[Any] = []
    running = threading.Thread(
        target=lambda: answer.append(
            infer(server, protocol, ("flight", DATA.nbytes, 0), DATA.size, wait)
        )
    )
    running.start()
    try:
        with open(f"{wait}.started") as started:
            assert int(started.read()) > 0  # the model runs: its input was read
        unregister(server, "flight")
        os.truncate(path_of(key), 0)
        assert regions.held(key) == 1  # leased by the request in flight
    finally:
        with open(wait, "w") as go:
            go.write("go\n")
        running.join()
    y, held = answer[0]
    np.testing.assert_array_equal(y, DATA + 1)
    assert path_of(key) in held
    assert regions.held(key) == 0
    other, other_key = regions.create("again", 64)
    shm.set_shared_memory_region(other, [DATA[100:116]])
    register(server, "flight", other_key, 64)
    try:
        y, held = infer(server, protocol, ("flight", 64, 0), 16)
        np.testing.assert_array_equal(y, DATA[100:116] + 1)
        assert path_of(other_key) in held and path_of(key) not in held
    finally:
        unregister(server, "flight")


@pytest.mark.parametrize("protocol", CLIENTS)
def test_a_shrunk_region_refuses_only_its_request(server, regions, protocol):
    with registered(server, regions, "short", DATA.nbytes, DATA) as (_handle, key):
        os.truncate(path_of(key), 4096)
        with pytest.raises(InferenceServerException) as caught:
            infer(server, protocol, ("short", 8192, 4096), 2048)
        assert caught.value.status() == (
            "400" if protocol == "rest" else "StatusCode.INVALID_ARGUMENT"
        )
        assert caught.value.message() == (
            f"input 'X': shared memory region 'short' no longer holds its bytes 4096 to "
            f"12288: its object '{key}' was shrunk after registration"
        )
        y, _held = infer(server, protocol, ("short", 4096, 0), 1024)  # still held
        np.testing.assert_array_equal(y, DATA[:1024] + 1)


@pytest.mark.parametrize("protocol", CLIENTS)
def test_a_restarted_process_is_handed_the_region_again(server, regions, protocol):
    with registered(server, regions, "again", DATA.nbytes, DATA) as (_handle, key):
        _y, held = infer(server, protocol, ("again", DATA.nbytes, 0), DATA.size)
        assert path_of(key) in held
        with pytest.raises(InferenceServerException, match="exited with status 3"):
            infer(server, protocol, ("again", DATA.nbytes, 0), DATA.size, die=True)
        y, held = infer(server, protocol, ("again", DATA.nbytes, 0), DATA.size)
        np.testing.assert_array_equal(y, DATA + 1)
        assert path_of(key) in held  # the new process got its own descriptor


@pytest.mark.parametrize("protocol", CLIENTS)
def test_outputs_are_written_into_their_region_by_the_process(server, regions, protocol):
    """The process writes an output placed in a system region itself (it holds the
    region's descriptor); one of another datatype than declared is converted and written
    by the server; one larger than its window is refused and writes nothing."""
    with registered(server, regions, "outputs", DATA.nbytes + 64) as (handle, key):
        y, held = infer(server, protocol, None, 16, output=("outputs", 64, 0))
        assert y is None and path_of(key) in held
        written = shm.get_contents_as_numpy(handle, np.float32, [16])
        np.testing.assert_array_equal(written, DATA[:16] + 1)
        infer(server, protocol, None, 16, output=("outputs", 64, 64), f64=True)
        written = shm.get_contents_as_numpy(handle, np.float32, [16], offset=64)
        np.testing.assert_array_equal(written, DATA[:16] + 1)
        shm.set_shared_memory_region(handle, [np.full(16, 7, np.float32)])
        with pytest.raises(InferenceServerException) as caught:
            infer(server, protocol, None, 32, output=("outputs", 64, 0))
        assert caught.value.message() == (
            "shared memory size specified with the request for output 'Y' (64 bytes) "
            "should be at least 128 bytes to hold the results"
        )
        unchanged = shm.get_contents_as_numpy(handle, np.float32, [16])
        np.testing.assert_array_equal(unchanged, np.full(16, 7, np.float32))
        # 4 MiB in, 4 MiB out: neither crosses the server.
        shm.set_shared_memory_region(handle, [DATA])
        placed = ("outputs", DATA.nbytes, 0)
        infer(server, protocol, placed, DATA.size, output=placed)
        written = shm.get_contents_as_numpy(handle, np.float32, [DATA.size])
        np.testing.assert_array_equal(written, DATA + 1)


@pytest.mark.parametrize("protocol", CLIENTS)
def test_bool_inputs_are_checked_by_the_server(server, regions, protocol):
    """BOOL bytes must be 0 or 1: the server reads and checks them, as any input."""
    with registered(server, regions, "flags", 4, np.array([0, 1, 2, 1], np.uint8)):
        module = CLIENTS[protocol]
        x = module.InferInput("X", [1], "FP32")
        x.set_data_from_numpy(DATA[:1])
        flags = module.InferInput("FLAGS", [4], "BOOL")
        flags.set_shared_memory("flags", 4)
        client = client_of(server, protocol)
        try:
            with pytest.raises(InferenceServerException) as caught:
                client.infer("plus_one", [x, flags])
        finally:
            client.close()
        assert caught.value.message() == "input 'FLAGS': BOOL data must be bytes 0 or 1"
