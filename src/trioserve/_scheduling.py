"""The kernel's scheduling policy for a server of several processes: the process's own
choice, so made by ``trioserve run`` with ``--workers`` and not by ``serve()``, which
runs inside its host's process.

The core process and its front-end workers pass each other frames over their links.
With the usual policy, a frame that wakes a process preempts the one that sent it if
they share a CPU: the worker that has just sent a frame of its first requests stops, the
core answers those alone, and the requests the worker's other connections sent meanwhile
wait for the next frame, so the core wakes twice as often for as many requests.
``SCHED_BATCH`` tells Linux that these processes are throughput work: a process woken
runs once the CPU's current one waits (or its time slice ends), not at once. A process
with a CPU of its own runs as soon as it is woken, as before.

It is set before the models load, so the core, its threads and every process it starts
(workers, Python-backend instances) inherit it; a server that an operator started under
another policy (``chrt``) keeps that one.
"""

from __future__ import annotations

import os


def run_as_batch() -> bool:
    """Run this thread, and the threads and processes it starts from now on, as
    ``SCHED_BATCH`` where Linux has it and the usual policy is in force; whether it did."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None or os.sched_getscheduler(0) != os.SCHED_OTHER:
        return False
    os.sched_setscheduler(0, batch, os.sched_param(0))
    return True
