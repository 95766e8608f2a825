"""CUDA shared memory end to end over both front ends, and a GPU model's outputs over
ModelStreamInfer, on a fake device (``fake_cupy.py``).

The server and tritonclient are real; only the GPU is modelled, on the host. Besides the
values, the tests check where the device work ran: opening a handle and every copy to,
from or between device memory in a worker thread, never on the event loop's thread
(which, the server running in the test's trio run, is the test's own).
"""

from __future__ import annotations

import base64
import gc
import queue
import threading
from collections import Counter
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

import trioserve
from trioserve import Server, ServerConfig, TensorSpec
from trioserve.models import reference_zoo

PROTOCOLS = ["http", "grpc", "grpc-grpclib"]  # gRPC on each front end
# What each error kind looks like to tritonclient: HTTP status, gRPC status code.
STATUS = {
    "INVALID_ARG": ("400", "StatusCode.INVALID_ARGUMENT"),
    "ALREADY_EXISTS": ("400", "StatusCode.ALREADY_EXISTS"),
}
TIMEOUT = 30  # seconds; generous for a loaded machine, still fails a hung test
VALUES = np.arange(64, dtype=np.float32)


def _doubling_on_the_device(fake_cupy: ModuleType) -> trioserve.Model:
    """A GPU model that takes its input from the host and leaves its output on the device."""

    @trioserve.model(
        name="double_on_device",
        inputs=[TensorSpec("INPUT0", "FP32", [-1])],
        outputs=[TensorSpec("OUTPUT0", "FP32", [-1])],
        device="gpu",
    )
    def double_on_device(INPUT0: np.ndarray[Any, Any]) -> dict[str, Any]:
        return {"OUTPUT0": fake_cupy.asarray(INPUT0) * 2}

    return double_on_device


@pytest.fixture
def protocol() -> str:
    """What a test that names no protocol of its own serves gRPC with."""
    return "grpc"


@pytest.fixture
async def server(
    fake_cupy: ModuleType, double_gpu: trioserve.Model, nursery: trio.Nursery, protocol: str
) -> Server:
    models = [*reference_zoo(), double_gpu, _doubling_on_the_device(fake_cupy)]
    grpc_server = "grpclib" if protocol.endswith("-grpclib") else "trio"
    config = ServerConfig(models=models, http_port=0, grpc_port=0, grpc_server=grpc_server)
    started: Server = await nursery.start(trioserve.serve, config)
    return started


class Client:
    """tritonclient over one protocol; each call on a client of its own, made and used in
    one worker thread (tritonclient's HTTP client belongs to the thread that made it)."""

    def __init__(self, protocol: str, server: Server) -> None:
        protocol = protocol.removesuffix("-grpclib")
        self.protocol = protocol
        self.module: Any = httpclient if protocol == "http" else grpcclient
        port = server.http_port if protocol == "http" else server.grpc_port
        self.url = f"127.0.0.1:{port}"

    async def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        def in_thread() -> Any:
            client = self.module.InferenceServerClient(self.url)
            try:
                return getattr(client, method)(*args, **kwargs)
            finally:
                client.close()

        with trio.fail_after(TIMEOUT):
            return await trio.to_thread.run_sync(in_thread, abandon_on_cancel=True)

    async def expect_error(self, kind: str, method: str, *args: Any) -> str:
        with pytest.raises(InferenceServerException) as caught:
            await self(method, *args)
        http_status, grpc_status = STATUS[kind]
        assert caught.value.status() == (http_status if self.protocol == "http" else grpc_status)
        return str(caught.value.message())

    def written_to(self, result: Any, name: str) -> dict[str, Any]:
        """Where the response says output ``name`` was written (its parameters)."""
        output = result.get_output(name)
        if self.protocol == "http":
            return dict(output["parameters"])
        return {
            k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in output.parameters.items()
        }

    async def cuda_status(self) -> dict[str, dict[str, Any]]:
        """Registered CUDA regions by name: {name: {name, device_id, byte_size}}."""
        reply = await self("get_cuda_shared_memory_status")
        if self.protocol == "http":
            return {region["name"]: region for region in reply}
        return {
            name: {"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size}
            for name, r in reply.regions.items()
        }


def _exported(fake: ModuleType, data: bytes) -> tuple[int, bytes]:
    """Device memory holding ``data``, as a client allocates it: its address, and its IPC
    handle in the base64 form tritonclient takes."""
    address = fake.runtime.malloc(len(data))
    fake.write(address, data)
    return address, base64.b64encode(fake.runtime.ipcGetMemHandle(address))


def _off_the_loop(fake: ModuleType, loop: int) -> Counter[str]:
    """The device calls so far, counted by name, after checking that none of them ran on
    the event loop's thread."""
    assert [call for call, thread in fake.calls if thread == loop] == []
    return Counter(call for call, _ in fake.calls)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("model", "datatype", "device_calls"),
    [
        ("identity_fp32", "FP32", {"ipcOpenMemHandle": 2, "get": 1, "set": 1}),
        ("identity_bytes", "BYTES", {"ipcOpenMemHandle": 2, "get": 1, "set": 1}),
        # A GPU model reads its input where it lies, and its output goes device to device.
        ("double_gpu", "FP32", {"ipcOpenMemHandle": 2, "copyto": 1}),
    ],
)
async def test_input_and_output_in_cuda_regions(
    fake_cupy: ModuleType,
    server: Server,
    protocol: str,
    model: str,
    datatype: str,
    device_calls: dict[str, int],
) -> None:
    loop = threading.get_ident()
    client = Client(protocol, server)
    if datatype == "BYTES":
        words = np.array([b"cuda", b"", b"shared \xff"], dtype=np.object_)
        data = serialize_byte_tensor(words).item()
        shape, expected = [3], data
    else:
        data = VALUES.tobytes()
        shape, expected = [VALUES.size], (VALUES * (2 if model == "double_gpu" else 1)).tobytes()
    size = len(data)
    _, in_handle = _exported(fake_cupy, data)
    out_address, out_handle = _exported(fake_cupy, bytes(size))
    await client("register_cuda_shared_memory", "cuda_in", in_handle, 0, size)
    await client("register_cuda_shared_memory", "cuda_out", out_handle, 0, size)
    assert await client.cuda_status() == {
        "cuda_in": {"name": "cuda_in", "device_id": 0, "byte_size": size},
        "cuda_out": {"name": "cuda_out", "device_id": 0, "byte_size": size},
    }
    tensor = client.module.InferInput("INPUT0", shape, datatype)
    tensor.set_shared_memory("cuda_in", size)
    output = client.module.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("cuda_out", size)

    result = await client("infer", model, [tensor], outputs=[output])

    assert client.written_to(result, "OUTPUT0") == {
        "shared_memory_region": "cuda_out", "shared_memory_byte_size": size,
    }  # fmt: skip
    assert fake_cupy.read(out_address, size) == expected
    assert _off_the_loop(fake_cupy, loop) == device_calls
    assert fake_cupy.open_handles() == 2
    await client("unregister_cuda_shared_memory")
    assert await client.cuda_status() == {}
    # A finished request can still sit in a reference cycle for a moment; the arrays over
    # a region it used, and so the region's handle, go with the cycle.
    gc.collect()
    assert fake_cupy.open_handles() == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_gpu_model_output_comes_to_the_host_off_the_loop(
    fake_cupy: ModuleType, server: Server, protocol: str
) -> None:
    loop = threading.get_ident()
    client = Client(protocol, server)
    _, handle = _exported(fake_cupy, VALUES.tobytes())
    await client("register_cuda_shared_memory", "cuda_in", handle, 0, VALUES.nbytes)
    tensor = client.module.InferInput("INPUT0", [VALUES.size], "FP32")
    tensor.set_shared_memory("cuda_in", VALUES.nbytes)

    result = await client("infer", "double_gpu", [tensor])

    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), VALUES * 2)
    assert _off_the_loop(fake_cupy, loop) == {"ipcOpenMemHandle": 1, "get": 1}
    await client("unregister_cuda_shared_memory")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_malformed_bytes_found_by_the_copy(
    fake_cupy: ModuleType, server: Server, protocol: str
) -> None:
    loop = threading.get_ident()
    client = Client(protocol, server)
    data = (100).to_bytes(4, "little") + b"short"  # an element of 100 bytes, 5 present
    _, handle = _exported(fake_cupy, data)
    await client("register_cuda_shared_memory", "cuda_in", handle, 0, len(data))
    tensor = client.module.InferInput("INPUT0", [1], "BYTES")
    tensor.set_shared_memory("cuda_in", len(data))

    message = await client.expect_error("INVALID_ARG", "infer", "identity_bytes", [tensor])

    assert "input 'INPUT0': BYTES element length runs past the data" in message
    assert _off_the_loop(fake_cupy, loop) == {"ipcOpenMemHandle": 1, "get": 1}
    await client("unregister_cuda_shared_memory")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_registration_errors(fake_cupy: ModuleType, server: Server, protocol: str) -> None:
    loop = threading.get_ident()
    client = Client(protocol, server)
    _, handle = _exported(fake_cupy, bytes(64))
    register = "register_cuda_shared_memory"

    unknown = base64.b64encode(b"\1" * 64)
    message = await client.expect_error("INVALID_ARG", register, "junk", unknown, 0, 64)
    assert message == (
        "failed to register CUDA shared memory region 'junk': "
        "cudaErrorInvalidResourceHandle: invalid resource handle"
    )
    short = base64.b64encode(b"\1" * 8)
    message = await client.expect_error("INVALID_ARG", register, "short", short, 0, 64)
    assert "raw_handle must be a 64-byte cudaIpcMemHandle_t, got 8 bytes" in message
    message = await client.expect_error("INVALID_ARG", register, "far", handle, 1, 64)
    assert "device_id 1 is not one of the 1 devices" in message
    await client(register, "r", handle, 0, 64)
    message = await client.expect_error("ALREADY_EXISTS", register, "r", handle, 0, 64)
    assert message == "shared memory region 'r' already in manager"

    assert await client.cuda_status() == {"r": {"name": "r", "device_id": 0, "byte_size": 64}}
    # The one refused by the driver and "r"; the name is taken before anything is opened.
    assert _off_the_loop(fake_cupy, loop) == {"ipcOpenMemHandle": 2}
    assert fake_cupy.open_handles() == 1
    await client("unregister_cuda_shared_memory", "r")
    assert fake_cupy.open_handles() == 0


@pytest.mark.parametrize("first", ["http", "grpc"])
async def test_concurrent_registrations_of_one_name(
    fake_cupy: ModuleType, server: Server, first: str
) -> None:
    """While one registration waits on the driver, the loop answers the rest: a second
    registration of its name is refused at once, and nothing is registered yet."""
    loop = threading.get_ident()
    clients = {protocol: Client(protocol, server) for protocol in ("http", "grpc")}
    second = clients["grpc" if first == "http" else "http"]
    _, handle = _exported(fake_cupy, bytes(64))
    gate = fake_cupy.hold_opens()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(clients[first], "register_cuda_shared_memory", "r", handle, 0, 64)
            opening = await trio.to_thread.run_sync(fake_cupy.open_waiting.wait, TIMEOUT)
            assert opening, "the first registration never opened its handle"

            message = await second.expect_error(
                "ALREADY_EXISTS", "register_cuda_shared_memory", "r", handle, 0, 64
            )
            assert message == "shared memory region 'r' already in manager"
            assert await second.cuda_status() == {}
            gate.set()
    finally:
        gate.set()  # never leave a worker thread waiting on the gate
    assert await second.cuda_status() == {"r": {"name": "r", "device_id": 0, "byte_size": 64}}
    assert _off_the_loop(fake_cupy, loop) == {"ipcOpenMemHandle": 1}
    assert fake_cupy.open_handles() == 1
    await second("unregister_cuda_shared_memory")
    assert fake_cupy.open_handles() == 0


@pytest.mark.parametrize("protocol", ["grpc", "grpc-grpclib"])
async def test_gpu_model_outputs_over_a_stream(
    fake_cupy: ModuleType, server: Server, protocol: str
) -> None:
    loop = threading.get_ident()

    def in_thread() -> Any:
        replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:
            client.start_stream(callback=lambda result, error: replies.put((result, error)))
            tensor = grpcclient.InferInput("INPUT0", [VALUES.size], "FP32")
            tensor.set_data_from_numpy(VALUES)
            client.async_stream_infer("double_on_device", [tensor])
            return replies.get(timeout=TIMEOUT)
        finally:
            client.stop_stream()
            client.close()

    result, error = await trio.to_thread.run_sync(in_thread, abandon_on_cancel=True)

    assert error is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), VALUES * 2)
    # The model's own copy in its worker thread, then the output's to the host.
    assert _off_the_loop(fake_cupy, loop) == {"asarray": 1, "get": 1}
