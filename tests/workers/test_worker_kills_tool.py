"""``tools/worker_kills.py``: workers killed under load are replaced, the core lives on
with the descriptors and tasks it had (and no arena segments of the workers it lost),
and the tool says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ._served import TIMEOUT, TOOLS, load_tool

TOOL = TOOLS / "worker_kills.py"


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
    assert figures["answered"] > 0 and figures["wrong"] == figures["unexcused"] == 0
    assert figures["after"]["fds"] <= figures["before"]["fds"]
    assert 1 <= figures["after"]["segments"] <= 2  # the killed workers' arenas are closed
    assert figures["after"]["tasks"] <= figures["before"]["tasks"]


@pytest.fixture
def kills_tool(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_tool(monkeypatch, "worker_kills")


def test_a_kill_excuses_one_failure_per_thread_and_more_only_soon_after_it(
    kills_tool: ModuleType,
) -> None:
    kills = [10.0, 20.0]
    late = 0.01 + kills_tool.GRACE_S
    failures = [
        (5.0, 0, "warm"),  # before any kill
        (10.01, 0, "cut"), (10.02, 1, "cut too"),  # its clients, as it died
        (10.03, 1, "shared connection"),  # a fresh grpcio client on the dying connection
        (10.0 + late, 1, "late"),  # a third, on a worker that lives
        (20.0 + late, 0, "idle connection"),  # one the thread found dead on its next use
        (20.0 + late + 0.1, 0, "later"),
    ]  # fmt: skip
    assert kills_tool.unexcused(failures, kills) == [
        "warm (thread 0, before any kill)",
        f"late (thread 1, again {late:.2f} s after a kill)",
        f"later (thread 0, again {late + 0.1:.2f} s after a kill)",
    ]


def test_growth_names_the_kind_of_descriptor(kills_tool: ModuleType) -> None:
    def figures(sockets: int, segments: int, tasks: int) -> dict[str, object]:
        descriptors = {"socket": sockets, kills_tool.SEGMENT: segments}
        return {"fds": sockets, "segments": segments, "tasks": tasks, "descriptors": descriptors}

    assert kills_tool.grown(figures(18, 1, 61), figures(18, 2, 61)) == []  # a link's first
    assert kills_tool.grown(figures(18, 2, 61), figures(19, 3, 62)) == [
        "the core's fds grew from 18 to 19 ({'socket': 19})",
        "the core's tasks grew from 61 to 62",
        "the core holds 3 segments for 2 workers",
    ]
