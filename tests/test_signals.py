"""``trioserve run`` and its signals, in a real subprocess: a first SIGTERM (or SIGINT)
drains, a second one during the drain stops the process at once."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_stops_the_drain(blocking_repository: Path, second: signal.Signals) -> None:
    command = [
        sys.executable, "-m", "trioserve", "run", "--model-repository", str(blocking_repository),
        "--host", "127.0.0.1", "--http-port", "0", "--allow-grpc", "false",
        "--allow-metrics", "false", "--exit-timeout-secs", "300",
    ]  # fmt: skip
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as process:
        try:
            assert process.stderr is not None
            lines = iter(process.stderr)
            port = _wait_for(lines, r"HTTP service listening on 127\.0\.0\.1:(\d+)").group(1)
            body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
            request = threading.Thread(
                target=_post_ignoring_errors,
                args=(f"http://127.0.0.1:{port}/v2/models/blocking/infer", body),
                daemon=True,
            )
            request.start()
            _wait_for(lines, "model is executing")
            process.send_signal(signal.SIGTERM)
            _wait_for(lines, "received SIGTERM: draining")
            process.send_signal(second)
            # The drain alone would last until the model returns (600 s) or 300 s pass.
            assert process.wait(timeout=20) == 128 + second
            assert any(f"received {second.name} again" in line for line in lines)
        finally:
            process.kill()
    request.join(timeout=20)
    assert not request.is_alive()


def _wait_for(lines: object, pattern: str) -> re.Match[str]:
    """The first stderr line matching ``pattern``: waits for a line, not for a time."""
    for line in lines:  # type: ignore[attr-defined]
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"the server ended without logging {pattern!r}")


def _post_ignoring_errors(url: str, body: object) -> None:
    """The request in flight: the server goes away under it."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url, json=body, timeout=60)
