"""A cache bounded by the bytes its entries stand for, not by their count: a client
that sends large distinct header blocks fills it in bytes long before it would in
entries. The oldest entry goes first."""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SizedCache(Generic[K, V]):
    __slots__ = ("_entries", "_limit", "evictions", "size")

    def __init__(self, limit: int) -> None:
        self._entries: dict[K, tuple[V, int]] = {}
        self._limit = limit
        self.size = 0  # the bytes the entries stand for, as their callers counted them
        self.evictions = 0

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: K, value: V, size: int) -> None:
        """Remember ``value`` (``size`` bytes' worth), dropping the oldest entries to
        make room; one larger than the whole cache is not kept."""
        if size > self._limit:
            return
        entries = self._entries
        old = entries.pop(key, None)
        if old is not None:
            self.size -= old[1]
        while self.size + size > self._limit:
            self.size -= entries.pop(next(iter(entries)))[1]
            self.evictions += 1
        entries[key] = (value, size)
        self.size += size

    def clear(self) -> None:
        self._entries = {}
        self.size = 0
