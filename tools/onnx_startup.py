"""Start-up of a repository of many small ONNX models: seconds, threads, memory.

    python tools/onnx_startup.py --models 1000
    python tools/onnx_startup.py --models 1000 \\
        --backend-config onnxruntime,enable-global-threadpool=1
    python tools/onnx_startup.py --models 200 --max-seconds 30 --max-threads 200

Writes ``--models`` batching ONNX models (Z = X + Y over FP32 [N, 3]) as NAME/1/model.onnx
without config.pbtxt, so that auto-complete decides everything, and starts
``trioserve run --model-control-mode none`` on them (a free HTTP port of 127.0.0.1,
no gRPC or metrics port). It times the start until the HTTP port is listening (every
model loaded by then), reads the server's threads and RSS from /proc, checks that every
model is READY and that the first and last answer an inference, then stops the server.
Exits 1 when a ``--max-*`` bound is passed or a check fails.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from soak import stop_server

_LISTENING = re.compile(rb"HTTP service listening on [\d.]+:(\d+)")


def write_repository(root: Path, count: int) -> list[str]:
    from onnx import TensorProto, helper

    tensor = (TensorProto.FLOAT, ["N", 3])
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "Y"], ["Z"])],
        "add",
        [helper.make_tensor_value_info("X", *tensor), helper.make_tensor_value_info("Y", *tensor)],
        [helper.make_tensor_value_info("Z", *tensor)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    data = model.SerializeToString()
    names = [f"add_{index:05d}" for index in range(count)]
    for name in names:
        version = root / name / "1"
        version.mkdir(parents=True)
        (version / "model.onnx").write_bytes(data)
    return names


def _proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


def _request(url: str, body: dict[str, object] | None = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(url, data=data, timeout=60) as response:
        return json.loads(response.read() or b"null")


def measure(root: Path, names: list[str], backend_config: list[str]) -> dict[str, object]:
    command = [sys.executable, "-m", "trioserve", "run", "--model-repository", str(root),
               "--model-control-mode", "none", "--host", "127.0.0.1", "--http-port", "0",
               "--allow-grpc", "false", "--allow-metrics", "false", "--log-level", "info"]  # fmt: skip
    for setting in backend_config:
        command += ["--backend-config", setting]
    started = time.monotonic()
    server = subprocess.Popen(command, stderr=subprocess.PIPE)
    assert server.stderr is not None
    try:
        port = None
        for line in server.stderr:  # the server logs its port once every model is loaded
            found = _LISTENING.search(line)
            if found:
                port = int(found.group(1))
                break
        seconds = time.monotonic() - started
        # The rest of the log is read and dropped, so that the server never blocks on it.
        threading.Thread(target=server.stderr.read, daemon=True).start()
        if port is None:
            raise SystemExit(f"onnx_startup: the server exited ({server.wait()}) before serving")
        status = _proc_status(server.pid)
        base = f"http://127.0.0.1:{port}"
        index = _request(f"{base}/v2/repository/index", {})
        assert isinstance(index, list)
        ready = sum(1 for entry in index if entry.get("state") == "READY")
        inputs = [{"name": n, "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]} for n in "XY"]
        answers = [
            _request(f"{base}/v2/models/{name}/infer", {"inputs": inputs})
            for name in (names[0], names[-1])
        ]
        answered = all(
            isinstance(a, dict) and a["outputs"][0]["data"] == [2, 4, 6] for a in answers
        )
    finally:
        stop_server(server)
    return {
        "models": len(names),
        "ready": ready,
        "seconds_to_serve": round(seconds, 2),
        "threads": int(status["Threads"]),
        "rss_mib": round(int(status["VmRSS"].split()[0]) / 1024, 1),
        "inference_ok": answered,
        "backend_config": backend_config,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--backend-config", action="append", default=[], metavar="SETTING")
    parser.add_argument("--max-seconds", type=float, help="fail when serving takes longer")
    parser.add_argument("--max-threads", type=int, help="fail when the server has more threads")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="onnx_startup_") as folder:
        root = Path(folder)
        names = write_repository(root, args.models)
        figures = measure(root, names, args.backend_config)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    failures = []
    if figures["ready"] != args.models or not figures["inference_ok"]:
        failures.append("not every model is ready and answering")
    if args.max_seconds is not None and float(str(figures["seconds_to_serve"])) > args.max_seconds:
        failures.append(f"serving took more than {args.max_seconds} s")
    if args.max_threads is not None and int(str(figures["threads"])) > args.max_threads:
        failures.append(f"more than {args.max_threads} threads")
    if failures:
        raise SystemExit("onnx_startup: FAIL: " + "; ".join(failures))
    print("onnx_startup: PASS")


if __name__ == "__main__":
    main()
