"""``tools/soak.py`` against ``trioserve run --workers 2``: it samples the server with its
child processes (the workers among them), and a worker that dies during the soak (and is
restarted) fails it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ._served import TIMEOUT, TOOLS, Served, load_tool

TOOL = TOOLS / "soak.py"


def _soak_command(served: Served, report: Path, minutes: str, interval: str) -> list[str]:
    return [
        sys.executable, str(TOOL), "--minutes", minutes, "--interval", interval,
        "--url", served.url, "--grpc-url", served.grpc_url,
        "--server-pid", str(served.process.pid), "--json", str(report),
    ]  # fmt: skip


@pytest.fixture
def soak_tool(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_tool(monkeypatch, "soak")


def test_a_process_is_sampled_with_its_descendants(soak_tool: ModuleType) -> None:
    waits = "import sys; print('started', flush=True); sys.stdin.read()"
    parent = (
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {waits!r}], stdin=subprocess.PIPE,"
        " stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\n"  # its descriptors settled
        "print(child.pid, flush=True)\n"
        "sys.stdin.read()\n"
        "child.stdin.close()\n"
        "child.wait()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as process:
        assert process.stdin is not None and process.stdout is not None
        child = int(process.stdout.readline())
        assert soak_tool.process_tree(process.pid) == [process.pid, child]
        rss, fds, threads, tree = soak_tool.tree_figures(process.pid)
        each = [soak_tool.process_figures(pid) for pid in (process.pid, child)]
        process.stdin.close()  # both exit
        assert tree == [process.pid, child]
        assert fds == sum(figures[1] for figures in each)
        assert threads == sum(figures[2] for figures in each)
        assert rss > max(figures[0] for figures in each)  # both counted
    assert process.returncode == 0


def test_a_soak_samples_the_core_and_its_workers_together(tmp_path: Path) -> None:
    served = Served()
    try:
        report = tmp_path / "soak.json"
        command = _soak_command(served, report, minutes="0.05", interval="1")
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT * 2)
        assert done.returncode == 0, done.stdout + done.stderr
        samples = json.loads(report.read_text())["samples"]
        trees = {tuple(sample["processes"]) for sample in samples}
        assert len(trees) == 1  # none exited, none was added
        (tree,) = trees
        assert tree[0] == served.process.pid
        assert set(served.worker_pids()) <= set(tree[1:])
    finally:
        assert served.stop() == 0


def test_a_worker_that_dies_during_a_soak_fails_it(tmp_path: Path) -> None:
    served = Served()
    try:
        report = tmp_path / "soak.json"
        command = _soak_command(served, report, minutes="0.1", interval="2")
        soak = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert soak.stdout is not None
        for line in soak.stdout:
            if not line.startswith("soak:"):  # the first sample under load
                break
        victim = served.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        served.wait_for(r"front-end worker \d \(pid \d+\) serving")  # its successor
        soak.stdout.read()
        soak.stdout.close()
        assert soak.wait(timeout=TIMEOUT) == 1
        document = json.loads(report.read_text())
        assert victim in document["samples"][0]["processes"]
        assert victim not in document["samples"][-1]["processes"]
        assert f"the server's processes {victim} exited during the soak" in document["failures"]
    finally:
        assert served.stop() == 0, "".join(served.log)
