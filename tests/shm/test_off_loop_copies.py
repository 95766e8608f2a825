"""Copies of large system shared-memory windows run in a worker thread, not on the
server's event loop (a 16 MiB copy takes milliseconds, and would stall every other
client); small ones stay on the loop, where a thread hop would cost more than the copy."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from trioserve import ServerConfig
from trioserve._limits import OFF_LOOP_BYTES
from trioserve.models import reference_zoo
from trioserve.shm._system import SystemRegion
from trioserve.testing import server_in_thread

from .conftest import Regions


@pytest.fixture
def copying_threads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(copy, thread name) of every copy in or out of a system region."""
    seen: list[tuple[str, str]] = []
    read_into, write = SystemRegion.read_into, SystemRegion.write

    def recorded(kind: str, method: Any) -> Any:
        def call(*args: Any) -> Any:
            seen.append((kind, threading.current_thread().name))
            return method(*args)

        return call

    monkeypatch.setattr(SystemRegion, "read_into", recorded("read", read_into))
    monkeypatch.setattr(SystemRegion, "write", recorded("write", write))
    return seen


@pytest.mark.parametrize(("elements", "on_loop"), [(16, True), (OFF_LOOP_BYTES // 4, False)])
def test_large_windows_are_copied_off_the_loop(
    regions: Regions, copying_threads: list[tuple[str, str]], elements: int, on_loop: bool
) -> None:
    config = ServerConfig(models=reference_zoo(), http_port=0, grpc_port=None)
    with server_in_thread(config) as server:
        loop_thread = next(t.name for t in threading.enumerate() if t.name == "trioserve")
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        size = elements * 4
        values = np.arange(elements, dtype=np.float32)
        handle_in, key_in = regions.create("copy_in", size)
        handle_out, key_out = regions.create("copy_out", size)
        shm.set_shared_memory_region(handle_in, [values])
        client.register_system_shared_memory("copy_in", key_in, size)
        client.register_system_shared_memory("copy_out", key_out, size)
        tensor = httpclient.InferInput("INPUT0", [elements], "FP32")
        tensor.set_shared_memory("copy_in", size)
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("copy_out", size)
        client.infer("identity_fp32", [tensor], outputs=[output])
        answer = shm.get_contents_as_numpy(handle_out, np.float32, [elements])
        np.testing.assert_array_equal(answer, values)
        client.unregister_system_shared_memory()
        client.close()
    assert [kind for kind, _ in copying_threads] == ["read", "write"]
    assert all((thread == loop_thread) is on_loop for _, thread in copying_threads), copying_threads
