"""Shared-memory requests as raw wire messages (what tritonclient never sends), restricted
APIs, and regions unregistered while a request still uses them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import trioserve
from trioserve import Restriction, Server, ServerConfig, TensorSpec
from trioserve.models import reference_zoo
from trioserve.testing import GatedModel, gated, server_in_thread

SECRET = {"shared-memory": Restriction("admin-key", "s3cret")}


@pytest.fixture(scope="module")
def server(zoo_on_each_grpc_front_end: Server) -> Server:
    """The gRPC tests run on each gRPC front end (the HTTP ones alike, on each server)."""
    return zoo_on_each_grpc_front_end


@pytest.fixture
def stub(server: Server) -> Iterator[Any]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture
def registered(http: httpx.Client, regions: Any) -> Iterator[str]:
    """A 128-byte region called "r" holding 32 INT32 counting from 0."""
    handle, key = regions.create("r", 128)
    shm.set_shared_memory_region(handle, [np.arange(32, dtype=np.int32)])
    body = {"key": key, "offset": 0, "byte_size": 128}
    assert http.post("/v2/systemsharedmemory/region/r/register", json=body).status_code == 200
    yield "r"
    assert http.post("/v2/systemsharedmemory/unregister").status_code == 200


def _identity_input(parameters: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "parameters": parameters,
                    **extra}]
    }  # fmt: skip


@pytest.mark.parametrize(
    ("parameters", "extra", "says"),
    [
        ({"shared_memory_region": "r"}, {}, "needs 'shared_memory_byte_size'"),
        ({"shared_memory_byte_size": 16}, {}, "can not be specified without"),
        ({"shared_memory_offset": 16}, {}, "can not be specified without"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 16}, {"data": [1, 2, 3, 4]},
         "unexpected data"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 16, "binary_data_size": 16}, {},
         "unexpected data"),
        ({"shared_memory_region": 7, "shared_memory_byte_size": 16}, {}, "must be a string"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": -16}, {}, "non-negative"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": True}, {}, "non-negative"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 16, "shared_memory_offset": 1.5},
         {}, "non-negative"),
    ],
)  # fmt: skip
def test_http_input_parameters(http, registered, parameters, extra, says):
    response = http.post(
        "/v2/models/identity_fp32/infer", json=_identity_input(parameters, **extra)
    )
    assert response.status_code == 400
    assert says in response.json()["error"]


def test_http_output_parameters(http, registered):
    document = _identity_input({"shared_memory_region": "r", "shared_memory_byte_size": 16})
    document["outputs"] = [{"name": "OUTPUT0", "parameters": {"shared_memory_byte_size": 16}}]
    response = http.post("/v2/models/identity_fp32/infer", json=document)
    assert response.status_code == 400
    assert "can not be specified without 'shared_memory_region'" in response.json()["error"]
    # A JSON answer for an output in shared memory: parameters, no data.
    document["outputs"][0]["parameters"] = {
        "shared_memory_region": "r", "shared_memory_byte_size": 16, "shared_memory_offset": 64,
    }  # fmt: skip
    response = http.post("/v2/models/identity_fp32/infer", json=document)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json()["outputs"] == [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": [4], "parameters": {
            "shared_memory_region": "r", "shared_memory_byte_size": 16,
            "shared_memory_offset": 64}},
    ]  # fmt: skip


def test_http_output_in_shared_memory_is_not_binary(http, registered):
    """Both at once is refused, as Triton does; a request-wide binary_data_output is not
    (the output in shared memory gives way to it, as tritonclient expects)."""
    document = _identity_input({"shared_memory_region": "r", "shared_memory_byte_size": 16})
    placed = {
        "shared_memory_region": "r",
        "shared_memory_byte_size": 16,
        "shared_memory_offset": 64,
    }
    document["outputs"] = [{"name": "OUTPUT0", "parameters": {**placed, "binary_data": True}}]
    response = http.post("/v2/models/identity_fp32/infer", json=document)
    assert response.status_code == 400
    assert response.json()["error"] == (
        "output 'OUTPUT0' can't set both 'shared_memory_region' and 'binary_data'"
    )
    document["outputs"][0]["parameters"] = {**placed, "binary_data": False}
    document["parameters"] = {"binary_data_output": True}
    response = http.post("/v2/models/identity_fp32/infer", json=document)
    assert response.status_code == 200
    assert response.json()["outputs"][0]["parameters"] == placed


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/v2/systemsharedmemory/region/x/register", b"{", 400, "malformed JSON"),
        ("/v2/systemsharedmemory/region/x/register", b"[]", 400, "JSON object"),
        ("/v2/systemsharedmemory/region/x/register", b'{"byte_size": 8}', 400, "'key'"),
        ("/v2/systemsharedmemory/region/x/register", b'{"key": "/k"}', 400, "'byte_size'"),
        ("/v2/systemsharedmemory/region/x/register", b'{"key": "/k", "byte_size": "8"}', 400,
         "'byte_size'"),
        ("/v2/systemsharedmemory/region/x/register", b'{"key": "/k", "byte_size": 8, "offset": -1}',
         400, "'offset'"),
        ("/v2/cudasharedmemory/region/x/register", b'{"raw_handle": "AAAA"}', 400, "b64"),
        ("/v2/cudasharedmemory/region/x/register", b'{"raw_handle": {"b64": "!!"}}', 400, "base64"),
    ],
)  # fmt: skip
def test_http_bad_registrations(http, path, body, status, says):
    response = http.post(path, content=body)
    assert response.status_code == status
    assert says in response.json()["error"]
    assert http.get("/v2/systemsharedmemory/status").json() == []


def test_http_routes(http):
    assert http.get("/v2/systemsharedmemory/region/x/register").status_code == 405
    assert http.post("/v2/systemsharedmemory/status").status_code == 405
    missing = http.get("/v2/cudasharedmemory/region/x/status")
    assert missing.status_code == 404
    assert missing.json() == {"error": "Unable to find CUDA shared memory region: 'x'"}


def test_a_name_is_one_namespace_across_kinds(http, registered):
    body = {"raw_handle": {"b64": "AA" * 43 + "=="}, "device_id": 0, "byte_size": 8}
    response = http.post("/v2/cudasharedmemory/region/r/register", json=body)
    assert response.status_code == 400
    assert "'r' already in manager" in response.json()["error"]
    wrong_kind = http.get("/v2/cudasharedmemory/region/r/status")
    assert wrong_kind.status_code == 404
    assert "registered as system shared memory" in wrong_kind.json()["error"]
    # Unregistering a CUDA region by a system region's name leaves the system one alone.
    assert http.post("/v2/cudasharedmemory/region/r/unregister").status_code == 200
    assert [r["name"] for r in http.get("/v2/systemsharedmemory/status").json()] == ["r"]


def _grpc_identity(parameters: dict[str, Any]) -> Any:
    request = service_pb2.ModelInferRequest(model_name="identity_fp32")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    for key, value in parameters.items():
        if isinstance(value, str):
            tensor.parameters[key].string_param = value
        else:
            tensor.parameters[key].int64_param = value
    return request


def test_grpc_input_errors(stub, registered):
    placed = {"shared_memory_region": "r", "shared_memory_byte_size": 16}
    with_contents = _grpc_identity(placed)
    with_contents.inputs[0].contents.fp32_contents.extend([1, 2, 3, 4])
    with_raw = _grpc_identity(placed)
    with_raw.raw_input_contents.append(np.ones(4, np.float32).tobytes())
    for request, says in [
        (with_contents, "unexpected data"),
        (with_raw, "1 raw_input_contents for 0 inputs"),
        (_grpc_identity({"shared_memory_region": "r"}), "needs 'shared_memory_byte_size'"),
        (_grpc_identity({"shared_memory_byte_size": 16}), "can not be specified without"),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in caught.value.details()
    reply = stub.ModelInfer(_grpc_identity({**placed, "shared_memory_offset": 4}))
    np.testing.assert_array_equal(np.frombuffer(reply.raw_output_contents[0], np.float32),
                                  np.arange(1, 5, dtype=np.int32).view(np.float32))  # fmt: skip


def test_grpc_outputs_keep_raw_contents_aligned(stub, registered):
    """An output in shared memory gets an empty raw entry, so tritonclient still finds the
    raw contents of the outputs after it by position."""
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
    request.raw_input_contents.extend([np.full(16, 5, np.int32).tobytes()] * 2)
    first = request.outputs.add(name="OUTPUT0")
    first.parameters["shared_memory_region"].string_param = "r"
    first.parameters["shared_memory_byte_size"].int64_param = 64
    request.outputs.add(name="OUTPUT1")
    reply = stub.ModelInfer(request)
    assert list(reply.raw_output_contents) == [b"", np.zeros(16, np.int32).tobytes()]
    assert reply.outputs[0].parameters["shared_memory_byte_size"].int64_param == 64
    assert not reply.outputs[1].parameters


# --- restricted APIs -----------------------------------------------------------------


@pytest.fixture
def restricted(protocol: str) -> Iterator[Server]:
    config = ServerConfig(
        models=reference_zoo(), http_port=0, grpc_port=0,
        http_restricted_apis=SECRET, grpc_restricted_apis=SECRET,
        grpc_server="grpclib" if protocol.endswith("-grpclib") else "trio",
    )  # fmt: skip
    with server_in_thread(config) as running:
        yield running


@pytest.mark.parametrize("protocol", ["http", "grpc", "grpc-grpclib"])
def test_restricted_shared_memory(restricted, regions, protocol):
    protocol = protocol.removesuffix("-grpclib")
    module: Any = httpclient if protocol == "http" else grpcclient
    port = restricted.http_port if protocol == "http" else restricted.grpc_port
    client = module.InferenceServerClient(f"127.0.0.1:{port}")
    _, key = regions.create("guarded", 64)
    for call in (
        partial(client.register_system_shared_memory, "guarded", key, 64),
        client.get_system_shared_memory_status,
        client.unregister_system_shared_memory,
        client.get_cuda_shared_memory_status,
    ):
        with pytest.raises(InferenceServerException) as caught:
            call(headers={"admin-key": "wrong"})
        expected = "403" if protocol == "http" else "StatusCode.UNAVAILABLE"
        assert caught.value.status() == expected
        assert "This API is restricted, expecting header 'admin-key'" in caught.value.message()
    allowed = {"Admin-Key": "s3cret"} if protocol == "http" else {"admin-key": "s3cret"}
    client.register_system_shared_memory("guarded", key, 64, headers=allowed)
    tensor = module.InferInput("INPUT0", [16], "FP32")
    tensor.set_shared_memory("guarded", 64)
    assert client.infer("identity_fp32", [tensor]).as_numpy("OUTPUT0").shape == (16,)
    client.unregister_system_shared_memory(headers=allowed)
    assert client.is_server_live()  # the rest of the API is not restricted
    client.close()


# --- reference counting --------------------------------------------------------------


def _gated_model() -> GatedModel:
    @trioserve.model(
        name="gated",
        inputs=[TensorSpec("INPUT0", "FP32", [-1])],
        outputs=[TensorSpec("OUTPUT0", "FP32", [-1])],
    )
    def double(INPUT0: np.ndarray) -> dict[str, np.ndarray]:
        return {"OUTPUT0": INPUT0 * 2}  # reads the input only after its region went

    return gated(double)


@pytest.mark.parametrize("protocol", ["http", "grpc", "grpc-grpclib"])
async def test_unregistered_while_in_flight(regions, protocol):
    model = _gated_model()
    grpc_server = "grpclib" if protocol.endswith("-grpclib") else "trio"
    protocol = protocol.removesuffix("-grpclib")
    config = ServerConfig(models=[model], http_port=0, grpc_port=0, grpc_server=grpc_server)
    data = np.arange(1024, dtype=np.float32)
    in_handle, in_key = regions.create("in", data.nbytes)
    out_handle, out_key = regions.create("out", data.nbytes)
    shm.set_shared_memory_region(in_handle, [data])
    module: Any = httpclient if protocol == "http" else grpcclient
    async with trio.open_nursery() as nursery:
        server = await nursery.start(trioserve.serve, config)
        port = server.http_port if protocol == "http" else server.grpc_port

        async def call(method: str, *args: Any, **kwargs: Any) -> Any:
            """One call on a client of its own, made and used in one worker thread:
            tritonclient's HTTP client belongs to the thread that made it."""

            def in_thread() -> Any:
                client = module.InferenceServerClient(f"127.0.0.1:{port}")
                try:
                    return getattr(client, method)(*args, **kwargs)
                finally:
                    client.close()

            return await trio.to_thread.run_sync(in_thread)

        await call("register_system_shared_memory", "in", in_key, data.nbytes)
        await call("register_system_shared_memory", "out", out_key, data.nbytes)
        tensor = module.InferInput("INPUT0", [1024], "FP32")
        tensor.set_shared_memory("in", data.nbytes)
        output = module.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("out", data.nbytes)
        done = trio.Event()

        async def infer() -> None:
            await call("infer", "gated", [tensor], outputs=[output])
            done.set()

        nursery.start_soon(infer)
        with trio.fail_after(30):
            await model.entered.wait()
        await call("unregister_system_shared_memory")
        assert server.shared_memory.status("system") == []
        assert regions.held(in_key) == regions.held(out_key) == 1  # still open
        # The names are free again at once: "in" now names another object.
        _, other_key = regions.create("other", 64)
        await call("register_system_shared_memory", "in", other_key, 64)
        model.release.set()
        with trio.fail_after(30):
            await done.wait()
        assert regions.held(in_key) == regions.held(out_key) == 0
        returned = shm.get_contents_as_numpy(out_handle, np.float32, [1024])
        np.testing.assert_array_equal(returned, data * 2)
        assert regions.held(other_key) == 1
        nursery.cancel_scope.cancel()
    assert regions.held(other_key) == 0  # the server closed it when it stopped


def test_status_json_is_what_triton_answers(http, registered, regions):
    statuses = http.get("/v2/systemsharedmemory/region/r/status").json()
    assert len(statuses) == 1 and set(statuses[0]) == {"name", "key", "offset", "byte_size"}
    assert json.loads(http.get("/v2/cudasharedmemory/status").content) == []
