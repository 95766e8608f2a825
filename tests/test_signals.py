"""``trioserve run`` and its signals, in a real subprocess: a first SIGTERM (or SIGINT)
drains, a second one during the drain stops the process at once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from ._model_repository import write_model


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


_FIFO_MODEL = """
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        print("model is executing", file=sys.stderr, flush=True)
        with open({fifo!r}) as go:  # blocks until the test opens the other end
            go.read()
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""


_HELD_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group_drains_through_the_instance_processes(
    tmp_path: Path, sent: signal.Signals
) -> None:
    """Ctrl-C in a terminal, ``timeout`` or a service manager signal every process of the
    group: the instance processes must outlive the drain, which answers through them."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    repository = tmp_path / "repository"
    write_model(repository, "held", _HELD_CONFIG, _FIFO_MODEL.format(fifo=str(fifo)))
    command = [
        sys.executable, "-m", "trioserve", "run", "--model-repository", str(repository),
        "--host", "127.0.0.1", "--http-port", "0", "--allow-grpc", "false",
        "--allow-metrics", "false", "--python-instance-mode", "process",
    ]  # fmt: skip
    with subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            assert process.stderr is not None
            lines = iter(process.stderr)
            port = _wait_for(lines, r"HTTP service listening on 127\.0\.0\.1:(\d+)").group(1)
            answers: list[httpx.Response] = []
            body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [2.5]}]}
            request = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(
                        f"http://127.0.0.1:{port}/v2/models/held/infer", json=body, timeout=60
                    )
                )
            )
            request.start()
            _wait_for(lines, "model is executing")
            os.killpg(process.pid, sent)
            _wait_for(lines, f"received {sent.name}: draining")
            with open(fifo, "w"):  # the model returns
                pass
            request.join(timeout=60)
            assert process.wait(timeout=60) == 0
            rest = list(lines)
        finally:
            process.kill()
    [answer] = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2.5]
    assert not [line for line in rest if "Traceback" in line or "starting it again" in line]
