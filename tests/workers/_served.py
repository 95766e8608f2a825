"""``trioserve run --workers N`` as a real subprocess, for the workers' tests."""

from __future__ import annotations

import importlib.util
import json
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

import httpx
import pytest

TIMEOUT = 60.0
TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """``tools/NAME.py`` as a module: its neighbours importable (``soak_traffic``...),
    itself in ``sys.modules`` under its name (for its dataclasses), both for the test."""
    monkeypatch.syspath_prepend(str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


class Served:
    """A server started with ``--workers`` on free ports; its log read as it comes."""

    def __init__(
        self, *flags: str, workers: int = 2, server: tuple[str, ...] = ("-m", "trioserve")
    ) -> None:
        """``server``: what Python runs (``trioserve run``'s arguments follow)."""
        self._folder = tempfile.TemporaryDirectory()
        ports_file = Path(self._folder.name) / "ports.json"
        command = [
            sys.executable, *server, "run", "--host", "127.0.0.1",
            "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
            "--workers", str(workers), "--ports-file", str(ports_file), *flags,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self.wait_for("serving models")
        except BaseException:
            self.process.kill()
            raise
        ports = json.loads(ports_file.read_text())
        self.http, self.grpc, self.metrics = ports["http"], ports["grpc"], ports["metrics"]
        self.url = f"127.0.0.1:{self.http}"
        self.grpc_url = f"127.0.0.1:{self.grpc}"

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            self._lines.put(line)
        self._lines.put(None)  # every process holding the pipe (workers too) has exited

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The next log line matching ``pattern``: waits for a line, not for a time."""
        while True:
            line = self._lines.get(timeout=TIMEOUT)
            if line is None:
                raise AssertionError(f"the server's log ended without {pattern!r}")
            found = re.search(pattern, line)
            if found:
                return found

    def wait_log_closed(self) -> None:
        """Until every process that writes the log (the core and its workers) is gone."""
        self._reader.join(timeout=TIMEOUT)
        assert not self._reader.is_alive()

    def child_pids(self) -> list[int]:
        """The core's child processes: its workers and its models' processes."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(stat[1]) == self.process.pid:
                    pids.append(int(entry.name))
        return sorted(pids)

    def worker_pids(self) -> list[int]:
        pids = []
        for pid in self.child_pids():
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"trioserve.workers" in command:  # not a model's process
                pids.append(pid)
        return pids

    def metric(self, name: str) -> float:
        """The value of one sample of the metrics port's scrape, e.g.
        ``trioserve_worker_calls_total{worker="0"}``."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics", timeout=TIMEOUT).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} is not in the scrape")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=TIMEOUT)
        finally:
            self.process.kill()
            self._reader.join(timeout=TIMEOUT)
            assert self.process.stderr is not None
            self.process.stderr.close()
            self._folder.cleanup()
