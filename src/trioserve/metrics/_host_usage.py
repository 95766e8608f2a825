"""CPU and memory utilization for load reports, read from ``/proc`` and kept briefly.

CPU is this process's own use (user + system time) as a fraction of the CPUs it may run
on, so that replicas sharing a host, or pinned to different cores, each report their
own load; the host-wide figure would be the same for all of them. Memory is the host's
(``1 - MemAvailable / MemTotal``). Where ``/proc`` cannot be read (not Linux), a figure
is ``None`` and the report leaves it out.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("trioserve.metrics")

_PROC_SELF_STAT = Path("/proc/self/stat")
_PROC_MEMINFO = Path("/proc/meminfo")


def cpu_seconds_from_stat(text: str, ticks_per_second: int) -> float:
    """User + system CPU seconds from the text of ``/proc/<pid>/stat``."""
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / ticks_per_second


def memory_utilization_from_meminfo(text: str) -> float | None:
    """The used fraction of memory from the text of ``/proc/meminfo``."""
    sizes: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable"):
            sizes[name] = int(rest.split()[0])
    total, available = sizes.get("MemTotal"), sizes.get("MemAvailable")
    if not total or available is None:
        return None
    return 1.0 - available / total


def process_cpu_seconds() -> float | None:
    try:
        text = _PROC_SELF_STAT.read_text()
        return cpu_seconds_from_stat(text, os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def memory_utilization() -> float | None:
    try:
        return memory_utilization_from_meminfo(_PROC_MEMINFO.read_text())
    except (OSError, ValueError, IndexError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. under ``taskset``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not offered on every platform
        return os.cpu_count() or 1


class HostUsage:
    """CPU and memory utilization, sampled at most once per ``refresh_s``.

    CPU utilization is the CPU time used between two samples over the time between them,
    so the first sample has none to give (``None``) until the next one.
    """

    def __init__(
        self,
        *,
        cpu_seconds: Callable[[], float | None] = process_cpu_seconds,
        memory: Callable[[], float | None] = memory_utilization,
        cpus: int | None = None,
        refresh_s: float = 1.0,
    ) -> None:
        if refresh_s <= 0:
            raise ValueError("refresh_s must be positive")
        self._read_cpu = cpu_seconds
        self._read_memory = memory
        self._cpus = cpus if cpus is not None else usable_cpus()
        self._refresh_s = refresh_s
        self._sampled_at: float | None = None
        self._cpu_seconds: float | None = None
        self._figures: tuple[float | None, float | None] = (None, None)

    def sample(self, now: float) -> tuple[float | None, float | None]:
        """``(cpu_utilization, mem_utilization)`` as of ``now`` (seconds, monotonic)."""
        if self._sampled_at is not None and now - self._sampled_at < self._refresh_s:
            return self._figures
        cpu_seconds = self._read_cpu()
        cpu: float | None = None
        if (
            self._sampled_at is not None
            and cpu_seconds is not None
            and self._cpu_seconds is not None
        ):
            cpu = (cpu_seconds - self._cpu_seconds) / (now - self._sampled_at) / self._cpus
        self._sampled_at, self._cpu_seconds = now, cpu_seconds
        self._figures = (cpu, self._read_memory())
        return self._figures
