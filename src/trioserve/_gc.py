"""The cyclic garbage collector tuned for serving: the process's own choice, so made by
``trioserve run`` (the core process, and each front-end worker once it listens) and not
by ``serve()``, which runs inside its host's process.

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

What lives long (an idle connection: some 80 objects, its tasks, coroutines and HTTP/2
state) passes through both young generations once. Python collects the middle one after
ten young collections, so a crowd of thousands of connections arriving at once met
middle collections of some 100,000 objects each (15-45 ms: the event loop stood still).
So the middle generation is collected after every two young collections (three young
generations' worth at most: some 30,000 objects, a few ms). Python would then start a
full collection of its own every eleven middle ones, as soon as what they moved to the
oldest generation is a quarter of it (a crowd's connections are), so the oldest
generation is collected only by the timer, whose pace bounds how long a dead cycle
keeps its memory.
"""

from __future__ import annotations

import gc

import trio

YOUNG_THRESHOLD = 10_000  # container allocations, net of frees (Python's default: 700)
MIDDLE_THRESHOLD = 1  # young collections past this many: the next is a middle one (10)
OLDEST_THRESHOLD = 2**30  # middle collections past this many: the next is full (never)
YOUNG_INTERVAL_S = 1.0
FULL_EVERY = 30  # young collections per full one


def tune() -> None:
    """Freeze what exists now, raise the young threshold, collect the middle generation
    often and the oldest only on the timer."""
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLDEST_THRESHOLD)


async def collect_periodically() -> None:
    """Collect the young generations every ``YOUNG_INTERVAL_S``, everything every
    ``FULL_EVERY`` of those, until cancelled."""
    while True:
        for _ in range(FULL_EVERY - 1):
            await trio.sleep(YOUNG_INTERVAL_S)
            gc.collect(1)
        await trio.sleep(YOUNG_INTERVAL_S)
        gc.collect()
