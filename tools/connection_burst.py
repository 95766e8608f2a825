"""How long a new client waits while a crowd of connections arrives at once.

    python tools/connection_burst.py                        # gRPC port, 3 rounds
    python tools/connection_burst.py --protocol http --rounds 1
    python tools/connection_burst.py --port 8001 --no-server   # a server already running

Per round: starts ``trioserve run`` (whichever ``trioserve`` this Python imports; use
``PYTHONPATH=OTHER/src`` for another build, ``--server-cpu`` to pin it), then two
processes of this script: a prober, which every ``--interval`` opens a fresh connection
and asks the server if it is live (gRPC ServerLive on a new channel, or
``GET /v2/health/live`` on a new socket), and, a second later, a burst holder, which opens
``--connections`` connections as fast as it can (each sends the HTTP/2 preface, or
nothing on the HTTP port), holds them idle, and closes them after ``--hold`` seconds.
Prints, per round, the probes made, those refused (or failed), and the median, 99th
percentile and slowest answer, in milliseconds, and the slowest of those begun while
the crowd arrived (and the second after), and within a second of its close (a crowd
leaving at once is work too); then the server is stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + SETTINGS
SERVICE = "/inference.GRPCInferenceService/"


def raise_descriptor_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def burst(port: int, count: int, hold_s: float, preface: bool) -> None:
    """Open ``count`` connections back to back, hold them, close them; report how many
    opened and how long opening took."""
    raise_descriptor_limit()
    held: list[socket.socket] = []
    failed = 0
    arriving_at = time.time()
    began = time.perf_counter()
    for _ in range(count):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if preface:
                sock.sendall(PREFACE)
            held.append(sock)
        except OSError:
            failed += 1
    opened_s = time.perf_counter() - began
    time.sleep(max(0.0, hold_s - opened_s))
    closing_at = time.time()
    for sock in held:
        sock.close()
    print(
        json.dumps(
            {
                "opened": len(held), "failed": failed, "opening_s": opened_s,
                "arriving_at": arriving_at, "closing_at": closing_at,
            }
        )
    )  # fmt: skip


def probe(port: int, protocol: str, duration_s: float, interval_s: float) -> None:
    """Ask every ``interval_s`` on a fresh connection; print when each began (Unix time)
    and its answer's time (ms), or None when the server refused or failed it."""
    times: list[tuple[float, float | None]] = []
    ask = _grpc_asker(port) if protocol == "grpc" else _http_asker(port)
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        began, at = time.perf_counter(), time.time()
        try:
            ask()
            times.append((at, (time.perf_counter() - began) * 1000))
        except Exception:  # refused, reset, timed out: counted, not raised
            times.append((at, None))
        time.sleep(interval_s)
    print(json.dumps(times), flush=True)


def _grpc_asker(port: int):  # type: ignore[no-untyped-def]
    import grpc
    from tritonclient.grpc import service_pb2

    def ask() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            live = channel.unary_unary(
                SERVICE + "ServerLive",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=service_pb2.ServerLiveResponse.FromString,
            )
            live(service_pb2.ServerLiveRequest(), timeout=10)

    return ask


def _http_asker(port: int):  # type: ignore[no-untyped-def]
    def ask() -> None:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=10).read()

    return ask


def start_server(args: argparse.Namespace) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "trioserve", "run", "--http-port", str(args.http_port),
        "--grpc-port", str(args.grpc_port), "--allow-metrics", "false",
    ]  # fmt: skip
    if args.server_cpu is not None:
        command = ["taskset", "-c", args.server_cpu, *command]
    server = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, preexec_fn=raise_descriptor_limit
    )
    assert server.stderr is not None
    for line in server.stderr:
        if "serving models" in line:  # every port listens
            break
    else:
        raise RuntimeError("the server did not start")
    # Keep reading what it logs: a full pipe would block the server mid-write.
    threading.Thread(target=server.stderr.read, daemon=True).start()
    return server


def one_round(args: argparse.Namespace, port: int) -> dict[str, float]:
    me = [sys.executable, __file__, "--port", str(port), "--protocol", args.protocol]
    prober = subprocess.Popen(
        [
            *me,
            "--role",
            "probe",
            "--duration",
            str(args.duration),
            "--interval",
            str(args.interval),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)  # a few probes before the burst
    holder = subprocess.Popen(
        [*me, "--role", "burst", "--connections", str(args.connections), "--hold", str(args.hold)],
        stdout=subprocess.PIPE,
        text=True,
    )
    probed, _ = prober.communicate()
    held, _ = holder.communicate()
    times = json.loads(probed)
    answered = sorted(ms for _, ms in times if ms is not None)
    crowd = json.loads(held)

    def slowest_within(start: float, end: float) -> float:
        return max((ms or 0.0 for at, ms in times if start <= at < end), default=0.0)

    arrived = crowd["arriving_at"] + crowd["opening_s"]
    return {
        "probes": len(times),
        "refused": len(times) - len(answered),
        "median_ms": statistics.median(answered),
        "p99_ms": answered[min(len(answered) - 1, round(0.99 * (len(answered) - 1)))],
        "max_ms": answered[-1],
        # the slowest probe begun while the crowd arrived and the second after; around
        # its close (a second either side); and the rest of the time
        "arrival_max_ms": slowest_within(crowd["arriving_at"], arrived + 1),
        "close_max_ms": slowest_within(crowd["closing_at"] - 1, crowd["closing_at"] + 1),
        "burst_opened": crowd["opened"],
        "burst_failed": crowd["failed"],
        "burst_opening_s": round(crowd["opening_s"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--duration", type=float, default=14.0, help="probing, seconds")
    parser.add_argument("--interval", type=float, default=0.05, help="between probes, s")
    parser.add_argument("--hold", type=float, default=8.0, help="the burst's life, s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grpc-port", type=int, default=18701)
    parser.add_argument("--http-port", type=int, default=18700)
    parser.add_argument("--server-cpu", help="taskset list for the server, e.g. 0")
    parser.add_argument("--no-server", action="store_true", help="probe a running one")
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["probe", "burst"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "probe":
        probe(args.port, args.protocol, args.duration, args.interval)
        return
    if args.role == "burst":
        burst(args.port, args.connections, args.hold, preface=args.protocol == "grpc")
        return
    port = args.grpc_port if args.protocol == "grpc" else args.http_port
    print(f"{args.protocol} port, {args.connections} connections, python {sys.version.split()[0]}")
    for index in range(args.rounds):
        server = None if args.no_server else start_server(args)
        try:
            result = one_round(args, port)
        finally:
            if server is not None:
                server.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.wait(timeout=30)
                if server.poll() is None:
                    server.kill()
        print(f"round {index + 1}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
