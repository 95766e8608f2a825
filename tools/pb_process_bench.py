"""Python-backend instances in processes of their own: what they buy and what they cost.

    python tools/pb_process_bench.py cpu       # a GIL-bound model: count 1 vs 2, thread vs process
    python tools/pb_process_bench.py triton    # `simple` CPU per request and 16 MiB identity_fp32
                                               # MiB/s, trioserve (process mode) against real
                                               # Triton, alternating in one sitting
    python tools/pb_process_bench.py big       # 16 MiB identity_fp32, binary body and system
                                               # shared memory: MiB/s and server CPU, process
                                               # mode, thread mode and real Triton alternating
    python tools/pb_process_bench.py sigkill   # SIGKILL one instance under load
    python tools/pb_process_bench.py boundary  # `simple`: server CPU and instance-process CPU
                                               # per request, process mode against thread mode
    python tools/pb_process_bench.py own       # trioserve's own Model API: the GIL-bound model,
                                               # and CPU per request of an echo, thread vs process
    python tools/pb_process_bench.py decoupled # a decoupled model's responses, streamed:
                                               # responses/s and CPU per response

``cpu``: ``busy`` (a Triton python-backend model written to a temporary repository)
spends ``--work-ms`` of pure-Python, GIL-holding work per request; wrk keeps 8 requests in
flight for ``--duration`` seconds against ``trioserve run`` in each mode with
``instance_group { count }`` 1 and 2. ``triton``: both servers serve the reference zoo
(../shared/triton-reference/models; Triton through its ``start_triton.sh``; trioserve in
process mode and in thread mode, whose difference is what the process boundary costs),
rounds alternating; the figure for ``simple`` is the CPU time of the server and all its
processes (Triton's stubs, trioserve's instance processes) per request, from /proc.
``boundary``: trioserve alone on the reference zoo's ``simple`` (JSON, 4 clients), process
and thread mode alternating; the server's own CPU per request and its instance processes'
(the children) apart, from /proc. ``big``: one client posts 16 MiB to the reference zoo's
``identity_fp32`` (binary data in the body, then both tensors in system shared memory
regions it registered) to trioserve in each mode and to Triton, rounds alternating; MiB/s
and the CPU of the server with all its processes per request. ``sigkill``: ``steady`` (count 2, 5 ms per request, answering its pid) under 8 clients;
one instance's process is killed; the failures, and the time until the new process
answers, are reported. ``own``: ``busy`` written with ``@trioserve.model`` in the own
layout, its ``TRIOSERVE_INSTANCE_MODE`` parameter thread or process, count 1 and 2, as
``cpu`` runs it; then ``echo`` (no work) in each mode under 4 clients: req/s and the CPU
of the server with its instance processes per request.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench import (
    _describe,
    _free_port,
    _wait_ready,
    big_regions,
    cpu_seconds,
    http_body,
    run_wrk,
)

# The main checkout's neighbour; --reference names it from elsewhere.
REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "triton-reference"

# Pure-Python work that holds the GIL for ``seconds`` of the thread's CPU time.
BUSY_FUNCTION = """
import time

def busy(seconds):
    end = time.thread_time() + seconds  # the thread's own CPU time: work, not waiting
    total = 0
    while time.thread_time() < end:
        for i in range(1000):
            total += i * i
    return total
"""

BUSY = (
    BUSY_FUNCTION
    + """
import numpy as np
import triton_python_backend_utils as pb_utils

WORK_S = {work_s}

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            busy(WORK_S)
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
"""
)

STEADY = """
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.005)
        pid = np.array([os.getpid()], np.int64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pid)]) for _ in requests]
"""

# A decoupled model: X responses of Y = [i], then the final flag alone.
BURST = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for i in range(int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])):
                y = pb_utils.Tensor("Y", np.array([i], np.int64))
                sender.send(pb_utils.InferenceResponse([y]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

CONFIG = """
backend: "python"
input [ {{ name: "X" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT64 dims: [ 1 ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
"""

ONE = (
    json.dumps(
        {"inputs": [{"name": "X", "shape": [1], "datatype": "INT64", "data": [1]}]}
    ).encode(),
    {"Content-Type": "application/json"},
)


OWN_BUSY = (
    BUSY_FUNCTION
    + """
import trioserve

@trioserve.model(
    name="busy",
    inputs=[trioserve.TensorSpec("X", "INT64", [1])],
    outputs=[trioserve.TensorSpec("Y", "INT64", [1])],
    instance_count={count},
    parameters={{"TRIOSERVE_INSTANCE_MODE": "{mode}"}},
)
def model(X):
    if {work_s}:
        busy({work_s})
    return {{"Y": X}}
"""
)


def write_model(root: Path, name: str, code: str, count: int, decoupled: bool = False) -> None:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    policy = "model_transaction_policy { decoupled: true }\n" if decoupled else ""
    (root / name / "config.pbtxt").write_text(CONFIG.format(count=count) + policy)
    (root / name / "1" / "model.py").write_text(textwrap.dedent(code))


@contextmanager
def trioserve(
    repository: Path, mode: str, grpc_port: int | None = None
) -> Iterator[tuple[str, int]]:
    http = _free_port()
    grpc = ["--allow-grpc", "false"] if grpc_port is None else ["--grpc-port", str(grpc_port)]
    command = [sys.executable, "-m", "trioserve", "run", "--model-repository", str(repository),
               "--host", "127.0.0.1", "--http-port", str(http), *grpc,
               "--allow-metrics", "false", "--log-level", "warning",
               "--python-instance-mode", mode]  # fmt: skip
    process = subprocess.Popen(command)
    try:
        _wait_ready(f"127.0.0.1:{http}", timeout=120)
        yield f"127.0.0.1:{http}", process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)


@contextmanager
def triton(reference: Path) -> Iterator[tuple[str, int]]:
    http = _free_port()
    env = dict(os.environ, HTTP_PORT=str(http), GRPC_PORT=str(_free_port()),
               METRICS_PORT=str(_free_port()), TRITON_WORK=tempfile.mkdtemp(prefix="triton-"))  # fmt: skip
    script = str(reference / "start_triton.sh")
    subprocess.run([script], env=env, check=True, capture_output=True)
    pid = int((Path(env["TRITON_WORK"]) / "tritonserver.pid").read_text())
    try:
        yield f"127.0.0.1:{http}", pid
    finally:
        subprocess.run([script, "stop"], env=env, check=True, capture_output=True)


def cpu_scenario(args: argparse.Namespace) -> None:
    print(f"busy: {args.work_ms} ms of GIL-holding work per request, 8 clients, {args.duration} s")
    with tempfile.TemporaryDirectory() as tmp:
        for count in (1, 2):
            write_model(Path(tmp), f"busy{count}", BUSY.format(work_s=args.work_ms / 1000), count)
        for mode in ("thread", "process"):
            with trioserve(Path(tmp), mode) as (url, _pid):
                for count in (1, 2):
                    run_wrk(url, "busy", 8, 2, "0-1", f"busy{count}", ONE)  # warm up
                    result = run_wrk(url, "busy", 8, args.duration, "0-1", f"busy{count}", ONE)
                    print(f"  {mode:<8} count {count}: {result.requests_per_s:8.1f} req/s   "
                          f"p50 {result.p50_ms:7.1f} ms")  # fmt: skip


def own_scenario(args: argparse.Namespace) -> None:
    print(f"own Model API: busy ({args.work_ms} ms, 8 clients) and echo (4 clients), "
          f"{args.duration} s")  # fmt: skip
    work_s = args.work_ms / 1000
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("thread", "process"):
            for count in (1, 2):
                code = OWN_BUSY.format(count=count, mode=mode, work_s=work_s)
                (Path(tmp) / f"busy_{mode}_{count}").mkdir()
                (Path(tmp) / f"busy_{mode}_{count}" / "model.py").write_text(code)
            (Path(tmp) / f"echo_{mode}").mkdir()
            code = OWN_BUSY.format(count=1, mode=mode, work_s=0)
            (Path(tmp) / f"echo_{mode}" / "model.py").write_text(code)
        with trioserve(Path(tmp), "thread") as (url, pid):
            for mode in ("thread", "process"):
                for count in (1, 2):
                    name = f"busy_{mode}_{count}"
                    run_wrk(url, "busy", 8, 2, "0-1", name, ONE)  # warm up
                    result = run_wrk(url, "busy", 8, args.duration, "0-1", name, ONE)
                    print(f"  busy {mode:<8} count {count}: {result.requests_per_s:8.1f} req/s   "
                          f"p50 {result.p50_ms:7.1f} ms")  # fmt: skip
            for mode in ("thread", "process"):
                run_wrk(url, "busy", 4, 2, "0-1", f"echo_{mode}", ONE)  # warm up
                total = cpu_seconds(pid)
                echo = run_wrk(url, "busy", 4, args.duration, "0-1", f"echo_{mode}", ONE)
                total = cpu_seconds(pid) - total
                count = echo.requests_per_s * args.duration
                print(f"  echo {mode:<8} {echo.requests_per_s:8.1f} req/s   "
                      f"p50 {echo.p50_ms:6.2f} ms   {total / count * 1e6:6.1f} us CPU/req")  # fmt: skip


def triton_scenario(args: argparse.Namespace) -> None:
    models = args.reference / "models"
    print(
        f"simple (JSON, 4 clients) and identity_fp32 (16 MiB binary, 1 client), {args.duration} s"
    )
    print("CPU per request: all, the server's own, its children (instance processes, stubs)")
    for round_ in range(args.rounds):
        simple_cpu: dict[str, tuple[float, float]] = {}  # all, children
        for name, server in (
            ("trioserve process", lambda: trioserve(models, "process")),
            ("trioserve thread", lambda: trioserve(models, "thread")),
            ("triton", lambda: triton(args.reference)),
        ):
            with server() as (url, pid):
                run_wrk(url, "http-json", 4, 2, "0-1")  # warm up
                total, own = cpu_seconds(pid), own_cpu_seconds(pid)
                simple = run_wrk(url, "http-json", 4, args.duration, "0-1")
                total, own = cpu_seconds(pid) - total, own_cpu_seconds(pid) - own
                per_request = 1e6 / (simple.requests_per_s * args.duration)
                simple_cpu[name] = (total * per_request, (total - own) * per_request)
                big = run_wrk(url, "big-binary", 1, args.duration, "0-1", "identity_fp32",
                              http_body("big-binary"))  # fmt: skip
                print(f"  round {round_ + 1} {name:<17} simple {simple.requests_per_s:8.1f} req/s "
                      f"{total * per_request:7.1f} us CPU/req ({own * per_request:6.1f} + "
                      f"{(total - own) * per_request:6.1f})   identity_fp32 "
                      f"{big.requests_per_s * 16:8.1f} MiB/s")  # fmt: skip
        # The boundary's cost: what process mode adds to thread mode, against what Triton's
        # stubs alone spend (a floor of its python backend's cost: its C++ side is not in it).
        boundary = simple_cpu["trioserve process"][0] - simple_cpu["trioserve thread"][0]
        print(f"  round {round_ + 1} boundary: trioserve {boundary:6.1f} us/req   "
              f"Triton's stubs {simple_cpu['triton'][1]:6.1f} us/req")  # fmt: skip


def boundary_scenario(args: argparse.Namespace) -> None:
    models = args.reference / "models"
    print(f"simple (JSON, 4 clients), {args.duration} s; CPU per request: server, instances")
    for round_ in range(args.rounds):
        for mode in ("process", "thread"):
            with trioserve(models, mode) as (url, pid):
                run_wrk(url, "http-json", 4, 2, "0-1")  # warm up
                total, own = cpu_seconds(pid), own_cpu_seconds(pid)
                simple = run_wrk(url, "http-json", 4, args.duration, "0-1")
                total, own = cpu_seconds(pid) - total, own_cpu_seconds(pid) - own
                count = simple.requests_per_s * args.duration
                print(f"  round {round_ + 1} {mode:<8} {simple.requests_per_s:8.1f} req/s   "
                      f"server {own / count * 1e6:6.1f} us/req   "
                      f"instances {(total - own) / count * 1e6:6.1f} us/req")  # fmt: skip


def big_scenario(args: argparse.Namespace) -> None:
    models = args.reference / "models"
    print(f"identity_fp32, 16 MiB, 1 client, {args.duration} s per body; CPU: server + children")
    for round_ in range(args.rounds):
        for name, server in (
            ("trioserve process", lambda: trioserve(models, "process")),
            ("trioserve thread", lambda: trioserve(models, "thread")),
            ("triton", lambda: triton(args.reference)),
        ):
            with server() as (url, pid), big_regions(url):
                figures = []
                for body in ("big-binary", "big-shm"):
                    run_wrk(url, body, 1, 2, "0-1")  # warm up
                    before = cpu_seconds(pid)
                    result = run_wrk(url, body, 1, args.duration, "0-1")
                    count = result.requests_per_s * args.duration
                    cpu_ms = (cpu_seconds(pid) - before) / count * 1e3
                    figures.append(f"{body[4:]:<6} {result.requests_per_s * 16:7.1f} MiB/s "
                                   f"{cpu_ms:6.2f} ms CPU/req")  # fmt: skip
                print(f"  round {round_ + 1} {name:<17} " + "   ".join(figures))


def decoupled_scenario(args: argparse.Namespace) -> None:
    """``burst`` (decoupled) answering each request with ``--responses`` responses,
    streamed to one client over gRPC (ModelStreamInfer): responses a second, and the CPU
    of the server with its instance process per response."""
    import tritonclient.grpc as grpcclient  # only this scenario needs it

    print(f"burst (decoupled), {args.responses} responses a request, 1 client, "
          f"{args.duration} s; CPU: server + instance process")  # fmt: skip
    grpc_port = _free_port()
    arrived: queue.Queue[Any] = queue.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), "burst", BURST, 1, decoupled=True)
        with trioserve(Path(tmp), "process", grpc_port) as (_url, pid):
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            client.start_stream(lambda result, error: arrived.put(error or result))
            count = grpcclient.InferInput("X", [1], "INT64")
            count.set_data_from_numpy(np.array([args.responses], np.int64))

            def stream() -> int:
                client.async_stream_infer("burst", [count], enable_empty_final_response=True)
                for answered in itertools.count():
                    result = arrived.get(timeout=30)
                    if isinstance(result, Exception):
                        raise result
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        if answered != args.responses:
                            raise RuntimeError(f"burst answered {answered}, not {args.responses}")
                        return answered
                raise AssertionError("unreachable")

            try:
                for round_ in range(args.rounds):
                    for _ in range(20):
                        stream()  # warm up
                    before, started, answered = cpu_seconds(pid), time.monotonic(), 0
                    while time.monotonic() - started < args.duration:
                        answered += stream()
                    elapsed, cpu = time.monotonic() - started, cpu_seconds(pid) - before
                    print(f"  round {round_ + 1} {answered / elapsed:9.1f} responses/s   "
                          f"{cpu / answered * 1e6:6.1f} us CPU/response")  # fmt: skip
            finally:
                client.stop_stream()
                client.close()


def own_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of ``pid`` itself, without its children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sigkill_scenario(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), "steady", STEADY, 2)
        with trioserve(Path(tmp), "process") as (url, _pid):
            host, port = url.split(":")
            answers: list[tuple[float, int | None]] = []  # (when, pid or None: failed)
            stop = threading.Event()

            def client() -> None:
                connection = http.client.HTTPConnection(host, int(port))
                while not stop.is_set():
                    connection.request("POST", "/v2/models/steady/infer", ONE[0], ONE[1])
                    response = connection.getresponse()
                    body = json.loads(response.read())
                    pid = body["outputs"][0]["data"][0] if response.status == 200 else None
                    answers.append((time.monotonic(), pid))

            threads = [threading.Thread(target=client) for _ in range(8)]
            for thread in threads:
                thread.start()
            time.sleep(2)  # load settles
            victim = next(pid for _t, pid in reversed(answers) if pid is not None)
            before = {pid for _t, pid in answers}
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            time.sleep(3)
            stop.set()
            for thread in threads:
                thread.join()
    after = [(t, pid) for t, pid in answers if t >= killed]
    failed = sum(pid is None for _t, pid in after)
    fresh = [t for t, pid in after if pid is not None and pid not in before]
    back = f"{(fresh[0] - killed) * 1000:.0f} ms" if fresh else "never"
    print(f"steady (count 2, 5 ms): killed pid {victim}; {failed} failed of {len(after)} "
          f"requests after the kill; the new process answered {back} after it")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "scenario", choices=("cpu", "triton", "boundary", "big", "sigkill", "own", "decoupled")
    )
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--work-ms", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--responses", type=int, default=200, help="decoupled: a request's")
    parser.add_argument("--reference", type=Path, default=REFERENCE, help="triton-reference/")
    args = parser.parse_args()
    print(_describe(sys.executable))
    scenarios = {"cpu": cpu_scenario, "triton": triton_scenario, "boundary": boundary_scenario,
                 "big": big_scenario, "sigkill": sigkill_scenario, "own": own_scenario,
                 "decoupled": decoupled_scenario}  # fmt: skip
    scenarios[args.scenario](args)


if __name__ == "__main__":
    main()
