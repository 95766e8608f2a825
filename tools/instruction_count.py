"""Instructions per request, counted by valgrind's callgrind: a figure the machine's
speed does not move, for hot-path changes too small for CPU-time benchmarks to see.

    python tools/instruction_count.py /path/to/old/src src --requests 1000 --rounds 2
    python tools/instruction_count.py old/src src --mode grpc

Each build serves ``simple`` (``trioserve run``, one process) under callgrind with
instrumentation off; after a warm-up the tool switches it on, sends ``--requests``
requests one at a time over one kept-alive connection (HTTP JSON, or gRPC ModelInfer with
``--mode grpc``), and divides the instructions the server executed (every thread) by the
requests. Builds alternate within each round. Two runs of one build differ by about 2%
(event-loop turns, timers, the collector), so read the ratio of each round's pair.
Needs ``valgrind`` (apt) and ``callgrind_control`` on PATH.

``--workers N`` serves with N front-end workers (every process under callgrind) and counts
the core process and the workers apart: the core's share bounds what any number of
workers can serve.

    python tools/instruction_count.py old/src src --workers 1
"""

from __future__ import annotations

import argparse
import glob
import http.client
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

from bench import _free_port, _wait_ready, children, grpc_request, http_body

_WARM_UP = 100


def _client(mode: str, http_port: int, grpc_port: int) -> Callable[[], None]:
    """One request, sent and answered."""
    if mode == "grpc":
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        stub = service_pb2_grpc.GRPCInferenceServiceStub(
            grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        )
        request = grpc_request("grpc")
        return lambda: stub.ModelInfer(request) and None
    body, headers = http_body("http-json")
    connection = http.client.HTTPConnection("127.0.0.1", http_port)  # kept alive, as wrk's

    def post() -> None:
        connection.request("POST", "/v2/models/simple/infer", body, headers)
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"the server answered {response.status}")

    return post


def _instructions(src: str, mode: str, requests: int, workers: int) -> tuple[float, float]:
    """Instructions per request: the server's (with workers, its core process's), and its
    workers' (0 without)."""
    http_port, grpc_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory() as folder:
        command = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", "--trace-children=yes",
            f"--callgrind-out-file={folder}/out.%p",
            sys.executable, "-m", "trioserve", "run", "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--allow-metrics", "false",
            "--workers", str(workers),
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=src)
        server = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            _wait_ready(f"127.0.0.1:{http_port}", timeout=600)
            send = _client(mode, http_port, grpc_port)
            for _ in range(_WARM_UP):
                send()
            # The workers, and the built-in models' own processes (left out of the counts).
            processes = [server.pid, *children(server.pid)]
            for pid in processes:
                _control(pid, "-i", "on")
            for _ in range(requests):
                send()
            for pid in processes:
                _control(pid, "--dump")
                _control(pid, "-i", "off")
        finally:
            server.terminate()
            server.wait()
        core = workers_count = 0
        for path in glob.glob(f"{folder}/out.*.1"):  # the dump, not the file written at exit
            with open(path, errors="replace") as dump:
                heads = dict(line.split(":", 1) for line in dump if line[:4] in ("cmd:", "summ"))
            count = int(heads.get("summary", "0"))
            if path.endswith(f".{server.pid}.1"):
                core += count
            elif "trioserve.workers" in heads.get("cmd", ""):  # not a model's own process
                workers_count += count
    return core / requests, workers_count / requests


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="the src folder of the build to compare against")
    parser.add_argument("new", help="the src folder of the build being measured")
    parser.add_argument("--mode", choices=("http-json", "grpc"), default="http-json")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0, help="front-end workers (0: none)")
    args = parser.parse_args()
    ratios = []
    for round_ in range(1, args.rounds + 1):
        old = _instructions(args.old, args.mode, args.requests, args.workers)
        new = _instructions(args.new, args.mode, args.requests, args.workers)
        ratios.append(sum(new) / sum(old))
        split = ""
        if args.workers:
            split = (f" (core {old[0]:,.0f} -> {new[0]:,.0f}, new/old {new[0] / old[0]:.3f};"
                     f" workers {old[1]:,.0f} -> {new[1]:,.0f})")  # fmt: skip
        print(f"round {round_}: old {sum(old):,.0f}, new {sum(new):,.0f} instructions/request, "
              f"new/old {ratios[-1]:.3f}{split}", flush=True)  # fmt: skip
    ratios.sort()
    print(f"new/old median {ratios[len(ratios) // 2]:.3f} over {args.rounds} rounds")


if __name__ == "__main__":
    main()
