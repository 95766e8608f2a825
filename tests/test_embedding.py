"""Embedding trioserve in a trio program: start, infer, cancel, drain, disconnect."""

from __future__ import annotations

import json
import socket
import struct

import httpx
import numpy as np
import pytest
import trio
import trio.testing

from trioserve import ServerConfig, TensorSpec, model, open_server, serve
from trioserve.models import reference_zoo

HTTP_SERVERS = ["builtin", "hypercorn"]


class Gate:
    """A model whose executions start when asked and finish only when released."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.release = trio.Event()
        self.seen: list[int] = []

        @model(
            name="gate",
            inputs=[TensorSpec("X", "INT32", [1])],
            outputs=[TensorSpec("Y", "INT32", [1])],
        )
        async def gate(X):
            self.seen.append(int(X[0]))
            self.started.set()
            await self.release.wait()
            return {"Y": X}

        self.model = gate


def _gate_body(value: int) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [value]}]}
    ).encode()


async def _raw_post(port: int, path: str, body: bytes) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    await stream.send_all(head.encode() + body)
    return stream


async def test_serve_in_a_nursery_then_cancel():
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            config = ServerConfig(models=reference_zoo(), http_port=0, grpc_port=0)
            server = await nursery.start(serve, config)
            assert server.http_port and server.grpc_port
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as client:
                x = list(range(16))
                inputs = [
                    {"name": n, "shape": [1, 16], "datatype": "INT32", "data": x}
                    for n in ("INPUT0", "INPUT1")
                ]
                response = await client.post("/v2/models/simple/infer", json={"inputs": inputs})
                assert response.json()["outputs"][0]["data"] == [2 * v for v in x]
            nursery.cancel_scope.cancel()
        # Everything was inside the nursery: the ports are closed now.
        for port in (server.http_port, server.grpc_port):
            with pytest.raises(OSError):
                await trio.open_tcp_stream("127.0.0.1", port)


async def test_two_servers_in_one_process_share_nothing():
    zoo = ServerConfig(models=reference_zoo(), http_port=0, grpc_port=None)
    gate = ServerConfig(models=[Gate().model], http_port=0, grpc_port=None)
    with trio.fail_after(30):
        async with open_server(zoo) as a, open_server(gate) as b:
            assert a.http_port != b.http_port
            assert a.repository.names() != b.repository.names()


@pytest.mark.parametrize("http_server", HTTP_SERVERS)
async def test_graceful_shutdown_finishes_requests_in_flight(http_server):
    gate = Gate()
    config = ServerConfig(models=[gate.model], http_port=0, grpc_port=None, http_server=http_server)
    with trio.fail_after(30):
        async with open_server(config) as server:
            port = server.http_port
            stream = await _raw_post(port, "/v2/models/gate/infer", _gate_body(7))
            await gate.started.wait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.shutdown)
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(OSError):  # no longer accepting
                    await trio.open_tcp_stream("127.0.0.1", port)
                gate.release.set()
                reply = b""
                while b'"Y"' not in reply:
                    chunk = await stream.receive_some()
                    assert chunk, "connection closed before the in-flight response"
                    reply += chunk
                assert reply.startswith(b"HTTP/1.1 200")
            await stream.aclose()


async def test_shutdown_cancels_what_outlives_the_exit_timeout():
    gate = Gate()
    config = ServerConfig(models=[gate.model], http_port=0, grpc_port=None, exit_timeout_s=0.05)
    with trio.fail_after(30):
        async with open_server(config) as server:
            stream = await _raw_post(server.http_port, "/v2/models/gate/infer", _gate_body(1))
            await gate.started.wait()
            await server.shutdown()  # the gate is never released
            assert await stream.receive_some() == b""  # closed without an answer
            await stream.aclose()


@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
@pytest.mark.parametrize("http_server", HTTP_SERVERS)
async def test_client_disconnect_withdraws_a_queued_request(http_server, reset):
    gate = Gate()
    config = ServerConfig(models=[gate.model], http_port=0, grpc_port=None, http_server=http_server)
    with trio.fail_after(30):
        async with open_server(config) as server:
            runner = server.repository.get("gate")
            first = await _raw_post(server.http_port, "/v2/models/gate/infer", _gate_body(1))
            await gate.started.wait()
            second = await _raw_post(server.http_port, "/v2/models/gate/infer", _gate_body(2))
            await runner.wait_until(lambda s: s.queued == 1)
            if reset:  # an abortive close: RST instead of FIN
                second.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            await second.aclose()  # the client gives up while queued
            await runner.wait_until(lambda s: s.queued == 0)
            gate.release.set()
            assert (await first.receive_some()).startswith(b"HTTP/1.1 200")
            await first.aclose()
            assert gate.seen == [1]  # the withdrawn request never reached the model
            await server.shutdown()


async def test_binary_inputs_are_views_of_the_body_and_reach_the_model_uncopied():
    seen: list[np.ndarray] = []

    @model(
        name="peek", inputs=[TensorSpec("X", "FP32", [-1])], outputs=[TensorSpec("Y", "FP32", [-1])]
    )
    def peek(X):
        seen.append(X)
        return {"Y": X}

    with trio.fail_after(30):
        async with open_server(ServerConfig(models=[peek], http_port=0, grpc_port=None)) as server:
            x = np.arange(1024, dtype=np.float32)
            async with httpx.AsyncClient() as client:
                response = await client.post(
                    f"http://127.0.0.1:{server.http_port}/v2/models/peek/infer",
                    content=x.tobytes(),
                    headers={"Inference-Header-Content-Length": "0"},
                )
            assert response.status_code == 200
            assert not seen[0].flags.owndata and not seen[0].flags.writeable
            await server.shutdown()
