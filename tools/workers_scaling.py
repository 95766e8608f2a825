"""Throughput of ``trioserve run --workers W`` for W = 1, 2, 4, 8, 14 on a many-core machine.

    PYTHONPATH=src python3 tools/workers_scaling.py              # the full run (< 240 s)
    PYTHONPATH=src python3 tools/workers_scaling.py --duration 0.5 --warmup 0.2 \\
        --workers 1,2 --connections 16                           # a quick check

For each W the server (``python -m trioserve run``, the built-in ``simple`` alone) runs pinned to
cores 0..W+1 (fewer if the machine needs the rest for the load); a load generator of
this file's own runs on the remaining cores, one process per core, and keeps
``--connections`` connections in all busy, closed loop (each sends its next request as
its answer arrives): ``simple`` ([1,16] INT32 twice) over HTTP with a JSON body, then
over gRPC (ModelInfer, raw tensors). W = 0 (one process, no workers) is measured too,
for reference. The table gives requests/s per point, the ratio to W = 1, and the CPU the
core process and the workers spent in the measured window (from ``/proc``): a core
process near 100% of its core is what bounds the point. It is also written to
``$OUT/workers_scaling.txt`` when ``OUT`` is set.

Needs only Python 3.11+, numpy, protobuf and trioserve's dependencies: the load
generator speaks HTTP/1.1 and HTTP/2 itself (no wrk, h2load, grpcio or tritonclient).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench import children

ROOT = Path(__file__).resolve().parent.parent
_SIMPLE = {
    "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
    ]
}


# The load generator: one process per load core -----------------------------------


def _http_request(port: int) -> bytes:
    body = json.dumps(_SIMPLE).encode()
    head = (
        f"POST /v2/models/simple/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def http_load(port: int, connections: int, begin: float, duration: float) -> int:
    """Answers received in the measured window over ``connections`` keep-alive
    connections, each sending its next request when its answer is complete."""
    request = _http_request(port)
    selector = selectors.DefaultSelector()
    buffers: dict[socket.socket, bytearray] = {}
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        buffers[sock] = bytearray()
        selector.register(sock, selectors.EVENT_READ)
        sock.send(request)
    end = _window(begin, duration)
    counted = 0
    while (now := time.monotonic()) < end:
        for key, _ in selector.select(0.1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            data = sock.recv(262144)
            if not data:
                raise SystemExit("the server closed a connection")
            buffer = buffers[sock]
            buffer += data
            while (head_end := buffer.find(b"\r\n\r\n")) >= 0:
                head = bytes(buffer[:head_end]).lower()
                at = head.find(b"content-length:")
                line_end = head.find(b"\r\n", at)
                length = int(head[at + 15 : line_end if line_end >= 0 else len(head)])
                total = head_end + 4 + length
                if len(buffer) < total:
                    break
                if not head.startswith(b"http/1.1 200"):
                    raise SystemExit(f"unexpected answer: {bytes(buffer[:total])[:200]!r}")
                del buffer[:total]
                if begin <= now:
                    counted += 1
                sock.send(request)
    return counted


def _grpc_request() -> bytes:
    import numpy as np

    from trioserve.grpc._generated import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name="simple")
    for name, values in (("INPUT0", range(16)), ("INPUT1", [1] * 16)):
        tensor = request.inputs.add(name=name, datatype="INT32")
        tensor.shape.extend([1, 16])
        request.raw_input_contents.append(np.array(list(values), dtype=np.int32).tobytes())
    return bytes(request.SerializeToString())


def _literal(name: str, value: str) -> bytes:
    """An HPACK header field as a literal without indexing, no Huffman coding (RFC 7541
    6.2.2); names and values here are short (< 127 bytes)."""
    return bytes([0, len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


_DATA, _HEADERS, _SETTINGS, _PING, _WINDOW_UPDATE = 0, 1, 4, 6, 8
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1


def grpc_load(port: int, connections: int, begin: float, duration: float) -> int:
    """As ``http_load``, over HTTP/2 (h2c, prior knowledge): one ModelInfer call at a time
    per connection. A minimal client of its own: grpcio's Python client would cost the
    load cores more than the server spends per call."""
    message = _grpc_request()
    block = b"".join(
        _literal(name, value)
        for name, value in (
            (":method", "POST"), (":scheme", "http"), (":authority", f"127.0.0.1:{port}"),
            (":path", "/inference.GRPCInferenceService/ModelInfer"),
            ("content-type", "application/grpc"), ("te", "trailers"),
        )
    )  # fmt: skip
    body = b"\0" + len(message).to_bytes(4, "big") + message

    def call(stream: int) -> bytes:
        return _frame(_HEADERS, _END_HEADERS, stream, block) + _frame(
            _DATA, _END_STREAM, stream, body
        )

    selector = selectors.DefaultSelector()
    states: dict[socket.socket, list[object]] = {}  # socket -> [buffer, stream id, got data]
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(_SETTINGS, 0, 0, b"")
    # A large connection window, so that answers never wait for our WINDOW_UPDATEs.
    preface += _frame(_WINDOW_UPDATE, 0, 0, (2**30).to_bytes(4, "big"))
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        states[sock] = [bytearray(), 1, False]
        selector.register(sock, selectors.EVENT_READ)
        sock.send(preface + call(1))
    end = _window(begin, duration)
    counted = 0
    received = 0
    while (now := time.monotonic()) < end:
        for key, _ in selector.select(0.1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            data = sock.recv(262144)
            if not data:
                raise SystemExit("the server closed a connection")
            state = states[sock]
            buffer = state[0]
            assert isinstance(buffer, bytearray)
            buffer += data
            out = b""
            while len(buffer) >= 9:
                length = int.from_bytes(buffer[:3], "big")
                if len(buffer) < 9 + length:
                    break
                kind, flags = buffer[3], buffer[4]
                stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                del buffer[: 9 + length]
                if kind == _SETTINGS and not flags & _ACK:
                    out += _frame(_SETTINGS, _ACK, 0, b"")
                elif kind == _PING and not flags & _ACK:
                    out += _frame(_PING, _ACK, 0, b"\0" * 8)
                elif kind == _DATA and stream == state[1]:
                    state[2] = True
                    received += length
                elif kind == _HEADERS and flags & _END_STREAM and stream == state[1]:
                    if not state[2]:
                        raise SystemExit("a call failed (trailers without a reply)")
                    if begin <= now:
                        counted += 1
                    state[1] = next_stream = int(state[1]) + 2  # type: ignore[call-overload]
                    state[2] = False
                    out += call(next_stream)
            if received > 2**29:  # top the connection window up again
                out += _frame(_WINDOW_UPDATE, 0, 0, received.to_bytes(4, "big"))
                received = 0
            if out:
                sock.sendall(out)
    return counted


# The conductor ----------------------------------------------------------------------


def _start_server(
    workers: int, cores: list[int], python: str
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    ports_file = Path(tempfile.mkdtemp()) / "ports.json"
    command = [
        python, "-m", "trioserve", "run", "--http-port", "0", "--grpc-port", "0",
        "--workers", str(workers), "--ports-file", str(ports_file), "--log-level", "warning",
        # Only the model measured: the others' instance processes make each start slower.
        "--model-control-mode", "explicit", "--load-model", "simple",
    ]  # fmt: skip
    server = subprocess.Popen(command, cwd=ROOT, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    deadline = time.monotonic() + 120
    while not ports_file.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit(f"the server did not start: {command}")
        time.sleep(0.1)
    ports = json.loads(ports_file.read_text())
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/v2/health/ready") as answer:
        assert answer.status == 200
    return server, ports


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the core process (the server's own) and of its children
    (the front-end workers) together."""
    return _cpu_seconds(pid), sum(_cpu_seconds(child) for child in children(pid))


@dataclass
class Point:
    """One measured point: requests/s, and the CPU seconds per second that the core
    process and the workers together spent in the measured window."""

    rate: float
    core_busy: float
    workers_busy: float

    def cells(self, base: float | None) -> str:
        ratio = f"{self.rate / base:.2f}" if base else "-"
        core_us = 1e6 * self.core_busy / self.rate if self.rate else 0.0
        return (
            f"{self.rate:>11.0f} {ratio:>6} {100 * self.core_busy:>6.0f}% {core_us:>7.1f}"
            f" {self.workers_busy:>7.2f}"
        )


_START_S = 1.0
"""What a load process is given to start (Python, its imports, its connections) before
its warm-up: the window is the same instant for the server's CPU and every load
process's count (``time.monotonic`` is one clock for all the machine's processes)."""


def _window(begin: float, duration: float) -> float:
    """The end of a load process's measured window; refuses one that began before the
    process was ready (its count would be short of the server's CPU window)."""
    if time.monotonic() > begin:
        raise SystemExit("the load process was not ready when the measured window began")
    return begin + duration


def _measure(
    protocol: str,
    port: int,
    connections: int,
    load_cores: list[int],
    args: argparse.Namespace,
    server_pid: int,
) -> Point:
    """Requests/s of the load processes together (one per load core), and the server's
    CPU over the same window."""
    begin = time.monotonic() + _START_S + args.warmup
    processes = []
    for index, core in enumerate(load_cores):
        share = connections // len(load_cores) + (index < connections % len(load_cores))
        if share == 0:
            continue
        command = [
            args.python, __file__, "--load", protocol, "--port", str(port),
            "--connections", str(share), "--begin", str(begin),
            "--duration", str(args.duration),
        ]  # fmt: skip
        processes.append(
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                preexec_fn=lambda core=core: os.sched_setaffinity(0, [core]),  # type: ignore[misc]
            )
        )
    time.sleep(begin - time.monotonic())
    core_before, workers_before = _server_cpu(server_pid)
    time.sleep(begin + args.duration - time.monotonic())
    core_after, workers_after = _server_cpu(server_pid)
    total = 0
    for process in processes:
        out, _ = process.communicate(timeout=args.duration + 60)
        if process.returncode != 0:
            raise SystemExit(f"a load process failed ({process.returncode})")
        total += int(out.decode().strip().splitlines()[-1])
    return Point(
        total / args.duration,
        (core_after - core_before) / args.duration,
        (workers_after - workers_before) / args.duration,
    )


def conduct(args: argparse.Namespace) -> str:
    cpus = sorted(os.sched_getaffinity(0))
    min_load = max(1, len(cpus) // 8)
    rows = []
    results: dict[tuple[str, int], Point] = {}
    for workers in args.workers:
        server_count = min(workers + 2, len(cpus) - min_load)
        server_cores, load_cores = cpus[:server_count], cpus[server_count:]
        server, ports = _start_server(workers, server_cores, args.python)
        try:
            for protocol in ("http", "grpc"):
                results[protocol, workers] = _measure(
                    protocol, ports[protocol], args.connections, load_cores, args, server.pid
                )
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        rows.append((workers, len(server_cores), len(load_cores)))
    base = {p: results[p, 1].rate if (p, 1) in results else None for p in ("http", "grpc")}
    lines = [
        f"simple [1,16] INT32, {args.connections} connections, {args.duration:g} s per point "
        f"after {args.warmup:g} s warm-up; {len(cpus)} cores; server: {args.python} "
        f"({_version(args.python)})",
        "core: the core process's CPU (% of one core) and CPU per request (us); "
        "workers: the workers' CPU together (cores)",
        f"{'workers':>7} {'server cores':>12} {'load cores':>10} "
        + " ".join(
            f"{p + ' req/s':>11} {'x W=1':>6} {'core':>7} {'us/req':>7} {'workers':>7}"
            for p in ("HTTP", "gRPC")
        ),
    ]
    for workers, server_cores, load_count in rows:
        cells = " ".join(results[p, workers].cells(base[p]) for p in ("http", "grpc"))
        lines.append(f"{workers:>7} {server_cores:>12} {load_count:>10} {cells}")
    return "\n".join(lines)


def _version(python: str) -> str:
    command = [python, "-c", "import sys; print(sys.version.split()[0])"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    # The server and the load processes import trioserve from this checkout.
    paths = [str(ROOT / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="0,1,2,4,8,14", help="comma-separated W values")
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per point")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to serve with")
    parser.add_argument("--load", choices=("http", "grpc"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--begin", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load is not None:
        load = http_load if args.load == "http" else grpc_load
        print(load(args.port, args.connections, args.begin, args.duration))
        return
    args.workers = [int(w) for w in args.workers.split(",")]
    table = conduct(args)
    print(table)
    out = os.environ.get("OUT")
    if out:
        Path(out, "workers_scaling.txt").write_text(table + "\n")


if __name__ == "__main__":
    main()
