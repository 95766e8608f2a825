"""CPU per request of the forwarded path (``--workers N``) against one process.

    python tools/workers_bench.py                                   # every mode, 8 and 64
    python tools/workers_bench.py --modes http-json --connections 8 --duration 10 --rounds 3
    python tools/workers_bench.py --python /tmp/vdeb/bin/python     # another interpreter
    python tools/workers_bench.py --modes http-json,grpc --link-only  # the link alone
    python tools/workers_bench.py --modes http-json --connections 8 --apart

Two servers of this checkout run at once, pinned to the same core (``--server-cpus``),
one with ``--workers 0`` (one process) and one with ``--workers N`` (a core process and
N front-end workers), each under its own load generator on another core (wrk for HTTP,
h2load for gRPC): they share the core's slow and fast moments alike, as in
``paired_bench.py``. A server's CPU time is that of all its processes (user + system,
``/proc``); divided by the requests it answered, it is its cost per request. The figure
to read is the ratio of the two costs (forwarded / one process); the forwarded cost is
also split into the core process's share, which bounds what any number of workers can
serve, and the workers'. With ``--apart`` the two servers take the core in turn, each
alone under its load, as a deployment that gives the core process and a worker one CPU
runs them (nothing else's turns to share the CPU with); wrk's latency percentiles are
printed too.

Modes: ``http-json`` and ``http-binary`` (``simple``), ``grpc`` (``simple``, raw
tensors, h2load), ``big-http-binary`` and ``big-grpc`` (one 16 MiB FP32 tensor through
``identity_fp32``, where MiB/s each way is printed too).

``--link-only`` runs the forwarded side with a core that answers each inference at once
without its pipeline (``link_only_core.py``: no model, batcher or statistics), so that
the ratio is the link's own cost against one process's whole one; the difference from a
run without it is what the pipeline costs in the core process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import (
    _LUA,
    BIG_BYTES,
    cpu_seconds,
    grpc_request,
    http_body,
    model_of,
    process_cpu_seconds,
)

ROOT = Path(__file__).resolve().parent.parent


def _tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time (user + system) of ``pid`` (the core process), and of its descendants
    (the workers)."""
    own = process_cpu_seconds(pid)
    return own, cpu_seconds(pid) - own


def _start(
    python: str, workers: int, cpus: str, grpc: bool, link_only: bool = False
) -> tuple[subprocess.Popen[bytes], int]:
    ports_file = Path(tempfile.mkdtemp()) / "ports.json"
    server = [str(ROOT / "tools" / "link_only_core.py")] if link_only else ["-m", "trioserve"]
    command = ["taskset", "-c", cpus, python, *server, "run", "--host", "127.0.0.1"]
    command += ["--http-port", "0", "--grpc-port", "0", "--workers", str(workers)]
    command += ["--ports-file", str(ports_file), "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    process = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 120
    while not ports_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.1)
    ports = json.loads(ports_file.read_text())
    return process, ports["grpc" if grpc else "http"]


def _load(
    mode: str, port: int, args: argparse.Namespace, files: Path, connections: int
) -> subprocess.Popen[str]:
    pin = ["taskset", "-c", args.client_cpus]
    if mode.endswith("grpc"):
        command = [
            *pin, "h2load", "-n", "1000000000", "-D", str(args.duration),
            "-c", str(connections), "-m", "1",
            "-H", "content-type: application/grpc", "-H", "te: trailers",
            "-d", str(files / mode), f"http://127.0.0.1:{port}/inference.GRPCInferenceService/ModelInfer",
        ]  # fmt: skip
    else:
        command = [
            *pin, "wrk", "-t1", f"-c{connections}", f"-d{args.duration}s", "--latency",
            "-s", str(files / f"{mode}.lua"), f"http://127.0.0.1:{port}/v2/models/{model_of(mode)}/infer",
        ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def _answered(mode: str, output: str) -> int:
    if mode.endswith("grpc"):
        found = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", output)
        if found is None or found.group(1) != found.group(2):
            raise RuntimeError(f"h2load saw failures:\n{output}")
        answered = int(found.group(2))
        # A gRPC error is an HTTP 200 too: a big answer must have brought its tensor.
        data = re.search(r"\((\d+)\) data", output)
        if mode.startswith("big-") and (data is None or int(data.group(1)) < answered * BIG_BYTES):
            raise RuntimeError(f"the answers lack their tensors:\n{output}")
        return answered
    if "Non-2xx" in output:
        raise RuntimeError(f"a server answered errors:\n{output}")
    found = re.search(r"(\d+) requests in", output)
    if found is None:
        raise RuntimeError(f"no request count in wrk's output:\n{output}")
    return int(found.group(1))


def _round(
    mode: str, connections: int, args: argparse.Namespace, files: Path
) -> list[tuple[float, float, float, str]]:
    """Both servers under load at once (or one after the other, ``--apart``), each's µs
    of CPU per request (all its processes, and its main process alone: the core),
    requests/s and latency percentiles (wrk's, HTTP only)."""
    sides = [(0, False), (args.workers, args.link_only)]
    if args.apart:
        return [_measured(mode, connections, args, files, [side])[0] for side in sides]
    return _measured(mode, connections, args, files, sides)


def _measured(
    mode: str,
    connections: int,
    args: argparse.Namespace,
    files: Path,
    sides: list[tuple[int, bool]],
) -> list[tuple[float, float, float, str]]:
    grpc = mode.endswith("grpc")
    servers = [
        _start(args.python, workers, args.server_cpus, grpc, link_only)
        for workers, link_only in sides
    ]
    try:
        time.sleep(1)
        before = [_tree_cpu_seconds(process.pid) for process, _ in servers]
        loads = [_load(mode, port, args, files, connections) for _, port in servers]
        outputs = [load.communicate()[0] for load in loads]
        after = [_tree_cpu_seconds(process.pid) for process, _ in servers]
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(timeout=60)
    results = []
    for output, start, end in zip(outputs, before, after, strict=True):
        answered = _answered(mode, output)
        core, total = end[0] - start[0], sum(end) - sum(start)
        found = re.findall(r"^ +(50|99)% +(\S+)", output, re.MULTILINE)  # wrk --latency
        latency = " ".join(f"p{quantile} {took}" for quantile, took in found)
        results.append(
            (1e6 * total / answered, 1e6 * core / answered, answered / args.duration, latency)
        )
    return results


def _write_files(files: Path) -> None:
    for mode in ("http-json", "http-binary", "big-http-binary"):
        body, headers = http_body(mode)
        (files / mode).write_bytes(body)
        lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
        (files / f"{mode}.lua").write_text(_LUA.format(body=files / mode, headers=lines))
    for mode in ("grpc", "big-grpc"):
        message = grpc_request(mode).SerializeToString()
        (files / mode).write_bytes(b"\0" + len(message).to_bytes(4, "big") + message)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="http-json,http-binary,grpc,big-http-binary")
    parser.add_argument("--connections", default="8,64", help="per server; big modes use 1")
    parser.add_argument("--workers", type=int, default=1, help="the forwarded side's N")
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--server-cpus", default="0")
    parser.add_argument("--client-cpus", default="1")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument(
        "--apart",
        action="store_true",
        help="each server alone on --server-cpus in turn, not both at once",
    )
    parser.add_argument(
        "--link-only",
        action="store_true",
        help="the forwarded side's core answers at once, without its pipeline "
        "(tools/link_only_core.py): the link's own cost; small modes only",
    )
    args = parser.parse_args()
    if args.link_only and "big-" in args.modes:
        parser.error("--link-only runs the small modes only")
    side = " (link only: the core answers without its pipeline)" if args.link_only else ""
    print(f"python: {args.python}; forwarded side: --workers {args.workers}{side}")
    with tempfile.TemporaryDirectory() as tmp:
        files = Path(tmp)
        _write_files(files)
        for mode in args.modes.split(","):
            counts = (
                [1] if mode.startswith("big-") else [int(c) for c in args.connections.split(",")]
            )
            for connections in counts:
                for number in range(args.rounds):
                    one, forwarded = _round(mode, connections, args, files)
                    (one_cost, _, one_rate, one_latency) = one
                    (fwd_cost, fwd_core, fwd_rate, fwd_latency) = forwarded
                    line = (
                        f"{mode:16} c={connections:<3} round {number + 1}: one process "
                        f"{one_cost:7.1f} µs/req {one_rate:7.0f} req/s; forwarded "
                        f"{fwd_cost:7.1f} µs/req (core {fwd_core:5.1f}, workers "
                        f"{fwd_cost - fwd_core:5.1f}) {fwd_rate:7.0f} req/s; CPU ratio "
                        f"{fwd_cost / one_cost:.3f}"
                    )
                    if one_latency:
                        line += f"; latency {one_latency} vs {fwd_latency}"
                    if mode.startswith("big-"):
                        mib = 16
                        line += f"; MiB/s each way {one_rate * mib:.0f} vs {fwd_rate * mib:.0f}"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
