"""``trioserve_tasks``: how many trio tasks the process runs, counted at each scrape.

A task that outlives its request (a connection handler that never returns, a watcher
nobody cancels) leaks slowly and shows nowhere else, since a parked task costs little
memory; a count that climbs under steady traffic finds it (``tools/soak.py`` watches it).
The count walks the task tree from the root task, so it covers every server the trio run
holds. It is taken on the event loop's thread, where the exposition runs; anywhere else
(no trio run in this thread) the family is left out.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


def count_tasks(root: trio.lowlevel.Task) -> int:
    """``root`` and every task under it."""
    count, pending = 0, [root]
    while pending:
        task = pending.pop()
        count += 1
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return count


class TaskCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        try:
            root = trio.lowlevel.current_root_task()
        except RuntimeError:  # not inside a trio run
            return
        if root is not None:
            yield GaugeMetricFamily(
                "trioserve_tasks", "Trio tasks alive in this process", value=count_tasks(root)
            )
