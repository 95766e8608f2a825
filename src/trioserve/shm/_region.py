"""What every registered region has in common: a name, a size, and a reference count.

A region is *leased* by each request that reads an input from it or writes an output
into it, from the moment the request is decoded until its response is encoded.
Unregistering only *retires* a region: its name is free again at once, but what it holds
open (a system region's descriptor, a CUDA region's memory handle) stays open until the
last lease is returned. That is what keeps a request in flight from reading or writing
through a descriptor that was closed (and perhaps reused for another file) under it.
Whatever was handed a copy of the descriptor (an instance process) is told to close it
then (``when_released``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

from .._errors import InvalidArgumentError

Kind = Literal["system", "cuda"]


class Region(ABC):
    """One registered region. Subclasses own the mapping and say how to release it."""

    kind: Kind

    def __init__(self, name: str, byte_size: int) -> None:
        self.name = name
        self.byte_size = byte_size
        self._leases = 0
        self._retired = False
        self._released = False
        self._on_release: list[Callable[[], None]] = []

    @property
    def released(self) -> bool:
        """Whether the region let go of what it held open (retired, and no lease left)."""
        return self._released

    def acquire(self) -> None:
        """Take a lease: the region stays open until the matching ``release``."""
        self._leases += 1

    def release(self) -> None:
        self._leases -= 1
        if self._retired and self._leases == 0:
            self._release_once()

    def retire(self) -> None:
        """Unregistered: let go now if nobody holds a lease, else when the last one ends."""
        self._retired = True
        if self._leases == 0:
            self._release_once()

    def when_released(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) once the region let go of what it held
        open: what was handed its descriptor lets go of it too."""
        self._on_release.append(callback)

    def check_span(self, offset: int, byte_size: int, what: str) -> None:
        """INVALID_ARG unless ``[offset, offset + byte_size)`` lies inside the region."""
        if offset + byte_size > self.byte_size:
            raise InvalidArgumentError(
                f"{what}: shared memory offset {offset} + byte size {byte_size} exceeds the "
                f"{self.byte_size} bytes of region '{self.name}'"
            )

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """The region's entry in the status answer of its kind."""

    @abstractmethod
    def _release(self) -> None:
        """Close what the region holds open; called once, with no lease left."""

    def _release_once(self) -> None:
        if not self._released:
            self._released = True
            self._release()
            callbacks, self._on_release = self._on_release, []
            for callback in callbacks:
                callback()
