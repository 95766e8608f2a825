"""Goodput under overload: completed requests per second as clients outnumber capacity.

    python tools/overload_bench.py                         # trioserve, 20 and 200 clients
    python tools/overload_bench.py --clients 10,20,50,200 --duration 10
    python tools/overload_bench.py --url 127.0.0.1:8000    # a running server with the model

The model, ``sleepy`` (a Triton python-backend model written to a temporary repository),
sleeps 10 ms per request on each of 3 instances (capacity: 300 requests/s) and queues at
most 16 requests (``dynamic_batching { default_queue_policy { max_queue_size: 16 } }``);
the rest are refused with 503 (UNAVAILABLE). wrk drives HTTP JSON from core 1 with a
closed loop of ``--clients`` connections against the server on core 0. A server that
refuses cheaply keeps its completed requests per second near the peak however many
clients press: the figure to read is ``completed/s`` at ten times the clients that reach the
peak (200 against 20), and how little CPU a refusal costs. wrk's latencies mix answers
and refusals.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench import _LUA, _free_port, _ms, _wait_ready, cpu_seconds

CONFIG = """
name: "sleepy"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 3 kind: KIND_CPU } ]
dynamic_batching { default_queue_policy { max_queue_size: 16 } }
"""

MODEL = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.01)
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())
            ])
            for r in requests
        ]
"""

BODY = {"inputs": [{"name": "X", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def write_repository(root: Path) -> None:
    (root / "sleepy" / "1").mkdir(parents=True)
    (root / "sleepy" / "config.pbtxt").write_text(CONFIG)
    (root / "sleepy" / "1" / "model.py").write_text(textwrap.dedent(MODEL))


def run_level(url: str, clients: int, duration: int, cpus: str, tmp: Path) -> dict[str, float]:
    (tmp / "body").write_text(json.dumps(BODY))
    script = tmp / "post.lua"
    script.write_text(
        _LUA.format(body=tmp / "body", headers='wrk.headers["Content-Type"] = "application/json"')
    )
    command = [
        "taskset", "-c", cpus, "wrk", "-t1", f"-c{clients}", f"-d{duration}s", "--latency",
        "-s", str(script), f"http://{url}/v2/models/sleepy/infer",
    ]  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    refused_match = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    refused = int(refused_match.group(1)) if refused_match else 0
    if "Socket errors" in out:
        print(out, file=sys.stderr)
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    return {
        "completed": (total - refused) / duration,
        "refused": refused / duration,
        "p50": p50,
        "p99": p99,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="host:port of a running server serving `sleepy`")
    parser.add_argument("--server-pid", type=int, help="with --url: its pid, for CPU figures")
    parser.add_argument("--clients", default="20,200")
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--server-cpus", default="0")
    parser.add_argument("--client-cpus", default="1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        process = None
        url, pid = args.url, args.server_pid
        if url is None:
            write_repository(tmp / "repository")
            port = _free_port()
            command = [
                "taskset", "-c", args.server_cpus, sys.executable, "-m", "trioserve", "run",
                "--model-repository", str(tmp / "repository"), "--host", "127.0.0.1",
                "--http-port", str(port), "--allow-grpc", "false", "--allow-metrics", "false",
                "--log-level", "warning",
            ]  # fmt: skip
            process = subprocess.Popen(command)
            url, pid = f"127.0.0.1:{port}", process.pid
        try:
            _wait_ready(url)
            for clients in (int(c) for c in args.clients.split(",")):
                before = cpu_seconds(pid) if pid else 0.0
                rates = run_level(url, clients, args.duration, args.client_cpus, tmp)
                cpu = (cpu_seconds(pid) - before) / args.duration if pid else float("nan")
                print(
                    f"clients {clients:>4}: completed {rates['completed']:7.1f}/s  "
                    f"refused {rates['refused']:8.1f}/s  p50 {rates['p50']:6.2f} ms  "
                    f"p99 {rates['p99']:6.2f} ms (answers and refusals)  server CPU {cpu:4.0%}"
                )
        finally:
            if process is not None:
                process.terminate()
                process.wait(timeout=60)


if __name__ == "__main__":
    main()
