"""Compare two builds of trioserve by CPU time per request, both loaded at the same time.

    python tools/paired_bench.py /path/to/old/src src --duration 10 --rounds 3
    python tools/paired_bench.py src src --old-python A/bin/python --new-python B/bin/python
    python tools/paired_bench.py /path/to/old/src src --mode big-shm --connections 1

The second form compares two interpreters serving the same source (each needs
trioserve's dependencies installed). ``--new-flag`` adds a ``trioserve run`` flag to the
new side only, to measure what a setting costs::

    python tools/paired_bench.py src src --new-flag=--trace-config=level=TIMESTAMPS

and ``--old-flag`` to the old side only; both, to compare two builds run the same way
(``--old-flag=--workers=1 --new-flag=--workers=1``: the forwarded path). A server's CPU
is that of all its processes (its workers and model processes too).

The machine's speed drifts (a shared virtual machine: by a third from minute to minute),
so throughput measured in turns compares the moments as much as the builds. Here both
servers run at once, pinned to the same core, each under its own wrk (HTTP JSON,
``simple``, 8 connections unless ``--connections`` says otherwise) on another core: they share the core and its slow and fast
moments alike. ``--mode big-shm`` sends ``bench.py``'s 16 MiB ``identity_fp32`` round
trip through system shared memory instead, each server with regions of its own;
``--mode grpc`` sends ModelInfer of ``simple`` by h2load (``--connections`` connections,
one call at a time on each); ``--mode generate-stream`` posts ``tiny_lm``'s
``generate_stream`` (8 tokens, server-sent events) by wrk. Each server's CPU time (user + system, from ``/proc/PID/stat``, its processes') divided by
the requests it answered is its cost per request; the ratio of the two costs is the
figure to read. Two copies of one build give a ratio within about 2% of 1.

Both costs are higher than one server alone would show (two working sets share one
core's caches); compare them with each other, not with ``bench.py`` figures.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench import (
    _LUA,
    _free_port,
    _wait_ready,
    big_regions,
    cpu_seconds,
    grpc_request,
    http_body,
    model_of,
)

MODES = ("http-json", "big-shm", "grpc", "generate-stream")
# generate-stream's request: a short generation, so the front end's share stays visible.
_STREAM_BODY = b'{"text_input": "the quick brown fox", "max_tokens": 8, "temperature": 0}'


Side = tuple[str, str, list[str]]  # src folder, interpreter, extra flags


def _start(side: Side, cpus: str, grpc: bool) -> tuple[subprocess.Popen[bytes], int, int]:
    """The server and its HTTP and gRPC ports (gRPC only when ``grpc``)."""
    src, python, flags = side
    port, grpc_port = _free_port(), _free_port()
    command = ["taskset", "-c", cpus, python, "-m", "trioserve", "run"]
    command += ["--host", "127.0.0.1", "--http-port", str(port)]
    command += ["--grpc-port", str(grpc_port)] if grpc else ["--allow-grpc", "false"]
    command += ["--log-level", "warning", *flags]
    process = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=src))
    _wait_ready(f"127.0.0.1:{port}")
    if grpc:  # the gRPC port opens after the HTTP one
        _wait_listening(grpc_port)
    return process, port, grpc_port


def _wait_listening(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # a tool polling a server it started; not a test


def _load(args: argparse.Namespace, tmp: Path, port: int, grpc_port: int) -> list[str]:
    """The load generator's command for one server."""
    pinned = ["taskset", "-c", args.client_cpus]
    if args.mode == "grpc":
        return [
            *pinned, "h2load", "-t1", f"-c{args.connections}", "-m1", f"-D{args.duration}",
            "-d", str(tmp / "body"), "-H", "content-type: application/grpc", "-H", "te: trailers",
            f"http://127.0.0.1:{grpc_port}/inference.GRPCInferenceService/ModelInfer",
        ]  # fmt: skip
    path = (
        "tiny_lm/generate_stream"
        if args.mode == "generate-stream"
        else f"{model_of(args.mode)}/infer"
    )
    return [
        *pinned, "wrk", "-t1", f"-c{args.connections}", f"-d{args.duration}s",
        "-s", str(tmp / "post.lua"), f"http://127.0.0.1:{port}/v2/models/{path}",
    ]  # fmt: skip


def _answered(output: str) -> int:
    """Requests answered, from wrk's or h2load's output; an error fails the round."""
    if "Non-2xx" in output:
        raise RuntimeError(f"a server answered errors:\n{output}")
    h2load = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", output)
    if h2load is not None and h2load.group(1) != h2load.group(2):
        raise RuntimeError(f"a server answered errors:\n{output}")
    found = h2load or re.search(r"(\d+) requests in", output)
    if found is None or int(found.group(1 if h2load is None else 2)) == 0:
        raise RuntimeError(f"no request count in the load generator's output:\n{output}")
    return int(found.group(1 if h2load is None else 2))


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(timeout=60)


def _round(sides: list[Side], args: argparse.Namespace, tmp: Path) -> list[float]:
    """One round: both servers under load at once; their µs of CPU per request."""
    with ExitStack() as stack:  # on the way out: regions unregistered, then servers stopped
        servers = []
        for side in sides:
            process, port, grpc_port = _start(side, args.server_cpus, args.mode == "grpc")
            stack.callback(_stop, process)
            servers.append((process, port, grpc_port))
        if args.mode == "big-shm":
            for _, port, _ in servers:
                stack.enter_context(big_regions(f"127.0.0.1:{port}"))
        before = [cpu_seconds(process.pid) for process, _, _ in servers]
        loads = [
            subprocess.Popen(_load(args, tmp, port, grpc_port), stdout=subprocess.PIPE, text=True)
            for _, port, grpc_port in servers
        ]
        outputs = [load.communicate()[0] for load in loads]
        after = [cpu_seconds(process.pid) for process, _, _ in servers]
    return [
        1e6 * (end - start) / _answered(output)
        for output, start, end in zip(outputs, before, after, strict=True)
    ]


def _write_request(mode: str, tmp: Path) -> None:
    """The request body every load generator sends, and wrk's script for it."""
    if mode == "grpc":
        message = grpc_request("grpc").SerializeToString()
        (tmp / "body").write_bytes(len(message).to_bytes(5, "big") + message)  # gRPC's prefix
        return
    if mode == "generate-stream":
        body, headers = _STREAM_BODY, {"Content-Type": "application/json"}
    else:
        body, headers = http_body(mode)
    (tmp / "body").write_bytes(body)
    lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
    (tmp / "post.lua").write_text(_LUA.format(body=tmp / "body", headers=lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the src folder of the build to compare against")
    parser.add_argument("new", help="the src folder of the build being measured")
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8, help="wrk's, per server")
    parser.add_argument("--mode", default="http-json", choices=MODES)
    parser.add_argument(
        "--new-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="a trioserve run flag for the new side only (repeatable)",
    )
    parser.add_argument(
        "--old-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="a trioserve run flag for the old side only (repeatable)",
    )
    parser.add_argument("--server-cpus", default="0")
    parser.add_argument("--client-cpus", default="1")
    parser.add_argument("--old-python", default=sys.executable, help="the old side's interpreter")
    parser.add_argument("--new-python", default=sys.executable, help="the new side's interpreter")
    args = parser.parse_args()
    old: Side = (args.old, args.old_python, args.old_flag)
    new: Side = (args.new, args.new_python, args.new_flag)
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        _write_request(args.mode, tmp)
        ratios = []
        for number in range(args.rounds):
            swapped = number % 2 == 1  # which server starts first alternates
            order = [new, old] if swapped else [old, new]
            costs = _round(order, args, tmp)
            old_cost, new_cost = reversed(costs) if swapped else costs
            ratios.append(new_cost / old_cost)
            print(
                f"round {number + 1}: old {old_cost:6.1f} µs/request, "
                f"new {new_cost:6.1f} µs/request, new/old {ratios[-1]:.3f}"
            )
    print(f"new/old median {sorted(ratios)[len(ratios) // 2]:.3f} over {len(ratios)} rounds")


if __name__ == "__main__":
    main()
