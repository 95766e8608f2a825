"""Load generator for trioserve (or any server speaking the same protocol, e.g. Triton).

    python tools/bench.py                          # start trioserve pinned to core 0, run all
    python tools/bench.py --modes http-json --concurrency 8 --duration 10
    python tools/bench.py --url 127.0.0.1:8000 --grpc-url 127.0.0.1:8001   # existing server
    python tools/bench.py --modes big-http-binary,big-grpc,big-shm --concurrency 1

HTTP is driven by wrk (a C load generator: a Python client on one core saturates before
the server does); gRPC by grpc.aio clients in worker processes, or by h2load in the
``*-h2load`` modes (``--grpc-streams`` calls in flight per connection; those modes give
no percentiles). The server and the load
are pinned to different cores. Prints requests/s, p50 and p99 per mode and concurrency.

The ``big-*`` modes round-trip one 16 MiB FP32 tensor through ``identity_fp32``: as HTTP
binary data, as gRPC raw contents, or in system shared memory (input read from one
region, output written to another; the HTTP request carries only the JSON that names
them). They also print the tensor throughput, in MiB/s each way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MODES = ("http-json", "http-binary", "grpc", "big-http-binary", "big-grpc", "big-shm")
# gRPC driven by h2load (a C client, as wrk is for HTTP); not in the default set.
H2LOAD_MODES = ("grpc-h2load", "big-grpc-h2load")
BIG_BYTES = 16 * 1024 * 1024  # the big-* modes' tensor


@dataclass
class Result:
    mode: str
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_us: float | None = None  # the server's CPU time per request, when its pid is known

    def row(self) -> str:
        line = (
            f"{self.mode:<16} c={self.concurrency:<4} {self.requests_per_s:>10.1f} req/s"
            f"   p50 {self.p50_ms:7.2f} ms   p99 {self.p99_ms:7.2f} ms"
        )
        if self.cpu_us is not None:
            line += f"   cpu {self.cpu_us:8.1f} us/req"
        if self.mode.startswith("big-"):
            line += f"   {self.requests_per_s * BIG_BYTES / 2**20:8.0f} MiB/s"
        return line


# --- the workload: `simple`, one row --------------------------------------------------


def simple_inputs() -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    return x, np.ones((1, 16), dtype=np.int32)


def http_body(mode: str) -> tuple[bytes, dict[str, str]]:
    if mode.startswith("big-"):
        return big_http_body(mode)
    x, y = simple_inputs()
    if mode == "http-json":
        inputs = [
            {"name": n, "shape": [1, 16], "datatype": "INT32", "data": a.reshape(-1).tolist()}
            for n, a in (("INPUT0", x), ("INPUT1", y))
        ]
        return json.dumps({"inputs": inputs}).encode(), {"Content-Type": "application/json"}
    inputs = [
        {"name": n, "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}}
        for n in ("INPUT0", "INPUT1")
    ]
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return header + x.tobytes() + y.tobytes(), {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }


def model_of(mode: str) -> str:
    return "identity_fp32" if mode.startswith("big-") else "simple"


# --- the big workload: 16 MiB through `identity_fp32` -----------------------------------

BIG_REGIONS = ("bench_big_in", "bench_big_out")


def big_tensor() -> np.ndarray:
    return np.arange(BIG_BYTES // 4, dtype=np.float32)


def big_http_body(mode: str) -> tuple[bytes, dict[str, str]]:
    count = BIG_BYTES // 4
    if mode == "big-shm":
        placed_in, placed_out = (
            {"shared_memory_region": name, "shared_memory_byte_size": BIG_BYTES}
            for name in BIG_REGIONS
        )
        document = {
            "inputs": [{"name": "INPUT0", "shape": [count], "datatype": "FP32",
                        "parameters": placed_in}],
            "outputs": [{"name": "OUTPUT0", "parameters": placed_out}],
        }  # fmt: skip
        return json.dumps(document).encode(), {"Content-Type": "application/json"}
    header = json.dumps({
        "inputs": [{"name": "INPUT0", "shape": [count], "datatype": "FP32",
                    "parameters": {"binary_data_size": BIG_BYTES}}],
        "parameters": {"binary_data_output": True},
    }).encode()  # fmt: skip
    return header + big_tensor().tobytes(), {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }


@contextmanager
def big_regions(url: str) -> Iterator[None]:
    """The big-shm mode's two regions: created here, registered with the server at ``url``
    (which must run on this machine), unregistered and destroyed afterwards."""
    import tritonclient.utils.shared_memory as shm

    handles = []
    try:
        for name in BIG_REGIONS:
            key = f"/{name}_{os.getpid()}_{url.rsplit(':', 1)[-1]}"  # one pair per server
            handle = shm.create_shared_memory_region(name, key, BIG_BYTES)
            handles.append(handle)
            body = {"key": key, "offset": 0, "byte_size": BIG_BYTES}
            _post(url, f"/v2/systemsharedmemory/region/{name}/register", body)
        shm.set_shared_memory_region(handles[0], [big_tensor()])
        yield
    finally:
        for name in BIG_REGIONS[: len(handles)]:
            _post(url, f"/v2/systemsharedmemory/region/{name}/unregister", None)
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def _post(url: str, path: str, body: object) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://{url}{path}", data)) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{path} answered {reply.status}")


# --- HTTP through wrk ------------------------------------------------------------------

_LUA = """
local f = io.open("{body}", "rb")
wrk.method = "POST"
wrk.body = f:read("*all")
f:close()
{headers}
"""


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def run_wrk(
    url: str,
    mode: str,
    concurrency: int,
    duration: float,
    cpus: str,
    model: str | None = None,
    request: tuple[bytes, dict[str, str]] | None = None,
) -> Result:
    """wrk posting ``mode``'s body (or ``request``) to ``mode``'s model (or ``model``)."""
    body, headers = request or http_body(mode)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "body").write_bytes(body)
        lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
        script = Path(tmp) / "post.lua"
        script.write_text(_LUA.format(body=Path(tmp) / "body", headers=lines))
        command = [
            "taskset",
            "-c",
            cpus,
            "wrk",
            "-t1",
            f"-c{concurrency}",
            f"-d{round(duration)}s",
            "--latency",
            "-s",
            str(script),
            f"http://{url}/v2/models/{model or model_of(mode)}/infer",
        ]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        print(out, file=sys.stderr)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    return Result(mode, concurrency, rps, p50, p99)


# --- gRPC through grpc.aio in worker processes ------------------------------------------


def grpc_request(mode: str) -> Any:
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model_of(mode))
    if mode.startswith("big-"):
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[BIG_BYTES // 4])
        request.raw_input_contents.append(big_tensor().tobytes())
    else:
        x, y = simple_inputs()
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.extend([x.tobytes(), y.tobytes()])
    return request


def _grpc_worker(
    url: str, mode: str, concurrency: int, duration: float, cpu: int, out: multiprocessing.Queue
) -> None:
    os.sched_setaffinity(0, {cpu})
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    request = grpc_request(mode)
    unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]

    async def main() -> list[float]:
        latencies: list[float] = []
        async with grpc.aio.insecure_channel(url, options=unlimited) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            await stub.ModelInfer(request)  # warm the connection
            deadline = time.perf_counter() + duration

            async def loop() -> None:
                while (start := time.perf_counter()) < deadline:
                    await stub.ModelInfer(request)
                    latencies.append(time.perf_counter() - start)

            await asyncio.gather(*(loop() for _ in range(concurrency)))
        return latencies

    out.put(asyncio.run(main()))


def run_grpc(
    url: str, mode: str, concurrency: int, duration: float, cpus: list[int], processes: int
) -> Result:
    queue: multiprocessing.Queue = multiprocessing.Queue()
    processes = min(processes, concurrency)
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    workers = [
        multiprocessing.Process(
            target=_grpc_worker, args=(url, mode, share, duration, cpus[i % len(cpus)], queue)
        )
        for i, share in enumerate(shares)
    ]
    for worker in workers:
        worker.start()
    latencies = np.concatenate([np.asarray(queue.get()) for _ in workers]) * 1e3
    for worker in workers:
        worker.join()
    return Result(
        mode,
        concurrency,
        len(latencies) / duration,
        float(np.percentile(latencies, 50)),
        float(np.percentile(latencies, 99)),
    )


# --- gRPC through h2load ---------------------------------------------------------------


def run_h2load(
    url: str, mode: str, connections: int, streams: int, duration: float, cpus: str
) -> Result:
    message = grpc_request(mode).SerializeToString()
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body"
        body.write_bytes(len(message).to_bytes(5, "big") + message)  # gRPC's message prefix
        command = [
            "taskset", "-c", cpus, "h2load", "-t1", f"-c{connections}", f"-m{streams}",
            f"-D{round(duration)}", "-d", str(body),
            "-H", "content-type: application/grpc", "-H", "te: trailers",
            f"http://{url}/inference.GRPCInferenceService/ModelInfer",
        ]  # fmt: skip
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", out)
    if done is None or done.group(1) != done.group(2):
        print(out, file=sys.stderr)
    rps = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))  # type: ignore[union-attr]
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", out).group(1)  # type: ignore[union-attr]
    return Result(f"{mode}x{streams}", connections, rps, _ms(mean), float("nan"))


# --- the server's CPU time -------------------------------------------------------------


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of the process ``pid`` alone, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of ``pid`` and all its descendants (Triton's backend
    stubs, trioserve's front-end workers and instance processes), from /proc."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            total += process_cpu_seconds(current)
            pending += children(current)
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended meanwhile
    return total


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (those of every thread of it), from /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


# --- the server under test ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)  # a tool polling a server it started; not a test
    raise RuntimeError(f"server at {url} did not become ready")


@contextmanager
def trioserve_process(
    cpus: str, http_server: str, grpc_server: str, python: str
) -> Iterator[tuple[str, str, int]]:
    http, grpc = _free_port(), _free_port()
    command = [
        "taskset",
        "-c",
        cpus,
        python,
        "-m",
        "trioserve",
        "run",
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc),
        "--http-server",
        http_server,
        "--grpc-server",
        grpc_server,
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command)
    try:
        _wait_ready(f"127.0.0.1:{http}")
        yield f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)


def _describe(python: str) -> str:
    """The interpreter, for the record: how CPython was built moves these figures by a
    fifth (one built without profile-guided optimization is that much slower)."""
    script = "import sys; print(sys.version.split()[0])"
    out = subprocess.run([python, "-c", script], capture_output=True, text=True, check=True)
    return f"{python} (Python {out.stdout.strip()})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="HTTP host:port of a running server (else start trioserve)")
    parser.add_argument("--grpc-url", help="gRPC host:port of a running server")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--server-cpus", default="0", help="cores for a server this tool starts")
    parser.add_argument("--client-cpus", default="1", help="cores for the load generator")
    parser.add_argument("--grpc-processes", type=int, default=1)
    parser.add_argument("--http-server", default="stdlib", choices=("stdlib", "hypercorn"))
    parser.add_argument("--grpc-server", default="trio", choices=("trio", "grpclib"))
    parser.add_argument("--grpc-streams", type=int, default=1, help="h2load calls per connection")
    parser.add_argument(
        "--server-pid",
        type=int,
        help="with --url/--grpc-url: the server's pid, to print its CPU time per request",
    )
    parser.add_argument(
        "--server-python",
        default=sys.executable,
        help="the interpreter that runs a server this tool starts (with trioserve installed)",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(m.startswith("http") for m in modes) and shutil.which("wrk") is None:
        sys.exit("wrk is needed for the HTTP modes (apt-get install wrk)")
    if any(m.endswith("h2load") for m in modes) and shutil.which("h2load") is None:
        sys.exit("h2load is needed for the *-h2load modes (apt-get install nghttp2-client)")
    client_cpus = [int(c) for c in args.client_cpus.split(",")]

    @contextmanager
    def target() -> Iterator[tuple[str, str, int | None]]:
        if args.url or args.grpc_url:
            yield args.url, args.grpc_url, args.server_pid
        else:
            print(f"trioserve on {_describe(args.server_python)}", flush=True)
            with trioserve_process(
                args.server_cpus, args.http_server, args.grpc_server, args.server_python
            ) as urls:
                yield urls

    with target() as (http_url, grpc_url, pid):
        for mode in modes:
            with big_regions(http_url) if mode == "big-shm" else nullcontext():
                for concurrency in levels:
                    cpu_before = None if pid is None else cpu_seconds(pid)
                    if mode.endswith("h2load"):
                        result = run_h2load(
                            grpc_url,
                            mode,
                            concurrency,
                            args.grpc_streams,
                            args.duration,
                            args.client_cpus,
                        )
                    elif mode.endswith("grpc"):
                        result = run_grpc(
                            grpc_url,
                            mode,
                            concurrency,
                            args.duration,
                            client_cpus,
                            args.grpc_processes,
                        )
                    else:
                        result = run_wrk(
                            http_url, mode, concurrency, args.duration, args.client_cpus
                        )
                    if pid is not None and cpu_before is not None and result.requests_per_s:
                        requests = result.requests_per_s * args.duration
                        result.cpu_us = (cpu_seconds(pid) - cpu_before) / requests * 1e6
                    print(result.row(), flush=True)


if __name__ == "__main__":
    main()
