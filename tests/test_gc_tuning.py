"""``trioserve run`` tunes the process's cyclic garbage collector once it serves, and
collects on a timer what the higher threshold would leave lying."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import trio

from trioserve import _gc


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.disable()  # only the code under test collects
    yield
    gc.enable()
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class Cycle:
    """Garbage only the cyclic collector can free."""

    def __init__(self) -> None:
        self.me = self


@pytest.mark.usefixtures("restored_collector")
def test_startup_objects_are_frozen_and_collections_are_rare() -> None:
    gc.unfreeze()
    built_at_startup = Cycle()
    _gc.tune()
    assert gc.get_freeze_count() > 0
    assert not any(o is built_at_startup for o in gc.get_objects())  # frozen: never scanned
    assert gc.get_threshold() == (10_000, 1, 2**30)


@pytest.mark.usefixtures("restored_collector")
def test_a_crowd_of_long_lived_objects_meets_only_small_collections() -> None:
    """What a crowd of connections allocates and keeps (400,000 objects) passes through
    the young generations: no collection Python starts meets more than three young
    generations' worth, and none is a full one (only the timer's are)."""
    _gc.tune()
    met: list[tuple[int, int]] = []  # (generation, objects in the generations collected)

    def measure(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            generation = info["generation"]
            met.append((generation, sum(len(gc.get_objects(g)) for g in range(generation + 1))))

    gc.callbacks.append(measure)
    gc.enable()
    try:
        crowd: list[list[int]] = [[] for _ in range(400_000)]
    finally:
        gc.disable()
        gc.callbacks.remove(measure)
    assert len(crowd) == 400_000
    assert {generation for generation, _ in met} == {0, 1}
    # (and a few objects the test itself made meanwhile)
    assert max(objects for _, objects in met) <= 3 * _gc.YOUNG_THRESHOLD + 1_000


def _garbage(in_oldest: bool) -> weakref.ref[Cycle]:
    cycle = Cycle()
    if in_oldest:
        gc.collect()  # alive through a full collection: it moves to the oldest generation
    return weakref.ref(cycle)


@pytest.mark.usefixtures("restored_collector")
async def test_the_timer_collects_young_garbage_every_second(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_gc.collect_periodically)
        young = _garbage(in_oldest=False)
        await trio.sleep(0.5)
        assert young() is not None
        await trio.sleep(0.6)
        assert young() is None
        nursery.cancel_scope.cancel()


@pytest.mark.usefixtures("restored_collector")
async def test_the_timer_collects_everything_every_thirty_seconds(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_gc.collect_periodically)
        old = _garbage(in_oldest=True)
        await trio.sleep(29.5)
        assert old() is not None  # young collections leave the oldest generation alone
        await trio.sleep(1)
        assert old() is None
        nursery.cancel_scope.cancel()
