"""System shared memory end to end: tritonclient's own utilities and clients, HTTP and gRPC.

Regions are real POSIX shared-memory objects made by ``tritonclient.utils.shared_memory``;
the server maps them in this process, so a test can also see its mappings.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from trioserve import Server, ServerConfig
from trioserve.models import reference_zoo
from trioserve.shm import SharedMemoryRegistry
from trioserve.testing import server_in_thread

# The same app on both HTTP servers, the same methods on both gRPC front ends.
PROTOCOLS = ["http", "grpc", "http-hypercorn", "grpc-grpclib"]
SERVERS = {"http-hypercorn": "hypercorn_server", "grpc-grpclib": "grpclib_server"}
# What each error kind looks like to tritonclient: HTTP status, gRPC status code.
STATUS = {
    "INVALID_ARG": ("400", "StatusCode.INVALID_ARGUMENT"),
    "NOT_FOUND": ("404", "StatusCode.NOT_FOUND"),
    "ALREADY_EXISTS": ("400", "StatusCode.ALREADY_EXISTS"),
    "UNAVAILABLE": ("503", "StatusCode.UNAVAILABLE"),
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    config = ServerConfig(models=reference_zoo(), http_port=0, grpc_port=0)
    with server_in_thread(config) as running:
        yield running


@pytest.fixture(scope="module")
def grpclib_server() -> Iterator[Server]:
    config = ServerConfig(
        models=reference_zoo(), http_port=None, grpc_port=0, grpc_server="grpclib"
    )
    with server_in_thread(config) as running:
        yield running


@pytest.fixture(scope="module")
def hypercorn_server() -> Iterator[Server]:
    config = ServerConfig(
        models=reference_zoo(), http_port=0, grpc_port=None, http_server="hypercorn"
    )
    with server_in_thread(config) as running:
        yield running


class Client:
    """One of tritonclient's two clients, with the few answers that differ made alike."""

    def __init__(self, protocol: str, server: Server) -> None:
        protocol = protocol.removesuffix("-hypercorn").removesuffix("-grpclib")
        self.protocol = protocol
        self.module: Any = httpclient if protocol == "http" else grpcclient
        port = server.http_port if protocol == "http" else server.grpc_port
        self.raw = self.module.InferenceServerClient(f"127.0.0.1:{port}")

    def status(self, name: str = "") -> dict[str, dict[str, Any]]:
        """Registered system regions by name: {name: {key, offset, byte_size}}."""
        if self.protocol == "http":
            return {r["name"]: r for r in self.raw.get_system_shared_memory_status(name)}
        reply = self.raw.get_system_shared_memory_status(name)
        return {
            n: {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
            for n, r in reply.regions.items()
        }

    def input(self, name: str, shape: list[int], datatype: str) -> Any:
        return self.module.InferInput(name, shape, datatype)

    def output(self, name: str) -> Any:
        return self.module.InferRequestedOutput(name)

    def output_parameters(self, result: Any, name: str) -> dict[str, Any]:
        output = result.get_output(name)
        if self.protocol == "http":
            return dict(output.get("parameters", {}))
        return {
            k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in output.parameters.items()
        }

    def expect_error(self, kind: str, call: Any, *args: Any, **kwargs: Any) -> str:
        with pytest.raises(InferenceServerException) as caught:
            call(*args, **kwargs)
        http_status, grpc_status = STATUS[kind]
        assert caught.value.status() == (http_status if self.protocol == "http" else grpc_status)
        return str(caught.value.message())


@pytest.fixture(params=PROTOCOLS)
def client(request: pytest.FixtureRequest) -> Iterator[Client]:
    made = Client(request.param, request.getfixturevalue(SERVERS.get(request.param, "server")))
    yield made
    made.raw.unregister_system_shared_memory()  # whatever a test left registered
    assert made.status() == {}
    made.raw.close()


def test_triton_example_flow(client, regions):
    """Triton's simple shared-memory client example, step by step, unchanged."""
    c = client.raw
    c.unregister_system_shared_memory()
    input0 = np.arange(16, dtype=np.int32)
    input1 = np.ones(16, dtype=np.int32)
    output_handle, output_key = regions.create("output_data", 128)
    c.register_system_shared_memory("output_data", output_key, 128)
    input_handle, input_key = regions.create("input_data", 128)
    shm.set_shared_memory_region(input_handle, [input0])
    shm.set_shared_memory_region(input_handle, [input1], offset=64)
    c.register_system_shared_memory("input_data", input_key, 128)
    assert regions.mappings(input_key) == 2  # the client's and the server's

    inputs = [client.input("INPUT0", [1, 16], "INT32"), client.input("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("input_data", 64)
    inputs[1].set_shared_memory("input_data", 64, offset=64)
    outputs = [client.output("OUTPUT0"), client.output("OUTPUT1")]
    outputs[0].set_shared_memory("output_data", 64)
    outputs[1].set_shared_memory("output_data", 64, offset=64)
    result = c.infer("simple", inputs, outputs=outputs)

    assert client.output_parameters(result, "OUTPUT0") == {
        "shared_memory_region": "output_data", "shared_memory_byte_size": 64,
    }  # fmt: skip
    assert client.output_parameters(result, "OUTPUT1") == {
        "shared_memory_region": "output_data", "shared_memory_byte_size": 64,
        "shared_memory_offset": 64,
    }  # fmt: skip
    sums = shm.get_contents_as_numpy(output_handle, np.int32, [1, 16])
    differences = shm.get_contents_as_numpy(output_handle, np.int32, [1, 16], offset=64)
    np.testing.assert_array_equal(sums, [input0 + input1])
    np.testing.assert_array_equal(differences, [input0 - input1])
    assert client.status() == {
        "output_data": {"name": "output_data", "key": output_key, "offset": 0, "byte_size": 128},
        "input_data": {"name": "input_data", "key": input_key, "offset": 0, "byte_size": 128},
    }
    assert list(client.status("input_data")) == ["input_data"]
    c.unregister_system_shared_memory("input_data")
    assert list(client.status()) == ["output_data"]
    c.unregister_system_shared_memory()
    assert client.status() == {}
    assert regions.mappings(input_key) == regions.mappings(output_key) == 1  # the client's


def test_big_tensor_at_unaligned_offsets_in_several_regions(client, regions):
    """16 MiB of FP32 through identity_fp32: input and output in shm, offsets that are not
    page multiples, in windows registered at an offset into their objects."""
    count = 4 * 1024 * 1024
    data = np.random.default_rng(7).standard_normal(count).astype(np.float32)
    in_handle, in_key = regions.create("big_in", 8192 + 12 + data.nbytes)
    out_handle, out_key = regions.create("big_out", 4096 + 4 + data.nbytes)
    shm.set_shared_memory_region(in_handle, [data], offset=8192 + 12)
    # The input region is the object's window from 8192 on; the tensor sits 12 bytes in.
    client.raw.register_system_shared_memory("big_in", in_key, 12 + data.nbytes, offset=8192)
    client.raw.register_system_shared_memory("big_out", out_key, 4 + data.nbytes, offset=4096)
    tensor = client.input("INPUT0", [count], "FP32")
    tensor.set_shared_memory("big_in", data.nbytes, offset=12)
    output = client.output("OUTPUT0")
    output.set_shared_memory("big_out", data.nbytes, offset=4)
    result = client.raw.infer("identity_fp32", [tensor], outputs=[output])
    assert result.get_output("OUTPUT0") is not None
    returned = shm.get_contents_as_numpy(out_handle, np.float32, [count], offset=4096 + 4)
    np.testing.assert_array_equal(returned, data)
    assert client.status("big_in")["big_in"]["offset"] == 8192


def test_input_in_shm_output_on_the_wire_and_back(client, regions):
    data = np.linspace(0, 1, 100, dtype=np.float32)
    handle, key = regions.create("mixed", data.nbytes)
    shm.set_shared_memory_region(handle, [data])
    client.raw.register_system_shared_memory("mixed", key, data.nbytes)
    tensor = client.input("INPUT0", [100], "FP32")
    tensor.set_shared_memory("mixed", data.nbytes)
    result = client.raw.infer("identity_fp32", [tensor])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)

    # And the other way: the input sent inline, the output written to the region.
    doubled = data * 2
    inline = client.input("INPUT0", [100], "FP32")
    inline.set_data_from_numpy(doubled)
    output = client.output("OUTPUT0")
    output.set_shared_memory("mixed", data.nbytes)
    client.raw.infer("identity_fp32", [inline], outputs=[output])
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [100]), doubled)


def test_bytes_tensors_in_shm(client, regions):
    """BYTES travel in their serialized form (4-byte length, then the bytes)."""
    words = np.array([b"shared", b"", b"memory \xff"], dtype=np.object_)
    serialized = serialize_byte_tensor(words)
    size = len(serialized.item())  # a 0-d object array holding the serialized bytes
    in_handle, in_key = regions.create("words_in", size)
    out_handle, out_key = regions.create("words_out", size + 16)
    shm.set_shared_memory_region(in_handle, [serialized])
    client.raw.register_system_shared_memory("words_in", in_key, size)
    client.raw.register_system_shared_memory("words_out", out_key, size + 16)
    tensor = client.input("INPUT0", [3], "BYTES")
    tensor.set_shared_memory("words_in", size)
    output = client.output("OUTPUT0")
    output.set_shared_memory("words_out", size + 16)
    result = client.raw.infer("identity_bytes", [tensor], outputs=[output])
    assert client.output_parameters(result, "OUTPUT0")["shared_memory_byte_size"] == size
    returned = shm.get_contents_as_numpy(out_handle, np.object_, [3])
    assert returned.tolist() == words.tolist()

    # A byte size that cuts the serialized elements short is refused.
    short = client.input("INPUT0", [3], "BYTES")
    short.set_shared_memory("words_in", size - 1)
    message = client.expect_error("INVALID_ARG", client.raw.infer, "identity_bytes", [short])
    assert "BYTES" in message


def test_bytes_around_an_output_are_unchanged(client, regions):
    handle, key = regions.create("fenced", 4096 * 3)
    fence = np.full(4096 * 3, 0xAB, dtype=np.uint8)
    shm.set_shared_memory_region(handle, [fence])
    # The region is the object's middle page; the output lands 100 bytes into it and is
    # 64 bytes long, in a window of 200 bytes.
    client.raw.register_system_shared_memory("fenced", key, 4096, offset=4096)
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [client.input("INPUT0", [1, 16], "INT32"), client.input("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(x)
    output = client.output("OUTPUT0")
    output.set_shared_memory("fenced", 200, offset=100)
    client.raw.infer("simple", inputs, outputs=[output])
    after = shm.get_contents_as_numpy(handle, np.uint8, [4096 * 3])
    start = 4096 + 100
    np.testing.assert_array_equal(after[start : start + 64].view(np.int32), (x + x).reshape(-1))
    assert (after[:start] == 0xAB).all() and (after[start + 64 :] == 0xAB).all()


def test_output_bigger_than_its_region_is_refused_and_writes_nothing(client, regions):
    handle, key = regions.create("small", 4096)
    shm.set_shared_memory_region(handle, [np.full(4096, 0x5A, dtype=np.uint8)])
    client.raw.register_system_shared_memory("small", key, 4096)
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [client.input("INPUT0", [1, 16], "INT32"), client.input("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(x)
    outputs = [client.output("OUTPUT0"), client.output("OUTPUT1")]
    outputs[0].set_shared_memory("small", 64)  # fits
    outputs[1].set_shared_memory("small", 63, offset=64)  # one byte short
    message = client.expect_error(
        "INVALID_ARG", client.raw.infer, "simple", inputs, outputs=outputs
    )
    assert "OUTPUT1" in message and "63 bytes" in message and "64 bytes" in message
    after = shm.get_contents_as_numpy(handle, np.uint8, [4096])
    assert (after == 0x5A).all()  # not even the output that fitted was written


def test_register_errors(client, regions):
    _, key = regions.create("object", 4096)
    c = client.raw
    c.register_system_shared_memory("taken", key, 4096)
    message = client.expect_error(
        "ALREADY_EXISTS", c.register_system_shared_memory, "taken", key, 16
    )
    assert "'taken' already in manager" in message

    # A window past the end of its object would SIGBUS on first use: refused up front.
    message = client.expect_error(
        "INVALID_ARG", c.register_system_shared_memory, "past_end", key, 4000, offset=100
    )
    assert "exceeds the 4096 bytes" in message
    client.expect_error("INVALID_ARG", c.register_system_shared_memory, "huge", key, 4097)
    client.expect_error(
        "INVALID_ARG", c.register_system_shared_memory, "absent", "/trioserve_no_such_object", 16
    )
    for bad_key in ("/../../etc/passwd", "a/b", "/", ".."):
        message = client.expect_error(
            "INVALID_ARG", c.register_system_shared_memory, "escape", bad_key, 16
        )
        assert "invalid shared memory key" in message
    client.expect_error("INVALID_ARG", c.register_system_shared_memory, "empty", key, 0)
    assert list(client.status()) == ["taken"]

    message = client.expect_error("NOT_FOUND", client.status, "nope")
    assert message == "Unable to find system shared memory region: 'nope'"
    c.unregister_system_shared_memory("nope")  # not registered: not an error, as in Triton
    assert c.is_server_live()


def _simple_inputs(client: Client) -> list[Any]:
    return [client.input("INPUT0", [1, 16], "INT32"), client.input("INPUT1", [1, 16], "INT32")]


@pytest.mark.parametrize(
    ("case", "kind", "says"),
    [
        ("unknown-region", "NOT_FOUND", "Unable to find shared memory region: 'nowhere'"),
        ("past-the-region", "INVALID_ARG", "exceeds the 128 bytes of region 'inputs'"),
        ("offset-past-the-region", "INVALID_ARG", "exceeds the 128 bytes"),
        ("size-not-the-shape", "INVALID_ARG", "shape [1, 16] needs 64"),
        ("output-unknown-region", "NOT_FOUND", "Unable to find shared memory region: 'nowhere'"),
        ("output-past-the-region", "INVALID_ARG", "exceeds the 128 bytes"),
    ],
)
def test_infer_errors(client, regions, case, kind, says):
    handle, key = regions.create("inputs", 128)
    shm.set_shared_memory_region(handle, [np.arange(32, dtype=np.int32)])
    client.raw.register_system_shared_memory("inputs", key, 128)
    inputs = _simple_inputs(client)
    inputs[1].set_shared_memory("inputs", 64, offset=64)
    outputs = None
    if case == "unknown-region":
        inputs[0].set_shared_memory("nowhere", 64)
    elif case == "past-the-region":
        inputs[0].set_shared_memory("inputs", 65, offset=64)
    elif case == "offset-past-the-region":
        inputs[0].set_shared_memory("inputs", 64, offset=128)
    elif case == "size-not-the-shape":
        inputs[0].set_shared_memory("inputs", 60)
    else:
        inputs[0].set_shared_memory("inputs", 64)
        outputs = [client.output("OUTPUT0")]
        region = "nowhere" if case == "output-unknown-region" else "inputs"
        outputs[0].set_shared_memory(region, 64, offset=100)
    message = client.expect_error(kind, client.raw.infer, "simple", inputs, outputs=outputs)
    assert says in message
    assert client.raw.is_server_live()


# Whether this machine has cupy and a CUDA device: what the server advertises follows it.
CUDA = SharedMemoryRegistry().cuda_available


def test_server_metadata_lists_cuda_shared_memory_where_it_works(client):
    extensions = (
        client.raw.get_server_metadata()["extensions"]
        if client.protocol == "http"
        else list(client.raw.get_server_metadata().extensions)
    )
    assert "system_shared_memory" in extensions
    assert ("cuda_shared_memory" in extensions) is CUDA


@pytest.mark.skipif(CUDA, reason="cupy and a CUDA device are present")
def test_cuda_without_cupy_answers_cleanly(client):
    if client.protocol == "http":
        assert client.raw.get_cuda_shared_memory_status() == []
    else:
        assert dict(client.raw.get_cuda_shared_memory_status().regions) == {}
    handle = b"\0" * 64
    raw_handle = __import__("base64").b64encode(handle)
    message = client.expect_error(
        "UNAVAILABLE", client.raw.register_cuda_shared_memory, "gpu", raw_handle, 0, 64
    )
    assert "CUDA shared memory is not available" in message and "cupy" in message
    client.raw.unregister_cuda_shared_memory()
    assert client.raw.is_server_live()


@pytest.mark.parametrize("front_end", ["server", "grpclib_server"])
def test_stream_requests_read_and_write_shared_memory(request, front_end, regions):
    """ModelStreamInfer places tensors in shared memory as ModelInfer does; a request whose
    region is missing is answered with an error on the stream, which goes on."""
    server = request.getfixturevalue(front_end)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    values = np.arange(16, dtype=np.int32)
    in_handle, in_key = regions.create("stream_in", 128)
    out_handle, out_key = regions.create("stream_out", 128)
    shm.set_shared_memory_region(in_handle, [values, values * 3])
    client.register_system_shared_memory("stream_in", in_key, 128)
    client.register_system_shared_memory("stream_out", out_key, 128)

    def request(input_region: str, request_id: str) -> None:
        inputs = [grpcclient.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in range(2)]
        inputs[0].set_shared_memory(input_region, 64)
        inputs[1].set_shared_memory(input_region, 64, offset=64)
        outputs = [grpcclient.InferRequestedOutput(f"OUTPUT{i}") for i in range(2)]
        outputs[0].set_shared_memory("stream_out", 64, offset=64)
        outputs[1].set_shared_memory("stream_out", 64)
        client.async_stream_infer("simple", inputs, request_id=request_id, outputs=outputs)

    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    try:
        request("missing", "1")
        request("stream_in", "2")
        answers = [replies.get(timeout=30) for _ in range(2)]
    finally:
        client.stop_stream()
        client.unregister_system_shared_memory()
        client.close()

    failed = [error for result, error in answers if error is not None]
    answered = [result for result, error in answers if error is None]
    assert len(failed) == len(answered) == 1
    assert "Unable to find shared memory region: 'missing'" in str(failed[0])
    response = answered[0].get_response()
    assert response.id == "2"
    assert {
        o.name: o.parameters["shared_memory_byte_size"].int64_param for o in response.outputs
    } == {
        "OUTPUT0": 64,
        "OUTPUT1": 64,
    }
    differences = shm.get_contents_as_numpy(out_handle, np.int32, [16])
    sums = shm.get_contents_as_numpy(out_handle, np.int32, [16], offset=64)
    np.testing.assert_array_equal(sums, values * 4)
    np.testing.assert_array_equal(differences, values - values * 3)
