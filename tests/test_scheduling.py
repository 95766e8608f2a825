"""``_scheduling.run_as_batch``: what a thread switched to ``SCHED_BATCH`` starts runs so
too, and a policy an operator chose is kept (real processes and threads)."""

from __future__ import annotations

import os
import subprocess
import sys

TIMEOUT = 60.0

# Prints whether it switched, then the policies of this thread, of a thread it starts
# and of a process it starts.
_SWITCH = """
import os, subprocess, sys, threading
from trioserve._scheduling import run_as_batch
{before}
print(run_as_batch(), os.sched_getscheduler(0))
seen = []
thread = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
thread.start()
thread.join()
child = "import os; print(os.sched_getscheduler(0))"
print(seen[0], subprocess.run([sys.executable, "-c", child], capture_output=True,
                              text=True, check=True).stdout.strip())
"""


def _switched(before: str = "") -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _SWITCH.format(before=before)],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_thread_and_what_it_starts_run_as_batch() -> None:
    batch = str(os.SCHED_BATCH)
    assert _switched() == ["True", batch, batch, batch]


def test_a_policy_an_operator_chose_is_kept() -> None:
    idle = str(os.SCHED_IDLE)
    chosen = "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))"
    assert _switched(chosen) == ["False", idle, idle, idle]
