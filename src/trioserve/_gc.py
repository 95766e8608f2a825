"""The cyclic garbage collector tuned for serving: the process's own choice, so made by
``trioserve run`` and not by ``serve()``, which runs inside its host's process.

What a request allocates is alive until it is answered, so under many connections a
young collection finds hundreds of requests' objects alive, promotes them, and the older
generations, full of objects that die there, are collected again and again: at 1,000
connections that cost about a sixth of the server's CPU. Freezing what startup built
(models, modules) takes it out of every later collection, and a higher young threshold
makes collections rare: frees by reference counting keep the net count of allocations
low.

So low that, left alone, the collector might never run again, and a cycle (an error's
traceback holding the frames of a large request: a 255 MiB body and its text) would keep
its memory for good. A timer collects the young generations every second and everything
every half minute; with startup frozen, each takes a few milliseconds.
"""

from __future__ import annotations

import gc

import trio

YOUNG_THRESHOLD = 10_000  # container allocations, net of frees (Python's default: 700)
YOUNG_INTERVAL_S = 1.0
FULL_EVERY = 30  # young collections per full one


def tune() -> None:
    """Freeze what exists now and raise the young threshold."""
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])


async def collect_periodically() -> None:
    """Collect the young generations every ``YOUNG_INTERVAL_S``, everything every
    ``FULL_EVERY`` of those, until cancelled."""
    while True:
        for _ in range(FULL_EVERY - 1):
            await trio.sleep(YOUNG_INTERVAL_S)
            gc.collect(1)
        await trio.sleep(YOUNG_INTERVAL_S)
        gc.collect()
