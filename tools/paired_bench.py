"""Compare two builds of trioserve by CPU time per request, both loaded at the same time.

    python tools/paired_bench.py /path/to/old/src src --duration 10 --rounds 3
    python tools/paired_bench.py src src --old-python A/bin/python --new-python B/bin/python
    python tools/paired_bench.py /path/to/old/src src --mode big-shm --connections 1

The second form compares two interpreters serving the same source (each needs
trioserve's dependencies installed). ``--new-flag`` adds a ``trioserve run`` flag to the
new side only, to measure what a setting costs::

    python tools/paired_bench.py src src --new-flag=--trace-config=level=TIMESTAMPS

The machine's speed drifts (a shared virtual machine: by a third from minute to minute),
so throughput measured in turns compares the moments as much as the builds. Here both
servers run at once, pinned to the same core, each under its own wrk (HTTP JSON,
``simple``, 8 connections unless ``--connections`` says otherwise) on another core: they share the core and its slow and fast
moments alike. ``--mode big-shm`` sends ``bench.py``'s 16 MiB ``identity_fp32`` round
trip through system shared memory instead, each server with regions of its own. Each server's CPU time (user + system, from ``/proc/PID/stat``) divided by
the requests it answered is its cost per request; the ratio of the two costs is the
figure to read. Two copies of one build give a ratio within about 2% of 1.

Both costs are higher than one server alone would show (two working sets share one
core's caches); compare them with each other, not with ``bench.py`` figures.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench import _LUA, _free_port, _wait_ready, big_regions, http_body, model_of


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Side = tuple[str, str, list[str]]  # src folder, interpreter, extra flags


def _start(side: Side, cpus: str) -> tuple[subprocess.Popen[bytes], int]:
    src, python, flags = side
    port = _free_port()
    command = ["taskset", "-c", cpus, python, "-m", "trioserve", "run"]
    command += ["--host", "127.0.0.1", "--http-port", str(port), "--allow-grpc", "false"]
    command += ["--log-level", "warning", *flags]
    process = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=src))
    _wait_ready(f"127.0.0.1:{port}")
    return process, port


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(timeout=60)


def _round(sides: list[Side], args: argparse.Namespace, script: Path) -> list[float]:
    """One round: both servers under load at once; their µs of CPU per request."""
    model = model_of(args.mode)
    with ExitStack() as stack:  # on the way out: regions unregistered, then servers stopped
        servers = []
        for side in sides:
            process, port = _start(side, args.server_cpus)
            stack.callback(_stop, process)
            servers.append((process, port))
        if args.mode == "big-shm":
            for _, port in servers:
                stack.enter_context(big_regions(f"127.0.0.1:{port}"))
        before = [_cpu_seconds(process.pid) for process, _ in servers]
        wrk = [
            "taskset", "-c", args.client_cpus,
            "wrk", "-t1", f"-c{args.connections}", f"-d{args.duration}s",
        ]  # fmt: skip
        loads = [
            subprocess.Popen(
                [*wrk, "-s", str(script), f"http://127.0.0.1:{port}/v2/models/{model}/infer"],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _, port in servers
        ]
        outputs = [load.communicate()[0] for load in loads]
        after = [_cpu_seconds(process.pid) for process, _ in servers]
    costs = []
    for output, start, end in zip(outputs, before, after, strict=True):
        if "Non-2xx" in output:
            raise RuntimeError(f"a server answered errors:\n{output}")
        found = re.search(r"(\d+) requests in", output)
        if found is None:
            raise RuntimeError(f"no request count in wrk's output:\n{output}")
        costs.append(1e6 * (end - start) / int(found.group(1)))
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the src folder of the build to compare against")
    parser.add_argument("new", help="the src folder of the build being measured")
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8, help="wrk's, per server")
    parser.add_argument("--mode", default="http-json", choices=("http-json", "big-shm"))
    parser.add_argument(
        "--new-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="a trioserve run flag for the new side only (repeatable)",
    )
    parser.add_argument("--server-cpus", default="0")
    parser.add_argument("--client-cpus", default="1")
    parser.add_argument("--old-python", default=sys.executable, help="the old side's interpreter")
    parser.add_argument("--new-python", default=sys.executable, help="the new side's interpreter")
    args = parser.parse_args()
    old: Side = (args.old, args.old_python, [])
    new: Side = (args.new, args.new_python, args.new_flag)
    body, headers = http_body(args.mode)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "body").write_bytes(body)
        script = Path(tmp) / "post.lua"
        lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
        script.write_text(_LUA.format(body=Path(tmp) / "body", headers=lines))
        ratios = []
        for number in range(args.rounds):
            swapped = number % 2 == 1  # which server starts first alternates
            order = [new, old] if swapped else [old, new]
            costs = _round(order, args, script)
            old_cost, new_cost = reversed(costs) if swapped else costs
            ratios.append(new_cost / old_cost)
            print(
                f"round {number + 1}: old {old_cost:6.1f} µs/request, "
                f"new {new_cost:6.1f} µs/request, new/old {ratios[-1]:.3f}"
            )
    print(f"new/old median {sorted(ratios)[len(ratios) // 2]:.3f} over {len(ratios)} rounds")


if __name__ == "__main__":
    main()
