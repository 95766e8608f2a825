"""The README's first command, checked: a plain install (``pip install .``, no test
extras, so the newest compatible dependencies) serves every built-in model.

    python tools/smoke_run.py PATH/TO/trioserve

Starts ``trioserve run`` on free ports, waits until it is ready, asks the repository
index, and stops the server by its PID. Exits 1 if any built-in model is not READY.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    executable = sys.argv[1]
    http, grpc = free_port(), free_port()
    command = [executable, "run", "--host", "127.0.0.1", "--http-port", str(http),
               "--grpc-port", str(grpc), "--log-level", "warning"]  # fmt: skip
    server = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                url = f"http://127.0.0.1:{http}/v2/health/ready"
                with urllib.request.urlopen(url, timeout=2) as ready:
                    if ready.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    print("smoke: the server did not become ready", file=sys.stderr)
                    return 1
                time.sleep(0.2)  # a tool polling a server it started; not a test
        index = urllib.request.Request(f"http://127.0.0.1:{http}/v2/repository/index", b"{}")
        with urllib.request.urlopen(index, timeout=10) as reply:
            models = json.load(reply)
        failed = [m for m in models if m["state"] != "READY"]
        for model in failed:
            print(f"smoke: {model['name']} is {model['state']}: {model['reason']}", file=sys.stderr)
        print(f"smoke: {len(models) - len(failed)} of {len(models)} built-in models READY")
        return 1 if failed or not models else 0
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
