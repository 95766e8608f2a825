"""Front-end worker processes over one core process (``trioserve run --workers N``).

The core process (the one ``trioserve run`` starts) loads the models and owns every
piece of state: repository, runners and their batchers, shared-memory registry,
statistics, metrics, load reports, trace and log settings. N worker processes
(``python -m trioserve.workers``) serve the HTTP, gRPC and metrics ports: they accept,
parse, enforce the per-connection limits, and forward each call over a ``trioserve.ipc`` link,
large bodies and messages through shared memory; the core answers with the code one
process runs (``_core_link``). ``WorkerPool`` (``_pool``) starts, restarts and drains them.
"""

from ._pool import Ports, WorkerPool, WorkerStartError

__all__ = ["Ports", "WorkerPool", "WorkerStartError"]
