"""The shared-memory regions a server instance has registered, by name.

System and CUDA regions share one namespace (the extension's rule), so a name is taken
whatever kind of region holds it. The registry is owned by one server instance and used
only from its event loop thread (REST and gRPC handlers both run there), so it needs no
lock; models in worker threads only ever see arrays over regions their request leases.
A CUDA region is opened in a worker thread (opening a handle waits on the driver); its
name counts as taken from the start, so a second registration of it fails at once.
"""

from __future__ import annotations

from typing import Any

import trio

from .._errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, UnavailableError
from .._limits import MAX_SHARED_MEMORY_REGIONS
from ._cuda import CudaRegion, cuda_unavailable_reason
from ._region import Kind, Region
from ._system import SystemRegion

_KIND_WORDS = {"system": "system", "cuda": "CUDA"}


class SharedMemoryRegistry:
    """Register, look up, lease and unregister regions; ``close`` unregisters them all.

    At most ``max_regions`` are registered at once (those being opened count): each holds
    a file descriptor (a system region) or a device handle (a CUDA region), so without a
    bound one client could register until the process has no descriptor left for
    anything else.
    """

    def __init__(self, max_regions: int = MAX_SHARED_MEMORY_REGIONS) -> None:
        self._max_regions = max_regions
        self._regions: dict[str, Region] = {}
        self._opening: set[str] = set()  # names of CUDA regions being opened
        self._closed = False

    @property
    def cuda_available(self) -> bool:
        return cuda_unavailable_reason() is None

    # --- register ----------------------------------------------------------------------

    def register_system(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        name = self._free_name(name)
        if not isinstance(key, str):
            raise InvalidArgumentError("shared memory 'key' must be a string")
        offset = _count(offset, "offset")
        byte_size = _count(byte_size, "byte_size", minimum=1)
        self._regions[name] = SystemRegion(name, key, offset, byte_size)

    async def register_cuda(
        self, name: Any, raw_handle: Any, device_id: Any, byte_size: Any
    ) -> None:
        name = self._free_name(name)
        if not isinstance(raw_handle, bytes):
            raise InvalidArgumentError("CUDA shared memory 'raw_handle' must be bytes")
        device_id = _count(device_id, "device_id")
        byte_size = _count(byte_size, "byte_size", minimum=1)
        self._opening.add(name)
        try:
            # Not abandoned on cancellation: the region it opens is registered or closed.
            region = await trio.to_thread.run_sync(
                CudaRegion, name, raw_handle, device_id, byte_size
            )
        finally:
            self._opening.discard(name)
        if self._closed:  # the server stopped while the handle was being opened
            region.retire()
            raise UnavailableError("the server is shutting down")
        self._regions[name] = region

    def _free_name(self, name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("a shared memory region needs a non-empty name")
        if name in self._regions or name in self._opening:
            raise AlreadyExistsError(f"shared memory region '{name}' already in manager")
        if len(self._regions) + len(self._opening) >= self._max_regions:
            raise InvalidArgumentError(
                f"failed to register shared memory region '{name}': {self._max_regions} "
                "regions are registered, the most this server allows; unregister one first"
            )
        return name

    # --- status and unregister ---------------------------------------------------------

    def status(self, kind: Kind, name: str = "") -> list[dict[str, Any]]:
        """Every region of ``kind``, or the one called ``name`` (NOT_FOUND if none)."""
        if not name:
            return [r.status() for r in self._regions.values() if r.kind == kind]
        region = self._regions.get(name)
        if region is None:
            raise NotFoundError(
                f"Unable to find {_KIND_WORDS[kind]} shared memory region: '{name}'"
            )
        if region.kind != kind:
            raise NotFoundError(
                f"The region named '{name}' is registered as {_KIND_WORDS[region.kind]} "
                f"shared memory, not {_KIND_WORDS[kind]} shared memory"
            )
        return [region.status()]

    def unregister(self, kind: Kind, name: str = "") -> None:
        """Unregister ``name``, or every region of ``kind`` when ``name`` is empty.

        As in Triton, a name that is not registered (or names the other kind) is not an
        error. Regions still leased by requests in flight stay open until those end.
        """
        names = [n for n, r in self._regions.items() if r.kind == kind and name in ("", n)]
        for found in names:
            self._regions.pop(found).retire()

    def close(self) -> None:
        """The server is stopping: unregister everything, and what is still being opened."""
        self._closed = True
        for region in self._regions.values():
            region.retire()
        self._regions.clear()

    # --- leases ------------------------------------------------------------------------

    def lease(self, name: str) -> Region:
        """The region called ``name``, with a lease the caller must ``release``."""
        region = self._regions.get(name)
        if region is None:
            raise NotFoundError(f"Unable to find shared memory region: '{name}'")
        region.acquire()
        return region


def _count(value: Any, field: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidArgumentError(
            f"shared memory '{field}' must be an integer >= {minimum}, got {value!r}"
        )
    return value
