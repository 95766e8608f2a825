"""What a large repository upload costs the server: memory and event-loop stalls.

    python tools/upload_bench.py                  # one 180 MiB upload (base64 JSON, REST)
    python tools/upload_bench.py --mib 50 --repeat 3

Starts ``trioserve run`` in explicit mode, then loads a model through
``POST v2/repository/models/<name>/load`` whose ``file:`` parameters carry a data file of
``--mib`` MiB (and a model.py), while a probe asks ``/v2/health/live`` back to back,
each time on a new connection. Prints the server's resident memory before, at its peak
(VmHWM, reset before each upload) and after, and the probe's longest wait: how long the
event loop stood still. The server is whichever ``trioserve`` this Python imports
(``PYTHONPATH=OTHER/src`` to measure another build).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

MODEL = b"""
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests
        ]
"""
CONFIG = {
    "backend": "python",
    "max_batch_size": 0,
    "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
    "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}],
}


def memory_mib(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    return {
        key: int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]
        for key in ("VmRSS", "VmHWM")
    }


class Probe(threading.Thread):
    """Asks for readiness back to back; ``longest`` is the slowest answer, in seconds."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.longest = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            began = time.perf_counter()
            urllib.request.urlopen(self.url, timeout=60).read()
            self.longest = max(self.longest, time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=180)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--port", type=int, default=18600)
    args = parser.parse_args()
    data = os.urandom(args.mib * 1024 * 1024)
    parameters = {
        "config": json.dumps(CONFIG),
        "file:1/model.py": base64.b64encode(MODEL).decode(),
        "file:1/data.bin": base64.b64encode(data).decode(),
    }
    body = json.dumps({"parameters": parameters}).encode()
    del data, parameters
    command = [
        sys.executable, "-m", "trioserve", "run", "--model-control-mode", "explicit",
        "--model-repository", tempfile.mkdtemp(prefix="upload-bench-"),
        "--http-port", str(args.port), "--allow-grpc", "false", "--allow-metrics", "false",
        "--http-max-body-bytes", str(len(body) + 1024),
    ]  # fmt: skip
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        for line in server.stderr:
            if "HTTP service listening" in line:
                break
        # Keep reading what it logs: a full pipe would block the server mid-write.
        threading.Thread(target=server.stderr.read, daemon=True).start()
        base = f"http://127.0.0.1:{args.port}"
        print(f"body {len(body) / 2**20:.0f} MiB")
        for attempt in range(args.repeat):
            Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
            before = memory_mib(server.pid)
            probe = Probe(f"{base}/v2/health/live")
            probe.start()
            began = time.perf_counter()
            request = urllib.request.Request(f"{base}/v2/repository/models/big/load", body)
            urllib.request.urlopen(request, timeout=600).read()
            took = time.perf_counter() - began
            probe.stop.set()
            probe.join()
            after = memory_mib(server.pid)
            print(
                f"upload {attempt + 1}: {took:.2f} s; RSS before {before['VmRSS']:.0f} MiB, "
                f"peak {after['VmHWM']:.0f} MiB "
                f"(+{after['VmHWM'] - before['VmRSS']:.0f}); RSS after {after['VmRSS']:.0f} "
                f"MiB (+{after['VmRSS'] - before['VmRSS']:.0f}); longest probe wait "
                f"{probe.longest * 1000:.0f} ms"
            )
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
