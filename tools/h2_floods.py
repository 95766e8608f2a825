"""Abuse of a running server's gRPC port, one case at a time: the server's peak and
settled memory (RSS, from ``/proc``) and how long a probe on another connection waits.

    python -m trioserve run --http-port 0 &     # the built-in gRPC server on 8001
    python tools/h2_floods.py --pid $! --cases declared,reset,ping

Each case opens its own connections (raw HTTP/2: frames by hand, or the ``h2`` package
where the client must follow flow control), floods, and closes them. Meanwhile a probe
thread calls ServerLive over a fresh connection every 50 ms and keeps its slowest
answer. RSS is sampled every 10 ms; "after" is read 2 s after the flood's connections
closed (``trioserve run`` collects garbage every second).

Cases: declared (a prefix declaring a 2 GiB message), reset (complete calls each
followed by a WINDOW_UPDATE of 0), continuation (empty CONTINUATION frames), hpack
(calls with distinct 60 KB header values on 4 connections), ping (PINGs from a client
that never reads), stream (ModelStreamInfer of 1 MiB requests on 8 streams whose
answers are never read), large (one legal message of ``--large-mib``), idle (5,000 idle
connections, then probes that each need a new connection).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
from tritonclient.grpc import service_pb2

from trioserve.grpc._h2_frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PING,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from trioserve.grpc._hpack import encode_headers
from trioserve.grpc._infer_wire import _encode_varint

SERVICE = "/inference.GRPCInferenceService/"
MiB = 1024 * 1024


def header_block(path: str, *extra: tuple[bytes, bytes]) -> bytes:
    """A request's header block that leaves the dynamic table alone."""
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
              (b":authority", b"x"), (b"content-type", b"application/grpc"), *extra]  # fmt: skip
    return encode_headers(fields)


def message(payload: bytes) -> bytes:
    return struct.pack(">BL", 0, len(payload)) + payload


def opened(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
    return sock


def send_for(sock: socket.socket, data: bytes, patience_s: float = 5.0) -> int:
    """Send ``data`` until the server stops taking it for ``patience_s``; bytes sent."""
    sock.settimeout(patience_s)
    view = memoryview(data)
    sent = 0
    try:
        while sent < len(data):
            sent += sock.send(view[sent : sent + MiB])
    except OSError:
        pass
    return sent


# --- cases ------------------------------------------------------------------------------


def case_declared(port: int) -> list[socket.socket]:
    sock = opened(port)
    block = header_block(SERVICE + "ModelInfer")
    prefix = struct.pack(">BL", 0, 2**31 - 1) + b"x"
    sock.sendall(frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, 0, 1, prefix))
    time.sleep(2)
    return [sock]


def case_reset(port: int) -> list[socket.socket]:
    sock = opened(port)
    block = header_block(SERVICE + "ServerLive")
    call = [
        frame(HEADERS, END_HEADERS, sid, block)
        + frame(DATA, END_STREAM, sid, message(b""))
        + frame(WINDOW_UPDATE, 0, sid, b"\0\0\0\0")
        for sid in range(1, 200_000, 2)
    ]
    send_for(sock, b"".join(call))
    return [sock]


def case_continuation(port: int) -> list[socket.socket]:
    sock = opened(port)
    empty = frame(CONTINUATION, 0, 1)
    send_for(sock, frame(HEADERS, 0, 1, b"\x82") + empty * 5_000_000)
    return [sock]


def case_hpack(port: int) -> list[socket.socket]:
    socks = [opened(port) for _ in range(4)]
    for index, sock in enumerate(socks):
        calls = []
        for call in range(512):
            sid = 2 * call + 1
            value = (b"%02d%06d" % (index, call)) * 7_500
            block = header_block(SERVICE + "ServerLive", (b"x-big", value))
            calls.append(
                frame(HEADERS, END_HEADERS, sid, block) + frame(DATA, END_STREAM, sid, message(b""))
            )
        send_for(sock, b"".join(calls))
    time.sleep(2)
    return socks


def case_ping(port: int) -> list[socket.socket]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", port))
    sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
    send_for(sock, frame(PING, 0, 0, b"12345678") * (24 * MiB))  # 408 MB
    return [sock]


class FlowClient:
    """An ``h2`` client that follows the server's flow control but never acknowledges
    what it receives: the server's answers wait on windows that never reopen."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.answered = False  # response headers came
        self.h2.initiate_connection()
        self.sock.sendall(self.h2.data_to_send())
        self.pump(5.0)

    def pump(self, timeout_s: float) -> bool:
        """Read what the server sent (its windows, settings); False when nothing came."""
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(MiB)
        except OSError:
            return False
        if not data:
            return False
        self.answered |= any(
            isinstance(event, h2.events.ResponseReceived) for event in self.h2.receive_data(data)
        )
        self.sock.sendall(self.h2.data_to_send())
        return True

    def call(self, path: str) -> int:
        sid: int = self.h2.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
                   (":authority", "x"), ("content-type", "application/grpc")]  # fmt: skip
        self.h2.send_headers(sid, headers)
        return sid

    def send(self, sid: int, data: bytes, end: bool, patience_s: float = 5.0) -> bool:
        """Send ``data`` on ``sid`` as windows allow; False once they stay shut."""
        view = memoryview(data)
        while view:
            room = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            if room <= 0:
                if not self.pump(patience_s):
                    return False
                continue
            chunk, view = view[:room], view[room:]
            self.h2.send_data(sid, chunk.tobytes(), end_stream=end and not view)
            self.sock.settimeout(patience_s)
            try:
                self.sock.sendall(self.h2.data_to_send())
            except OSError:
                return False
        return True


def infer_head(size: int) -> bytes:
    """A ModelInferRequest for ``identity_fp32`` up to its tensor's ``size`` bytes (field
    7's tag and length): the tensor's bytes follow."""
    request = service_pb2.ModelInferRequest(model_name="identity_fp32")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[size // 4])
    return request.SerializeToString() + b"\x3a" + _encode_varint(size)


def case_stream(port: int) -> list[socket.socket]:
    client = FlowClient(port)
    sids = [client.call(SERVICE + "ModelStreamInfer") for _ in range(8)]
    payload = message(infer_head(MiB) + bytes(MiB))
    for _ in range(300):  # each stream's turn in turn, until the windows stay shut
        if not all(client.send(sid, payload, end=False) for sid in sids):
            break
    return [client.sock]


def case_large(port: int, size: int, method: str) -> list[socket.socket]:
    client = FlowClient(port)
    sid = client.call(SERVICE + method)
    head = infer_head(size)
    client.send(sid, struct.pack(">BL", 0, len(head) + size) + head, end=False)
    client.send(sid, bytes(size), end=True, patience_s=30.0)
    while not client.answered and client.pump(60.0):  # until the answer starts
        pass
    return [client.sock]


def case_idle(port: int) -> list[socket.socket]:
    socks = []
    for _ in range(5000):
        with contextlib.suppress(OSError):  # refused: closed at once
            socks.append(opened(port))
    time.sleep(6)  # the probes meanwhile
    return socks


# --- measuring --------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Watch(threading.Thread):
    """Samples the server's RSS and probes it from another connection until stopped."""

    def __init__(self, pid: int, port: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.port = pid, port
        self.peak_mb = rss_mb(pid)
        self.slowest_s = 0.0
        self.probes = self.refused = 0
        self.stop = threading.Event()

    def run(self) -> None:
        sampler = threading.Thread(target=self._sample, daemon=True)
        sampler.start()
        while not self.stop.is_set():
            start = time.perf_counter()
            with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
                live = channel.unary_unary(
                    SERVICE + "ServerLive",
                    request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=service_pb2.ServerLiveResponse.FromString,
                )
                try:
                    live(service_pb2.ServerLiveRequest(), timeout=10)
                except grpc.RpcError:
                    self.refused += 1
            self.probes += 1
            self.slowest_s = max(self.slowest_s, time.perf_counter() - start)
            self.stop.wait(0.05)
        sampler.join()

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid))
            time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid", type=int, required=True, help="the server's process id")
    parser.add_argument("--port", type=int, default=8001, help="its gRPC port")
    parser.add_argument("--cases", default="declared,reset,continuation,hpack,ping,stream,large")
    parser.add_argument("--large-mib", type=int, default=1024)
    parser.add_argument("--large-method", default="ModelInfer", help="or ModelStreamInfer")
    args = parser.parse_args()
    cases: dict[str, Callable[[int], list[socket.socket]]] = {
        "declared": case_declared, "reset": case_reset, "continuation": case_continuation,
        "hpack": case_hpack, "ping": case_ping, "stream": case_stream,
        "large": lambda port: case_large(port, args.large_mib * MiB, args.large_method),
        "idle": case_idle,
    }  # fmt: skip
    print("case          start MB  peak MB  after MB  slowest probe  probes refused")
    for name in args.cases.split(","):
        start = rss_mb(args.pid)
        watch = Watch(args.pid, args.port)
        watch.start()
        began = time.perf_counter()
        socks = cases[name](args.port)
        elapsed = time.perf_counter() - began
        for sock in socks:
            sock.close()
        watch.stop.set()
        watch.join()
        time.sleep(2)
        print(
            f"{name:12} {start:9.0f} {watch.peak_mb:8.0f} {rss_mb(args.pid):9.0f}"
            f" {watch.slowest_s * 1000:11.0f} ms {watch.probes:7} {watch.refused:7}"
            f"   ({elapsed:.1f} s)"
        )


if __name__ == "__main__":
    main()
