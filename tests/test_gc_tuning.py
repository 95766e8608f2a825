"""``trioserve run`` tunes the process's cyclic garbage collector once it serves."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from trioserve._cli import tune_garbage_collector


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_collector")
def test_startup_objects_are_frozen_and_young_collections_are_rare() -> None:
    gc.unfreeze()
    older_before = gc.get_threshold()[1:]
    built_at_startup = object.__new__(type("Model", (), {}))
    tune_garbage_collector()
    assert gc.get_freeze_count() > 0
    assert not any(o is built_at_startup for o in gc.get_objects())  # frozen: never scanned
    assert gc.get_threshold() == (10_000, *older_before)  # the older generations as they were
