"""Host metrics under Triton's names: CPU from /proc, GPUs through NVML when one is visible.

``nv_cpu_utilization`` is the share of non-idle CPU time across all cores since the
previous scrape (since the collector was made, on the first), 0.0 to 1.0, as Triton
computes it per interval. Memory: ``MemTotal`` and ``MemTotal - MemAvailable`` of
/proc/meminfo. Where /proc is missing (not Linux) the CPU families are left out.

GPU families (``nv_gpu_utilization``, ``nv_gpu_memory_total_bytes``,
``nv_gpu_memory_used_bytes``, label ``gpu_uuid``) exist only when the NVML bindings
(``pynvml``, from the ``gpu`` extra) import and see at least one device.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger("trioserve.metrics")

_PROC = Path("/proc")


def _cpu_times(proc: Path) -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores, from the first line of /proc/stat."""
    try:
        fields = (proc / "stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal [guest guest_nice]; guest time
    # is already inside user and nice.
    values = [int(v) for v in fields[1:9]]
    idle = values[3] + values[4]
    total = sum(values)
    return total - idle, total


def _memory_bytes(proc: Path) -> tuple[int, int] | None:
    """(total, used) bytes of RAM from /proc/meminfo."""
    try:
        lines = (proc / "meminfo").read_text().splitlines()
    except OSError:
        return None
    kib = {}
    for line in lines:
        key, _, rest = line.partition(":")
        kib[key] = int(rest.split()[0]) if rest.split() else 0
    total = kib.get("MemTotal", 0) * 1024
    available = kib.get("MemAvailable", kib.get("MemFree", 0)) * 1024
    return total, total - available


class CpuCollector(Collector):
    def __init__(self, proc: Path = _PROC) -> None:
        self._proc = proc
        self._previous = _cpu_times(proc)

    def collect(self) -> Iterator[Metric]:
        now = _cpu_times(self._proc)
        if now is not None:
            busy, total = now
            before_busy, before_total = self._previous or (0, 0)
            elapsed = total - before_total
            utilization = (busy - before_busy) / elapsed if elapsed > 0 else 0.0
            self._previous = now
            yield GaugeMetricFamily(
                "nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", value=utilization
            )
        memory = _memory_bytes(self._proc)
        if memory is not None:
            total_bytes, used_bytes = memory
            yield GaugeMetricFamily(
                "nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", value=total_bytes
            )
            yield GaugeMetricFamily(
                "nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", value=used_bytes
            )


class GpuCollector(Collector):
    """GPU families through ``nvml`` (the ``pynvml`` module, already initialized)."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    def collect(self) -> Iterator[Metric]:
        nvml = self._nvml
        utilization = GaugeMetricFamily(
            "nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", labels=("gpu_uuid",)
        )
        total = GaugeMetricFamily(
            "nv_gpu_memory_total_bytes", "GPU total memory, in bytes", labels=("gpu_uuid",)
        )
        used = GaugeMetricFamily(
            "nv_gpu_memory_used_bytes", "GPU used memory, in bytes", labels=("gpu_uuid",)
        )
        for index in range(nvml.nvmlDeviceGetCount()):
            device = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml.nvmlDeviceGetUUID(device)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            memory = nvml.nvmlDeviceGetMemoryInfo(device)
            utilization.add_metric([uuid], nvml.nvmlDeviceGetUtilizationRates(device).gpu / 100)
            total.add_metric([uuid], memory.total)
            used.add_metric([uuid], memory.used)
        yield utilization
        yield total
        yield used


def gpu_collector() -> GpuCollector | None:
    """A collector of the visible GPUs, or None without NVML bindings or devices."""
    try:
        import pynvml  # the gpu extra (nvidia-ml-py)
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        logger.info("no GPU metrics: NVML is not usable (%s)", exc)
        return None
    return GpuCollector(pynvml) if count else None
