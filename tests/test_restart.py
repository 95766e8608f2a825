"""``trioserve run`` killed with SIGKILL, with requests in flight and keep-alive
connections open on every port, starts again on the same ports at once: the listeners
bind over the dead process's TIME_WAIT connections (SO_REUSEADDR) and serve."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
RESTART_LIMIT_S = 20.0  # a fresh interpreter's imports included, on a busy machine


def ended_before(pid: int, deadline: float) -> bool:
    """Whether process ``pid`` (not ours to wait for) ends before ``deadline``: its pidfd
    turns readable as it ends."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # gone already
    try:
        readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    finally:
        os.close(fd)
    return bool(readable)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


@contextlib.contextmanager
def running(
    repository: Path, ports: list[int], servers: list[str]
) -> Iterator[subprocess.Popen[str]]:
    """The server on ``ports`` (HTTP, gRPC, metrics), once it says it serves."""
    http, grpc, metrics = ports
    command = [
        sys.executable, "-m", "trioserve", "run", "--model-repository", str(repository),
        "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
        "--metrics-port", str(metrics), *servers,
    ]  # fmt: skip
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as process:
        try:
            wait_for(process, "serving models: blocking")
            yield process
        finally:
            process.kill()


def wait_for(process: subprocess.Popen[str], text: str) -> None:
    """Read the server's log until ``text``: waits for a line, not for a time."""
    assert process.stderr is not None
    for line in process.stderr:
        if text in line:
            return
    raise AssertionError(f"the server ended without logging {text!r}")


def open_connections(ports: list[int]) -> list[socket.socket]:
    """A keep-alive connection on each port, each having had an answer."""
    http, grpc, metrics = ports
    connections = []
    for port, greeting in (
        (http, b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n"),
        (grpc, H2_PREFACE),
        (metrics, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n"),
    ):
        connection = socket.create_connection(("127.0.0.1", port), timeout=10)
        connection.sendall(greeting)
        assert connection.recv(65536)
        connections.append(connection)
    return connections


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid:
                    found.append(int(entry.name))
    return found


def post_ignoring_errors(url: str) -> None:
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url, json=body, timeout=60)


def serves(ports: list[int]) -> None:
    http, grpc, metrics = ports
    assert httpx.get(f"http://127.0.0.1:{http}/v2/health/ready").status_code == 200
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    assert client.is_server_live()
    client.close()
    assert "nv_inference_count" in httpx.get(f"http://127.0.0.1:{metrics}/metrics").text


@pytest.mark.parametrize(
    "servers", [[], ["--http-server", "hypercorn", "--grpc-server", "grpclib"]]
)
def test_sigkill_then_restart_on_the_same_ports(
    blocking_repository: Path, servers: list[str]
) -> None:
    ports = free_ports(3)
    with running(blocking_repository, ports, servers) as first:
        serves(ports)
        connections = open_connections(ports)
        url = f"http://127.0.0.1:{ports[0]}/v2/models/blocking/infer"
        in_flight = threading.Thread(target=post_ignoring_errors, args=(url,), daemon=True)
        in_flight.start()
        wait_for(first, "model is executing")
        children = children_of(first.pid)  # the model's instance processes
        assert children
        first.kill()
        first.wait(10)
        gone_by = time.monotonic() + 10
        for pid in children:  # they follow it
            assert ended_before(pid, gone_by), f"left running: {pid} of {children}"
    started = time.monotonic()
    with running(blocking_repository, ports, servers):
        serves(ports)
        assert time.monotonic() - started < RESTART_LIMIT_S
    in_flight.join(20)
    assert not in_flight.is_alive()
    for connection in connections:
        connection.close()
