"""16 MiB tensors in binary REST bodies: received into one buffer that the model's input
is a view of, answered from the outputs' own memory, over real sockets."""

from __future__ import annotations

import gzip
import json
import socket
import tracemalloc
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import trio
import tritonclient.http as httpclient

from trioserve import Server, ServerConfig
from trioserve._limits import HttpLimits
from trioserve._model import Model, TensorSpec, model
from trioserve.rest._asgi import BODY_PARTS, RECEIVE_WHOLE, Receive, Scope, Send
from trioserve.rest._http11 import serve_http11
from trioserve.testing import server_in_thread

MIB = 1024 * 1024
COUNT = 16 * MIB // 4  # float32s in 16 MiB


def _keeper(kept: list[np.ndarray[Any, Any]]) -> Model:
    """An identity model that keeps every input it is given in ``kept``."""

    async def keep(INPUT0: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
        kept.append(INPUT0)
        return {"OUTPUT0": INPUT0}

    return model(
        name="keeper",
        inputs=[TensorSpec("INPUT0", "FP32", [-1])],
        outputs=[TensorSpec("OUTPUT0", "FP32", [-1])],
    )(keep)


@pytest.fixture
def kept() -> list[np.ndarray[Any, Any]]:
    return []


@pytest.fixture(params=["builtin", "hypercorn"])
def any_server(request: pytest.FixtureRequest, kept: list[Any]) -> Iterator[Server]:
    config = ServerConfig(
        models=[_keeper(kept)], http_port=0, grpc_port=None, http_server=request.param
    )
    with server_in_thread(config) as server:
        yield server


@pytest.fixture
def server(kept: list[Any]) -> Iterator[Server]:
    """The built-in HTTP/1.1 core, whose own paths these tests are about."""
    config = ServerConfig(models=[_keeper(kept)], http_port=0, grpc_port=None)
    with server_in_thread(config) as running:
        yield running


def _client(server: Server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=60)


def _infer(server: Server, x: np.ndarray[Any, Any], **options: Any) -> np.ndarray[Any, Any]:
    client = _client(server)
    try:
        tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        result = client.infer("keeper", [tensor], outputs=[output], **options)
        array: np.ndarray[Any, Any] = result.as_numpy("OUTPUT0")
        return array
    finally:
        client.close()


def _data(seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal(COUNT).astype(np.float32)


def _binary_request(x: np.ndarray[Any, Any], extra_headers: str = "") -> tuple[bytes, bytes]:
    """A binary-extension request for ``keeper``: its head, and its JSON header (the raw
    tensor follows it in the body)."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0", "datatype": "FP32", "shape": [x.size],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()  # fmt: skip
    head = (
        f"POST /v2/models/keeper/infer HTTP/1.1\r\nhost: t\r\n"
        f"inference-header-content-length: {len(header)}\r\n{extra_headers}"
    ).encode()
    return head, header


def _read_response(sock: socket.socket) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """Status line, headers and body of one Content-Length response."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        assert piece, f"closed before the response head: {data!r}"
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}
    body = bytearray(int(headers[b"content-length"]))
    body[: len(rest)] = rest
    filled = len(rest)
    with memoryview(body) as view:
        while filled < len(body):
            count = sock.recv_into(view[filled:])
            assert count, "closed before the end of the response body"
            filled += count
    return status, headers, bytes(body)


def _connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    sock.settimeout(60)
    return sock


# ------------------------------------------------------------------- end to end


def test_16_mib_round_trip_with_tritonclient(any_server: Server) -> None:
    x = _data(1)
    np.testing.assert_array_equal(_infer(any_server, x), x)


def test_the_model_receives_a_read_only_view_of_the_received_body(
    server: Server, kept: list[np.ndarray[Any, Any]]
) -> None:
    x = _data(2)
    _infer(server, x)
    (array,) = kept
    assert not array.flags.owndata and not array.flags.writeable
    base: Any = array
    while not isinstance(base, bytes | bytearray):
        base = base.obj if isinstance(base, memoryview) else base.base
    # The one buffer the body was received into, the JSON header before the tensor.
    assert type(base) is bytearray
    assert len(base) > x.nbytes and bytes(base[-x.nbytes :]) == x.tobytes()


def test_an_input_a_model_keeps_stays_as_it_was_sent(
    server: Server, kept: list[np.ndarray[Any, Any]]
) -> None:
    first, second = _data(3), _data(4)
    _infer(server, first)
    _infer(server, second)
    np.testing.assert_array_equal(kept[0], first)
    np.testing.assert_array_equal(kept[1], second)


def test_a_16_mib_request_and_answer_hold_the_tensor_once(server: Server) -> None:
    x = _data(5)
    head, header = _binary_request(x, "connection: close\r\n")
    request = [head + b"content-length: %d\r\n\r\n" % (len(header) + x.nbytes) + header, x.data]
    answer = bytearray(x.nbytes + MIB)  # before tracing: only the server's memory counts
    filled = 0
    _infer(server, x[:16])  # the server's first-request allocations out of the way
    with _connect(server) as sock, memoryview(answer) as view:
        tracemalloc.start()
        try:
            for part in request:
                sock.sendall(part)
            while count := sock.recv_into(view[filled:]):  # until the server closes
                filled += count
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert answer.startswith(b"HTTP/1.1 200 OK"), bytes(answer[:100])
    assert answer[filled - x.nbytes : filled] == x.tobytes()
    # The one buffer the body was received into, the answer sent from it: no joined copy
    # of the request's pieces, nor of the answer.
    assert peak < 1.25 * x.nbytes, f"{peak / MIB:.1f} MiB"


def test_a_body_cut_short_is_answered_400_and_the_server_serves_on(
    server: Server, kept: list[Any]
) -> None:
    x = _data(6)
    head, header = _binary_request(x)
    with _connect(server) as sock:
        sock.sendall(head + b"content-length: %d\r\n\r\n" % (len(header) + x.nbytes) + header)
        sock.sendall(x[: 3 * MIB // 4].data)  # 3 MiB of the 16
        sock.shutdown(socket.SHUT_WR)  # the client stops; it still reads the answer
        status, _, body = _read_response(sock)
    assert status == b"HTTP/1.1 400 Bad Request"
    expected = 3 * MIB + len(header)
    assert json.loads(body) == {
        "error": f"the client ended the request body after {expected} of its "
        f"{len(header) + x.nbytes} bytes"
    }
    assert kept == []  # the model never saw the cut body
    y = _data(7)
    np.testing.assert_array_equal(_infer(server, y), y)


def _memory_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def test_a_length_only_announced_takes_no_memory(server: Server) -> None:
    announced = 200 * MIB  # under the body limit, so the buffer is allocated
    head, header = _binary_request(np.zeros(announced // 4, np.float32))
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # the peak resident size starts again from here
    before = _memory_kib("VmRSS")
    with _connect(server) as sock:
        sock.sendall(head + b"content-length: %d\r\n\r\n" % (len(header) + announced) + header)
        sock.shutdown(socket.SHUT_WR)
        status, _, _ = _read_response(sock)
    assert status == b"HTTP/1.1 400 Bad Request"
    # Allocated at its length, but not written before bytes arrive.
    assert _memory_kib("VmHWM") - before < 32 * 1024


@pytest.mark.parametrize("framing", ["chunked", "gzip"])
def test_chunked_and_compressed_binary_bodies_still_arrive(server: Server, framing: str) -> None:
    x = _data(8)[: MIB // 4]
    head, header = _binary_request(x)
    if framing == "chunked":
        pieces = [header, x.tobytes()]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        framed = head + b"transfer-encoding: chunked\r\n\r\n" + body
    else:
        body = gzip.compress(header + x.tobytes(), 1)
        framed = head + b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(body)
        framed += body
    with _connect(server) as sock:
        sock.sendall(framed)
        status, headers, answer = _read_response(sock)
    assert status == b"HTTP/1.1 200 OK"
    raw = answer[int(headers[b"inference-header-content-length"]) :]
    np.testing.assert_array_equal(np.frombuffer(raw, np.float32), x)


# --------------------------------------------------------------------- the core


async def _serve(nursery: trio.Nursery, app: Any) -> int:
    addresses = await nursery.start(partial(serve_http11, app, "127.0.0.1", 0, HttpLimits()))
    return int(addresses[0][1])


async def test_receive_whole_gives_the_body_in_one_buffer(nursery: trio.Nursery) -> None:
    messages: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        receive_whole = scope["extensions"][RECEIVE_WHOLE]["receive"]
        messages.append(await receive_whole())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    port = await _serve(nursery, app)
    payload = np.arange(4 * MIB, dtype=np.uint8)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % payload.size
        )
        for start in range(0, payload.size, 300_000):  # in pieces the server reads apart
            await stream.send_all(payload[start : start + 300_000].data)
        assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 204")
    (message,) = messages
    assert message["more_body"] is False
    assert type(message["body"]) is bytearray and message["body"] == payload.tobytes()


async def test_body_parts_reach_a_slow_reader_intact(nursery: trio.Nursery) -> None:
    parts = [b"header", np.arange(3 * MIB, dtype=np.int32).view(np.uint8).data, b"!"]
    expected = b"".join(parts)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        assert BODY_PARTS in scope["extensions"]
        headers = [(b"content-length", b"%d" % len(expected))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": BODY_PARTS, "parts": list(parts)})

    port = await _serve(nursery, app)
    sock = trio.socket.socket()
    with sock:
        # A small receive buffer: the server's sendmsg calls stop part way many times.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect(("127.0.0.1", port))
        await sock.send(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
        data = bytearray()
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + len(expected):
            piece = await sock.recv(4096)
            assert piece
            data += piece
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert body == expected
