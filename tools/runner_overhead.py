"""CPU time per request through ``ModelRunner.infer`` for the ``simple`` zoo model.

    PYTHONPATH=src python tools/runner_overhead.py --requests 20000 --repeat 5
    PYTHONPATH=src python tools/runner_overhead.py --recording   # the statistics calls alone

No sockets and no codecs: what the scheduler itself costs (submit, batcher, execution,
outcome, statistics). Reports the best of ``--repeat`` runs of ``time.process_time()``,
for clients one at a time and for ``--concurrency`` clients at once (which batch). Runs
against older checkouts too, to compare before and after a change of the runner.
"""

from __future__ import annotations

import argparse
import inspect
import math
import time

import numpy as np
import trio

from trioserve import InferenceRequest, InputTensor
from trioserve._tensor import datatype
from trioserve.models import reference_zoo
from trioserve.scheduler._runner import ModelRunner


def _runner() -> ModelRunner:
    simple = next(m for m in reference_zoo() if m.name == "simple")
    if "histogram_bounds_ns" in inspect.signature(ModelRunner).parameters:
        from trioserve import MetricsConfig  # the server's default: histograms on

        return ModelRunner(simple, "1", histogram_bounds_ns=MetricsConfig().histogram_bounds_ns())
    return ModelRunner(simple, "1")


def _request() -> InferenceRequest:
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    int32 = datatype("INT32")
    inputs = {name: InputTensor(name, int32, (1, 16), x) for name in ("INPUT0", "INPUT1")}
    return InferenceRequest("simple", "", inputs)


async def _measure(requests: int, concurrency: int) -> float:
    """CPU seconds for ``requests`` requests from ``concurrency`` clients."""
    runner = _runner()
    request = _request()
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)

        async def client(count: int) -> None:
            for _ in range(count):
                await runner.infer(request)

        start = time.process_time()
        async with trio.open_nursery() as clients:
            for _ in range(concurrency):
                clients.start_soon(client, requests // concurrency)
        elapsed = time.process_time() - start
        nursery.cancel_scope.cancel()
    return elapsed


def _recording_cost(requests: int, repeat: int) -> None:
    """CPU time of what the runner records per request of a batch of one, without the
    clock reads: the batch's timestamps, one execution, one success."""
    from trioserve import MetricsConfig
    from trioserve._stats import ExecutionTimes, ModelStats

    for bounds in ((), MetricsConfig().histogram_bounds_ns()):
        stats = ModelStats("simple", "1", histogram_bounds_ns=bounds)
        best = math.inf
        for _ in range(repeat):
            start = time.process_time()
            for k in range(requests):
                times = ExecutionTimes(k, k + 1_000, k + 50_000, k + 51_000)
                stats.executed(1, times)
                stats.succeeded(k - 3_000, k + 52_000, 1, times)
            best = min(best, time.process_time() - start)
        kind = "with histograms" if bounds else "without histograms"
        print(f"recording {kind}: {best / requests * 1e6:5.2f} µs CPU per request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--recording", action="store_true", help="time the statistics calls")
    args = parser.parse_args()
    if args.recording:
        _recording_cost(args.requests * 10, args.repeat)
        return
    for concurrency in (1, args.concurrency):
        best = min(trio.run(_measure, args.requests, concurrency) for _ in range(args.repeat))
        per_request_us = best / args.requests * 1e6
        print(
            f"concurrency {concurrency:>3}: {per_request_us:6.2f} µs CPU per request (best of {args.repeat})"
        )


if __name__ == "__main__":
    main()
