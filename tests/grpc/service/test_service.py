"""The gRPC front end against real clients: tritonclient.grpc and grpcio stubs.

Every test talks to a server running in-process over a real socket.
Client calls block, so they run in threads; each test is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import socket
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import trio
import trio.testing
import tritonclient.grpc as grpcclient
from google.protobuf.json_format import ParseDict
from tritonclient.grpc import model_config_pb2

import trioserve
from trioserve import (
    GrpcLimits,
    Model,
    Server,
    ServerConfig,
)
from trioserve._context import server_metadata
from trioserve._model_config import model_config
from trioserve.grpc._generated import health_pb2
from trioserve.grpc._grpclib import _listen
from trioserve.models import reference_zoo

from ._harness import (
    DATATYPES,
    TIMEOUT,
    Client,
    Gate,
    Recorder,
    call,
    expect_error,
    expect_rpc_error,
    gated_input,
    infer_input,
    simple_inputs,
    wait_queued,
)

# --- health, metadata, config --------------------------------------------------------


async def test_health(client: Client) -> None:
    with trio.fail_after(TIMEOUT):
        assert await call(client.is_server_live)
        assert await call(client.is_server_ready)
        assert await call(client.is_model_ready, "simple")
        assert await call(client.is_model_ready, "simple", "1")
        # Unknown models and versions are not ready; that is not an error.
        assert not await call(client.is_model_ready, "nope")
        assert not await call(client.is_model_ready, "simple", "9")


@pytest.mark.parametrize(
    ("service", "expected"),
    [("", "SERVING"), ("inference.GRPCInferenceService", "SERVING"), ("simple", "SERVING")],
)
async def test_health_check(channel: grpc.Channel, service: str, expected: str) -> None:
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    with trio.fail_after(TIMEOUT):
        reply = await call(check, health_pb2.HealthCheckRequest(service=service))
        assert health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status) == expected
        message = await expect_rpc_error(
            grpc.StatusCode.NOT_FOUND, check, health_pb2.HealthCheckRequest(service="nope")
        )
        assert message == "Request for unknown model: 'nope' is not found"


async def test_server_metadata(client: Client) -> None:
    with trio.fail_after(TIMEOUT):
        metadata = await call(client.get_server_metadata, as_json=True)
    expected = server_metadata()
    assert metadata == {
        "name": expected["name"],
        "version": expected["version"],
        "extensions": expected["extensions"],
    }


async def test_model_metadata(client: Client) -> None:
    with trio.fail_after(TIMEOUT):
        simple = await call(client.get_model_metadata, "simple", as_json=True)
        identity = await call(client.get_model_metadata, "identity_fp32", "1", as_json=True)
    assert simple["name"] == "simple"
    assert simple["versions"] == ["1"]
    assert simple["platform"] == "python"
    # -1 for the batch dimension of a batching model.
    assert simple["inputs"] == [
        {"name": f"INPUT{i}", "datatype": "INT32", "shape": ["-1", "16"]} for i in (0, 1)
    ]
    assert [o["name"] for o in simple["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    assert identity["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": ["-1"]}]


async def test_model_config(client: Client, models: list[trioserve.Model]) -> None:
    with trio.fail_after(TIMEOUT):
        simple = (await call(client.get_model_config, "simple")).config
        identity = (await call(client.get_model_config, "identity_bytes", "1")).config
    assert simple.max_batch_size == 8
    assert [i.name for i in simple.input] == ["INPUT0", "INPUT1"]
    assert [o.name for o in simple.output] == ["OUTPUT0", "OUTPUT1"]
    assert model_config_pb2.DataType.Name(simple.input[0].data_type) == "TYPE_INT32"
    assert list(simple.input[0].dims) == [16]
    assert simple.HasField("dynamic_batching")
    assert identity.max_batch_size == 0
    assert not identity.HasField("dynamic_batching")
    assert model_config_pb2.DataType.Name(identity.input[0].data_type) == "TYPE_STRING"
    # Identical to what REST serves: the same dict, parsed by tritonclient's classes.
    by_name = {m.name: m for m in models}
    assert simple == ParseDict(model_config(by_name["simple"]), model_config_pb2.ModelConfig())


@pytest.mark.parametrize("method", ["get_model_metadata", "get_model_config"])
async def test_metadata_unknown_model(client: Client, method: str) -> None:
    with trio.fail_after(TIMEOUT):
        message = await expect_error("NOT_FOUND", getattr(client, method), "nope")
        assert message == "Request for unknown model: 'nope' is not found"
        await expect_error("NOT_FOUND", getattr(client, method), "simple", "9")


# --- inference through tritonclient ----------------------------------------------------


@pytest.mark.parametrize("rows", [1, 8])
async def test_simple(client: Client, rows: int) -> None:
    inputs, a = simple_inputs(rows)
    with trio.fail_after(TIMEOUT):
        result = await call(client.infer, "simple", inputs, request_id=f"req-{rows}")
    assert result.as_numpy("OUTPUT0").tolist() == (a + a * 3).tolist()
    assert result.as_numpy("OUTPUT1").tolist() == (a - a * 3).tolist()
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (
        "simple",
        "1",
        f"req-{rows}",
    )


async def test_requested_output_subset(client: Client) -> None:
    inputs, a = simple_inputs(2)
    with trio.fail_after(TIMEOUT):
        result = await call(
            client.infer, "simple", inputs, outputs=[grpcclient.InferRequestedOutput("OUTPUT1")]
        )
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT1"]
    assert result.as_numpy("OUTPUT1").tolist() == (a - a * 3).tolist()
    assert result.as_numpy("OUTPUT0") is None


async def test_simple_string(client: Client) -> None:
    a = np.array([[str(i).encode() for i in range(16)]], dtype=object)
    b = np.array([[b"1"] * 16], dtype=object)
    inputs = [infer_input("INPUT0", a, "BYTES"), infer_input("INPUT1", b, "BYTES")]
    with trio.fail_after(TIMEOUT):
        result = await call(client.infer, "simple_string", inputs)
    assert result.as_numpy("OUTPUT0").tolist() == [[str(i + 1).encode() for i in range(16)]]
    assert result.as_numpy("OUTPUT1").tolist() == [[str(i - 1).encode() for i in range(16)]]


async def test_identity_fp32_large(client: Client) -> None:
    # 16 MiB each way: far over gRPC's customary 4 MiB default limit.
    data = np.random.default_rng(0).standard_normal(4 * 2**20, dtype=np.float32)
    with trio.fail_after(TIMEOUT):
        result = await call(client.infer, "identity_fp32", [infer_input("INPUT0", data, "FP32")])
    assert np.array_equal(result.as_numpy("OUTPUT0"), data)


async def test_identity_bytes_edge_elements(client: Client) -> None:
    data = np.array([b"", b"\x00", b"a\x00b", b"\xff\xfe\x80", "é".encode()], dtype=object)
    with trio.fail_after(TIMEOUT):
        result = await call(client.infer, "identity_bytes", [infer_input("INPUT0", data, "BYTES")])
        empty = np.array([], dtype=object)
        none = await call(client.infer, "identity_bytes", [infer_input("INPUT0", empty, "BYTES")])
    assert result.as_numpy("OUTPUT0").tolist() == data.tolist()
    assert none.as_numpy("OUTPUT0").shape == (0,)


async def test_delay(client: Client) -> None:
    data = np.array([[5.0]], dtype=np.float32)
    with trio.fail_after(TIMEOUT):
        result = await call(client.infer, "delay", [infer_input("INPUT0", data, "FP32")])
    assert result.as_numpy("OUTPUT0").tolist() == [[5.0]]


async def test_model_failure_reaches_client(client: Client) -> None:
    data = np.array([1], dtype=np.int32)
    with trio.fail_after(TIMEOUT):
        message = await expect_error(
            "INTERNAL", client.infer, "fail", [infer_input("INPUT0", data, "INT32")]
        )
    assert "the 'fail' model always fails" in message


def _sample(datatype: str) -> np.ndarray[Any, Any]:
    if datatype == "BOOL":
        return np.array([True, False, True])
    if datatype == "BYTES":
        return np.array([b"x", b"", b"\x00\xff"], dtype=object)
    if datatype == "BF16":  # tritonclient carries BF16 as ml_dtypes.bfloat16
        return np.array([1.0, -2.5, 3.0e38], dtype=ml_dtypes.bfloat16)
    dtype = np.dtype(datatype.lower().replace("fp", "float"))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([info.min, 1, info.max], dtype=dtype)
    return np.array([0.5, -1.25, np.finfo(dtype).max], dtype=dtype)


async def test_every_datatype_raw(client: Client) -> None:
    inputs = [infer_input(f"IN_{dt}", _sample(dt), dt) for dt in DATATYPES]
    with trio.fail_after(TIMEOUT):
        result = await call(client.infer, "all_types", inputs)
    for dt in DATATYPES:
        out = result.as_numpy(f"OUT_{dt}")
        sent = _sample(dt)
        if dt == "BF16":  # compare the 2-byte words: what travels
            out, sent = out.view(np.uint16), sent.view(np.uint16)
        assert out.dtype == sent.dtype, dt
        assert out.tolist() == sent.tolist(), dt


async def test_parameters_reach_the_model(client: Client, recorder: Recorder) -> None:
    data = np.array([7], dtype=np.int32)
    with trio.fail_after(TIMEOUT):
        await call(
            client.infer,
            "recorder",
            [infer_input("INPUT0", data, "INT32")],
            priority=3,
            timeout=5_000_000,
            parameters={"s": "x", "b": True, "i": -4, "d": 0.5},
        )
    (request,) = recorder.requests
    assert request.parameters == {
        "priority": 3, "timeout": 5_000_000, "s": "x", "b": True, "i": -4, "d": 0.5
    }  # fmt: skip
    assert type(request.parameters["priority"]) is int
    assert (request.priority, request.timeout_us) == (3, 5_000_000)


# --- cancellation ----------------------------------------------------------------------


async def test_cancel_withdraws_queued_request(server: Server, client: Client, gate: Gate) -> None:
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, client.infer, "gated", gated_input(1.0))
            await gate.entered.wait()  # the one instance is busy until release
            outcome: list[Any] = []
            answered = trio.Event()
            token = trio.lowlevel.current_trio_token()

            def on_answer(result: Any, error: Any) -> None:  # on tritonclient's thread
                outcome.append(error)
                trio.from_thread.run_sync(answered.set, trio_token=token)

            handle = client.async_infer("gated", gated_input(2.0), on_answer)
            await wait_queued(server, "gated", 1)
            handle.cancel()
            await wait_queued(server, "gated", 0)  # withdrawn
            gate.release.set()
        result = await call(client.infer, "gated", gated_input(3.0))
        assert result.as_numpy("OUTPUT0").tolist() == [[3.0]]
        await answered.wait()
    assert gate.batches == [[1.0], [3.0]]  # the cancelled request never ran
    assert outcome[0].status() == "StatusCode.CANCELLED"


async def test_deadline_withdraws_queued_request(
    server: Server, client: Client, gate: Gate
) -> None:
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, client.infer, "gated", gated_input(1.0))
            await gate.entered.wait()
            await expect_error(
                "DEADLINE_EXCEEDED", client.infer, "gated", gated_input(2.0), client_timeout=0.2
            )
            await wait_queued(server, "gated", 0)
            gate.release.set()
        await call(client.infer, "gated", gated_input(3.0))
    assert gate.batches == [[1.0], [3.0]]


async def test_delay_cancelled_then_serves(client: Client) -> None:
    slow = [infer_input("INPUT0", np.array([[500.0]], dtype=np.float32), "FP32")]
    with trio.fail_after(TIMEOUT):
        await expect_error("DEADLINE_EXCEEDED", client.infer, "delay", slow, client_timeout=0.05)
        inputs, _ = simple_inputs(1)
        await call(client.infer, "simple", inputs)
        fast = [infer_input("INPUT0", np.array([[1.0]], dtype=np.float32), "FP32")]
        result = await call(client.infer, "delay", fast)
    assert result.as_numpy("OUTPUT0").tolist() == [[1.0]]


# --- limits and shutdown ---------------------------------------------------------------


async def test_message_size_limit(nursery: trio.Nursery, grpc_server: str) -> None:
    config = ServerConfig(
        models=reference_zoo(),
        http_port=None,
        grpc_port=0,
        grpc_limits=GrpcLimits(max_message_bytes=64 * 1024),
        grpc_server=grpc_server,
    )
    server = await nursery.start(trioserve.serve, config)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        with trio.fail_after(TIMEOUT):
            big = np.zeros(32 * 1024, dtype=np.float32)  # 128 KiB
            message = await expect_error(
                "RESOURCE_EXHAUSTED",
                client.infer,
                "identity_fp32",
                [infer_input("INPUT0", big, "FP32")],
            )
            assert "larger than max" in message
            small = np.ones(8, dtype=np.float32)
            result = await call(
                client.infer, "identity_fp32", [infer_input("INPUT0", small, "FP32")]
            )
            assert result.as_numpy("OUTPUT0").tolist() == small.tolist()
    finally:
        client.close()


async def test_graceful_shutdown_finishes_in_flight(
    models: list[Model], gate: Gate, grpc_server: str
) -> None:
    config = ServerConfig(models=models, http_port=None, grpc_port=0, grpc_server=grpc_server)
    results: list[Any] = []
    client: Client | None = None
    try:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                server = await nursery.start(trioserve.serve, config)
                client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

                async def in_flight() -> None:
                    assert client is not None
                    results.append(await call(client.infer, "gated", gated_input(1.0)))

                nursery.start_soon(in_flight)
                await gate.entered.wait()
                nursery.start_soon(server.shutdown)
                await trio.testing.wait_all_tasks_blocked()  # the front end saw the trigger
                message = await expect_error("UNAVAILABLE", client.is_server_live)
                # grpclib answers the call; the HTTP/2 core has sent GOAWAY and stopped
                # listening, so the client's new connection is refused.
                assert "shutting down" in message or "Connection refused" in message
                gate.release.set()
                await server.wait_stopped()
            # The request in flight got its answer; then the front end stopped listening.
            assert results[0].as_numpy("OUTPUT0").tolist() == [[1.0]]
            await expect_error("UNAVAILABLE", client.is_server_live)
    finally:
        if client is not None:
            client.close()


def test_listener_is_tcp() -> None:
    # Accepted sockets inherit the listener's protocol number, and asyncio and grpclib
    # turn Nagle off (TCP_NODELAY) only on sockets that say IPPROTO_TCP: without it each
    # small reply waits for the client's delayed ACK, about 40 ms.
    with _listen("127.0.0.1", 0) as listener, socket.create_connection(listener.getsockname()):
        accepted, _ = listener.accept()
        with accepted:
            assert accepted.proto == socket.IPPROTO_TCP
