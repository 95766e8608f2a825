from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.utils.shared_memory as shm


class Regions:
    """POSIX shared-memory objects made with tritonclient's own utilities, unique per test,
    destroyed (and unlinked) when the test ends."""

    def __init__(self) -> None:
        self.handles: list[object] = []
        self.prefix = uuid.uuid4().hex[:12]

    def create(self, name: str, byte_size: int) -> tuple[object, str]:
        key = f"/trioserve_test_{self.prefix}_{name}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        self.handles.append(handle)
        return handle, key

    def destroy(self) -> None:
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)

    @staticmethod
    def mappings(key: str) -> int:
        """How many times this process maps object ``key``: once for the client's own
        handle, once more for each region the server (in this process too) has mapped."""
        path = f"/dev/shm/{key.lstrip('/')}"
        with Path("/proc/self/maps").open() as maps:
            return sum(line.rstrip().endswith(path) for line in maps)


@pytest.fixture
def regions() -> Iterator[Regions]:
    made = Regions()
    yield made
    made.destroy()
