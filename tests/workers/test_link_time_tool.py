"""``tools/core_link_time.py``: the core's CPU per inference for each placement of its
worker, measured over a link that answers every frame's inferences."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "core_link_time.py"


def test_the_tool_gives_the_cores_cpu_per_inference_for_each_placement() -> None:
    command = [
        sys.executable, str(TOOL), "--per-frame", "3", "--frames", "20",
        "--worker-work-us", "0,100", "--rounds", "1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    figures = re.findall(
        r"round 1: worker on the (same|other) CPU, (\d+) µs of work a frame: "
        r"the core spends (-?[\d.]+) µs per inference",
        done.stdout,
    )
    placements = ["same", "other"] if len(os.sched_getaffinity(0)) > 1 else ["same"]
    # Every placement with every amount of work, in order; each run answered all of its
    # frames (a lost answer would leave its worker waiting and the tool hanging). The
    # figures themselves, a difference of two short runs' CPU times, are noise at this
    # size: the tool's own runs are hundreds of times longer.
    assert [(place, work) for place, work, _ in figures] == [
        (place, work) for work in ("0", "100") for place in placements
    ], done.stdout
