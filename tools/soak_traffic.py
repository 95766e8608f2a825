"""The requests ``tools/soak.py`` sends: one function per kind of traffic.

Each kind takes a worker's ``Clients`` and returns ``"ok"`` when the exchange went as it
should, or ``"cancelled"`` when the client gave up on purpose (a cancelled call, a
timeout) and the server said so; anything else raises, and the soak counts it as an
unexpected error. Every kind checks what it got back, so a wrong answer is an error too:
an ``AssertionError``, where a connection lost (a stream cut short among them) raises
something else (``tools/worker_kills.py`` tells the two apart).

The models are the built-in ones of ``trioserve run``: ``simple``, ``identity_fp32``,
``delay`` (sleeps INPUT0 ms), ``repeat_int32`` (decoupled: one response per element) and
``tiny_lm`` (generative).
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

SIMPLE_A = np.arange(16, dtype=np.int32).reshape(1, 16)
SIMPLE_B = np.full((1, 16), 3, dtype=np.int32)
BINARY_TENSOR = np.linspace(0, 1, 4096, dtype=np.float32)  # 16 KiB each way
# 1 MiB each way: past what a --workers front end carries in its frames to the core
# (``workers/_wire.INLINE_BYTES``), so it travels in the shared-memory arena's blocks.
LARGE_TENSOR = np.linspace(0, 1, 1 << 18, dtype=np.float32)
SLOW_MS = 300.0  # what ``delay`` sleeps for the calls that are cancelled before it answers
REPLY_TIMEOUT_S = 30.0  # a reply later than this is an error, not a slow moment


class Clients:
    """One worker's connections: a tritonclient per protocol, and the addresses for raw
    sockets. A worker runs one request at a time, so its clients are never shared."""

    def __init__(self, host: str, http_port: int, grpc_port: int, worker: int) -> None:
        self.host, self.http_port, self.worker = host, http_port, worker
        self.http = httpclient.InferenceServerClient(
            f"{host}:{http_port}", network_timeout=REPLY_TIMEOUT_S
        )
        self.grpc = grpcclient.InferenceServerClient(f"{host}:{grpc_port}")
        self.serial = 0  # numbers this worker's shared-memory regions

    def close(self) -> None:
        self.http.close()
        self.grpc.close()

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.http_port), timeout=REPLY_TIMEOUT_S)


def _simple_inputs(module: Any, binary: bool) -> list[Any]:
    inputs = []
    for name, array in (("INPUT0", SIMPLE_A), ("INPUT1", SIMPLE_B)):
        tensor = module.InferInput(name, list(array.shape), "INT32")
        if module is httpclient:
            tensor.set_data_from_numpy(array, binary_data=binary)
        else:
            tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _check_simple(result: Any) -> None:
    if not (
        np.array_equal(result.as_numpy("OUTPUT0"), SIMPLE_A + SIMPLE_B)
        and np.array_equal(result.as_numpy("OUTPUT1"), SIMPLE_A - SIMPLE_B)
    ):
        raise AssertionError("simple answered wrong sums")


def rest_json(clients: Clients) -> str:
    outputs = [
        httpclient.InferRequestedOutput(n, binary_data=False) for n in ("OUTPUT0", "OUTPUT1")
    ]
    _check_simple(clients.http.infer("simple", _simple_inputs(httpclient, False), outputs=outputs))
    return "ok"


def rest_binary(clients: Clients) -> str:
    tensor = httpclient.InferInput("INPUT0", list(BINARY_TENSOR.shape), "FP32")
    tensor.set_data_from_numpy(BINARY_TENSOR, binary_data=True)
    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    result = clients.http.infer("identity_fp32", [tensor], outputs=[output])
    if not np.array_equal(result.as_numpy("OUTPUT0"), BINARY_TENSOR):
        raise AssertionError("identity_fp32 changed its tensor")
    return "ok"


def _next_turn(clients: Clients) -> tuple[Any, Any]:
    """The next turn's client and its module: gRPC on odd turns, REST on even ones."""
    clients.serial += 1
    return (clients.grpc, grpcclient) if clients.serial % 2 else (clients.http, httpclient)


def large_tensor(clients: Clients) -> str:
    """``identity_fp32`` on 1 MiB: over REST binary on even turns, over gRPC on odd ones."""
    client, module = _next_turn(clients)
    options = {"binary_data": True} if module is httpclient else {}
    tensor = module.InferInput("INPUT0", list(LARGE_TENSOR.shape), "FP32")
    tensor.set_data_from_numpy(LARGE_TENSOR, **options)
    output = module.InferRequestedOutput("OUTPUT0", **options)
    result = client.infer("identity_fp32", [tensor], outputs=[output])
    if not np.array_equal(result.as_numpy("OUTPUT0"), LARGE_TENSOR):
        raise AssertionError("identity_fp32 changed its 1 MiB tensor")
    return "ok"


def grpc_unary(clients: Clients) -> str:
    _check_simple(clients.grpc.infer("simple", _simple_inputs(grpcclient, True)))
    return "ok"


def _repeat_inputs(values: list[int], delays_ms: list[int]) -> list[Any]:
    arrays = (
        ("IN", np.array(values, dtype=np.int32), "INT32"),
        ("DELAY", np.array(delays_ms, dtype=np.uint32), "UINT32"),
        ("WAIT", np.array([0], dtype=np.uint32), "UINT32"),
    )
    inputs = []
    for name, array, datatype in arrays:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _is_final(result: Any) -> bool:
    final = result.get_response().parameters.get("triton_final_response")
    return final is not None and final.bool_param


class _Stream:
    """A ModelStreamInfer call of the worker's gRPC client; ``next`` waits for a reply."""

    def __init__(self, clients: Clients) -> None:
        self._client = clients.grpc
        self._replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._replies.put((result, error)))

    def next(self) -> Any:
        result, error = self._replies.get(timeout=REPLY_TIMEOUT_S)
        if error is not None:
            raise error
        return result

    def stop(self, cancel: bool = False) -> None:
        self._client.stop_stream(cancel_requests=cancel)


def grpc_stream(clients: Clients) -> str:
    """The decoupled ``repeat_int32``: three responses, then an empty final one."""
    stream = _Stream(clients)
    try:
        values = [7, 8, 9]
        clients.grpc.async_stream_infer(
            "repeat_int32", _repeat_inputs(values, [0, 1, 2]), enable_empty_final_response=True
        )
        got = []
        while not _is_final(result := stream.next()):
            got.append(int(result.as_numpy("OUT")[0]))
        if got != values:
            raise AssertionError(f"repeat_int32 answered {got}, not {values}")
    finally:
        stream.stop()
    return "ok"


def _prompt(module: Any) -> Any:
    tensor = module.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"The soak test says"], dtype=object))
    return tensor


def grpc_stream_llm(clients: Clients) -> str:
    """``tiny_lm`` through ModelStreamInfer: one response per chunk, the last one final."""
    stream = _Stream(clients)
    try:
        clients.grpc.async_stream_infer(
            "tiny_lm", [_prompt(grpcclient)], parameters={"max_tokens": 8, "ignore_eos": True}
        )
        chunks = 1
        while not _is_final(stream.next()):
            chunks += 1
        if chunks < 2:
            raise AssertionError("tiny_lm streamed fewer than two chunks for 8 tokens")
    finally:
        stream.stop()
    return "ok"


def grpc_stream_cancel(clients: Clients) -> str:
    """A stream left after its first response, its request cancelled (``stop_stream``)."""
    stream = _Stream(clients)
    try:
        clients.grpc.async_stream_infer("repeat_int32", _repeat_inputs([1, 2, 3], [0, 500, 500]))
        stream.next()
    finally:
        stream.stop(cancel=True)
    return "cancelled"


def shared_memory(clients: Clients) -> str:
    """Register a region, infer ``simple`` from and into it, unregister it: over REST on
    even turns, over gRPC on odd ones."""
    client, module = _next_turn(clients)
    name = f"soak_{clients.worker}_{clients.serial}"
    region = shm.create_shared_memory_region(name, f"/{name}", 256)
    try:
        shm.set_shared_memory_region(region, [SIMPLE_A, SIMPLE_B])
        client.register_system_shared_memory(name, f"/{name}", 256)
        try:
            inputs = [module.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            outputs = [module.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
            for offset, tensor in enumerate([*inputs, *outputs]):
                tensor.set_shared_memory(name, 64, offset=64 * offset)
            client.infer("simple", inputs, outputs=outputs)
        finally:
            client.unregister_system_shared_memory(name)
        sums = shm.get_contents_as_numpy(region, np.int32, [1, 16], offset=128)
        differences = shm.get_contents_as_numpy(region, np.int32, [1, 16], offset=192)
        if not (
            np.array_equal(sums, SIMPLE_A + SIMPLE_B)
            and np.array_equal(differences, SIMPLE_A - SIMPLE_B)
        ):
            raise AssertionError("simple wrote wrong sums to shared memory")
    finally:
        shm.destroy_shared_memory_region(region)
    return "ok"


def _generate_body(max_tokens: int) -> bytes:
    parameters = {"max_tokens": max_tokens, "ignore_eos": True}
    return json.dumps({"text_input": "The soak test says", "parameters": parameters}).encode()


def _event_stream(clients: Clients, path: str, body: bytes) -> list[bytes]:
    """The data of each server-sent event of a whole answer; the body's end unsent
    (the connection lost) raises ``http.client.IncompleteRead``."""
    connection = http.client.HTTPConnection(
        clients.host, clients.http_port, timeout=REPLY_TIMEOUT_S
    )
    try:
        connection.request("POST", path, body)
        response = connection.getresponse()
        if response.status != 200:
            raise AssertionError(f"{path} answered {response.status}")
        text = response.read()  # not line by line: that takes a cut-off body for its end
    finally:
        connection.close()
    return [line[6:] for line in text.split(b"\n") if line.startswith(b"data: ")]


def generate_stream(clients: Clients) -> str:
    """``tiny_lm``'s server-sent events, the last one carrying ``finish_reason``."""
    events = _event_stream(clients, "/v2/models/tiny_lm/generate_stream", _generate_body(8))
    if not events or "finish_reason" not in json.loads(events[-1]):
        raise AssertionError(f"generate_stream ended after {len(events)} events, unfinished")
    return "ok"


def generate_decoupled(clients: Clients) -> str:
    """The decoupled ``repeat_int32`` through ``generate_stream`` on its own tensors: one
    event per element, in order."""
    body = json.dumps({"IN": [7, 8, 9], "DELAY": [0, 0, 0], "WAIT": [0]}).encode()
    events = _event_stream(clients, "/v2/models/repeat_int32/generate_stream", body)
    got = [json.loads(event)["OUT"] for event in events]
    if got != [7, 8, 9]:
        raise AssertionError(f"repeat_int32's generate_stream answered {got}")
    return "ok"


def _raw_request(
    path: str, body: bytes, sent: int | None = None, json_bytes: int | None = None
) -> bytes:
    """A request of ``body`` (its first ``sent`` bytes); ``json_bytes``: the length of
    its JSON header where binary tensors follow it (the binary data extension)."""
    binary = "" if json_bytes is None else f"Inference-Header-Content-Length: {json_bytes}\r\n"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        f"{binary}Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body[:sent]


def disconnect_request(clients: Clients) -> str:
    """A raw connection closed early: on odd turns halfway through its body, on even
    turns right after sending a whole request to ``delay``, which is then still queued or
    running (the server must withdraw it)."""
    clients.serial += 1
    tensor = {"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [SLOW_MS]}
    body = json.dumps({"inputs": [tensor]}).encode()
    sent = len(body) // 2 if clients.serial % 2 else None
    with clients.connect() as sock:
        sock.sendall(_raw_request("/v2/models/delay/infer", body, sent))
    return "ok"


def disconnect_large(clients: Clients) -> str:
    """A raw connection closed halfway through a 1 MiB binary tensor (the binary data
    extension): what the server received of it must be let go."""
    size = LARGE_TENSOR.nbytes
    tensor = {"name": "INPUT0", "shape": [LARGE_TENSOR.size], "datatype": "FP32",
              "parameters": {"binary_data_size": size}}  # fmt: skip
    header = json.dumps({"inputs": [tensor]}).encode()
    body = header + LARGE_TENSOR.tobytes()
    request = _raw_request("/v2/models/identity_fp32/infer", body, len(header) + size // 2,
                           json_bytes=len(header))  # fmt: skip
    with clients.connect() as sock:
        sock.sendall(request)
    return "ok"


def disconnect_stream(clients: Clients) -> str:
    """A raw connection that reads ``generate_stream``'s first event of a long answer,
    then closes: the server must abort the generation."""
    with clients.connect() as sock:
        sock.sendall(_raw_request("/v2/models/tiny_lm/generate_stream", _generate_body(512)))
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("generate_stream closed before its first event")
            received += chunk
        if not received.startswith(b"HTTP/1.1 200"):
            raise AssertionError(f"generate_stream answered {received[:40]!r}")
    return "ok"


def openai_chat_stream(clients: Clients) -> str:
    """``tiny_lm`` through OpenAI's chat completions, streamed: its chunks, the last with
    a ``finish_reason``, then ``[DONE]``."""
    body = {"model": "tiny_lm", "messages": [{"role": "user", "content": "The soak test"}],
            "max_tokens": 8, "stream": True}  # fmt: skip
    events = _event_stream(clients, "/v1/chat/completions", json.dumps(body).encode())
    if events[-1:] != [b"[DONE]"]:
        raise AssertionError("chat completions ended without [DONE]")
    if len(events) < 2 or json.loads(events[-2])["choices"][0]["finish_reason"] is None:
        raise AssertionError("chat completions' last chunk carried no finish_reason")
    return "ok"


def metrics_scrape(clients: Clients) -> str:
    """``/metrics`` on the HTTP port (with ``--workers``, every worker's counters pulled
    into one scrape): Triton's request counters for ``simple`` among them."""
    connection = http.client.HTTPConnection(
        clients.host, clients.http_port, timeout=REPLY_TIMEOUT_S
    )
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        text = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise AssertionError(f"/metrics answered {response.status}")
    if b'nv_inference_request_success{model="simple",version="1"}' not in text:
        raise AssertionError("/metrics has no request counter for simple")
    return "ok"


def _delay_input() -> Any:
    tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[SLOW_MS]], dtype=np.float32))
    return tensor


def _expect_status(error: InferenceServerException, status: str) -> str:
    if status not in str(error.status()):
        raise error
    return "cancelled"


def grpc_cancel(clients: Clients) -> str:
    """A unary call to ``delay`` cancelled by the client 20 ms in."""
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    call = clients.grpc.async_infer(
        "delay", [_delay_input()], callback=lambda result, error: replies.put((result, error))
    )
    time.sleep(0.02)
    call.cancel()
    _, error = replies.get(timeout=REPLY_TIMEOUT_S)
    if error is None:
        return "ok"  # the answer came before the cancellation could
    return _expect_status(error, "CANCELLED")


def grpc_timeout(clients: Clients) -> str:
    """A unary call to ``delay`` with a 50 ms deadline (``grpc-timeout``)."""
    try:
        clients.grpc.infer("delay", [_delay_input()], client_timeout=0.05)
    except InferenceServerException as error:
        return _expect_status(error, "DEADLINE_EXCEEDED")
    return "ok"


# Each kind, and its weight: how many times it comes in each round of the schedule.
KINDS: dict[str, tuple[int, Callable[[Clients], str]]] = {
    "rest_json": (3, rest_json),
    "rest_binary": (2, rest_binary),
    "large_tensor": (1, large_tensor),
    "grpc_unary": (3, grpc_unary),
    "grpc_stream": (2, grpc_stream),
    "grpc_stream_llm": (1, grpc_stream_llm),
    "shared_memory": (2, shared_memory),
    "generate_stream": (1, generate_stream),
    "generate_decoupled": (1, generate_decoupled),
    "openai_chat_stream": (1, openai_chat_stream),
    "metrics_scrape": (1, metrics_scrape),
    "disconnect_request": (2, disconnect_request),
    "disconnect_large": (1, disconnect_large),
    "disconnect_stream": (1, disconnect_stream),
    "grpc_cancel": (1, grpc_cancel),
    "grpc_timeout": (1, grpc_timeout),
    "grpc_stream_cancel": (1, grpc_stream_cancel),
}
