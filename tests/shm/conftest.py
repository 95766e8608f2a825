from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import tritonclient.utils.shared_memory as shm

import trioserve
from trioserve import TensorSpec
from trioserve.shm._cuda import _cupy_or_reason


class Regions:
    """POSIX shared-memory objects made with tritonclient's own utilities, unique per test,
    destroyed (and unlinked) when the test ends."""

    def __init__(self) -> None:
        self.handles: list[object] = []
        self.prefix = uuid.uuid4().hex[:12]
        self._own: dict[str, int] = {}  # the client's own descriptors of each object

    def create(self, name: str, byte_size: int) -> tuple[object, str]:
        key = f"/trioserve_test_{self.prefix}_{name}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        self.handles.append(handle)
        self._own[key] = _descriptors(key)
        return handle, key

    def held(self, key: str) -> int:
        """How many descriptors of object ``key`` the server (in this process too) holds:
        those of this process beyond the client's own, counted when the object was made."""
        return _descriptors(key) - self._own[key]

    def destroy(self) -> None:
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)

    @staticmethod
    def mappings(key: str) -> int:
        """How many times this process maps object ``key``: once for the client's own
        handle (the server, in this process too, maps no system region)."""
        with Path("/proc/self/maps").open() as maps:
            return sum(line.rstrip().endswith(_path(key)) for line in maps)


def _path(key: str) -> str:
    return f"/dev/shm/{key.lstrip('/')}"


def _descriptors(key: str) -> int:
    """How many descriptors of this process are open on object ``key``."""
    count = 0
    for entry in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # a descriptor closed while they were listed
            count += os.readlink(entry) == _path(key)
    return count


@pytest.fixture
def regions() -> Iterator[Regions]:
    made = Regions()
    yield made
    made.destroy()


@pytest.fixture
def fake_cupy() -> Iterator[ModuleType]:
    """``fake_cupy.py`` installed as ``cupy``: servers started in the test see one device.

    Afterwards every IPC handle the server opened must be closed, and ``cupy`` is what it
    was before (usually absent).
    """
    spec = importlib.util.spec_from_file_location("cupy", Path(__file__).with_name("fake_cupy.py"))
    assert spec is not None and spec.loader is not None
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    previous = sys.modules.get("cupy")
    sys.modules["cupy"] = fake
    _cupy_or_reason.cache_clear()  # it remembers whether cupy imports
    try:
        yield fake
        gc.collect()  # arrays over a region that wait in reference cycles let go of it
        assert fake.open_handles() == 0, "an opened CUDA IPC handle was never closed"
    finally:
        if previous is None:
            del sys.modules["cupy"]
        else:
            sys.modules["cupy"] = previous
        _cupy_or_reason.cache_clear()


@pytest.fixture(scope="session")
def double_gpu() -> trioserve.Model:
    """A model on the GPU: its input must arrive as a cupy array, not a host copy."""

    @trioserve.model(
        name="double_gpu",
        inputs=[TensorSpec("INPUT0", "FP32", [-1])],
        outputs=[TensorSpec("OUTPUT0", "FP32", [-1])],
        device="gpu",
    )
    def double_gpu(INPUT0: Any) -> dict[str, Any]:
        assert type(INPUT0).__module__.startswith("cupy")
        return {"OUTPUT0": INPUT0 * 2}

    return double_gpu


@pytest.fixture(scope="module", params=["trio", "grpclib"])
def zoo_on_each_grpc_front_end(request: pytest.FixtureRequest) -> Iterator[trioserve.Server]:
    """The reference zoo on both transports, once per gRPC front end."""
    from trioserve.models import reference_zoo
    from trioserve.testing import server_in_thread

    config = trioserve.ServerConfig(
        models=reference_zoo(), http_port=0, grpc_port=0, grpc_server=request.param
    )
    with server_in_thread(config) as running:
        yield running
