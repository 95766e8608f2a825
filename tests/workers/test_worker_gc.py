"""A front-end worker tunes its cyclic garbage collector once it listens, as the core
does (a real worker process; the test plays the core on the other end of its link)."""

from __future__ import annotations

import logging
import select
import subprocess
import sys

from trioserve._limits import GrpcLimits, HttpLimits
from trioserve.ipc import BlockingChannel, channel_pair
from trioserve.workers._wire import CONFIG, DRAIN, READY, WorkerSettings

from ._served import TIMEOUT

# The worker as ``python -m trioserve.workers FD`` runs it, its collector's settings
# printed once ``_gc.tune`` has made them.
_WORKER = """
import gc, sys
from trioserve import _gc
from trioserve.workers import _worker

tune = _gc.tune

def tune_and_tell():
    tune()
    print(gc.get_threshold(), gc.get_freeze_count() > 0, flush=True)

_gc.tune = tune_and_tell
_worker.main(sys.argv[1:])
"""


def test_a_worker_freezes_its_startup_and_collects_young_objects_rarely() -> None:
    ours, theirs = channel_pair()
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        stdout=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    channel = BlockingChannel(ours)
    try:
        settings = WorkerSettings(
            index=0, host="127.0.0.1", http_limits=HttpLimits(), grpc_limits=GrpcLimits(),
            grpc_tls=None, grpc_paths={}, http_sockets=0, metrics_sockets=0, exit_timeout_s=5.0,
            arena_max_bytes=1 << 20, log_level=logging.WARNING,
        )  # fmt: skip
        channel.send((CONFIG, settings))
        assert channel.receive()[0] == (READY,)
        assert worker.stdout is not None
        told, _, _ = select.select([worker.stdout], [], [], TIMEOUT)
        assert told, "the worker did not tune its collector"
        assert worker.stdout.readline().strip() == f"{(10_000, 1, 2**30)} True"
        channel.send((DRAIN,))
        assert worker.wait(timeout=TIMEOUT) == 0
    finally:
        channel.close()
        if worker.poll() is None:
            worker.kill()
        worker.communicate()  # reaped, its pipe closed
