"""``tools/worker_kills.py``: workers killed under load are replaced, the core lives on
with the descriptors and tasks it had (and no arena segments of the workers it lost),
and the tool says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ._served import TIMEOUT

TOOL = Path(__file__).resolve().parents[2] / "tools" / "worker_kills.py"


def test_two_workers_killed_under_load_are_replaced_and_the_core_serves_on(
    tmp_path: Path,
) -> None:
    report = tmp_path / "kills.json"
    command = [sys.executable, str(TOOL), "--kills", "2", "--every", "1", "--threads", "2",
               "--json", str(report)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT * 3)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("worker_kills: PASS")
    figures = json.loads(report.read_text())
    assert figures["failures"] == [] and figures["kills"] == 2
    assert figures["answered"] > 0 and figures["wrong"] == 0
    assert figures["after"]["fds"] <= figures["before"]["fds"]
    assert 1 <= figures["after"]["segments"] <= 2  # the killed workers' arenas are closed
    assert figures["after"]["tasks"] <= figures["before"]["tasks"]
