"""The registry and request leases directly, over real POSIX shared memory."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import tritonclient.utils.shared_memory as shm

from trioserve import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    Restriction,
    ServerConfig,
    UnavailableError,
    UnsupportedError,
)
from trioserve._restricted import parse_restrictions
from trioserve._tensor import DATATYPES
from trioserve._types import InferenceResponse, OutputTensor, RequestedOutput
from trioserve.shm import RequestRegions, SharedMemoryRegistry, shared_memory_input
from trioserve.shm._cuda import cuda_unavailable_reason

FP32 = DATATYPES["FP32"]


@pytest.fixture
def registry():
    made = SharedMemoryRegistry()
    yield made
    made.close()


def _placed(name, byte_size, offset=0):
    return {
        "shared_memory_region": name,
        "shared_memory_byte_size": byte_size,
        "shared_memory_offset": offset,
    }


def test_a_window_past_a_page_boundary_reads_its_own_bytes(registry, regions):
    values = np.arange(1000, dtype=np.float32)
    handle, key = regions.create("window", 4097 + values.nbytes)
    shm.set_shared_memory_region(handle, [values], offset=4097)
    registry.register_system("w", key, 4097, values.nbytes)
    with RequestRegions(registry) as request:
        array = shared_memory_input(request, _placed("w", 40, 8), FP32, (10,), "input 'X'", False)
        assert array is not None
        np.testing.assert_array_equal(array, values[2:12])
        assert not array.flags.writeable  # models get read-only arrays, as with HTTP bodies
        shm.set_shared_memory_region(handle, [np.float32([-1])], offset=4097 + 8)
        assert array[0] == 2  # a copy, read while the request was decoded


def test_a_lease_keeps_an_unregistered_region_open(registry, regions):
    _, key = regions.create("leased", 64)
    registry.register_system("leased", key, 0, 64)
    request = RequestRegions(registry)
    span = request.span(_placed("leased", 64), "input 'X'")
    assert span is not None
    registry.unregister("system", "leased")
    assert registry.status("system") == []
    assert not span.region.released and regions.held(key) == 1
    request.close()
    assert span.region.released and regions.held(key) == 0
    request.close()  # closing twice returns nothing twice


def test_close_unregisters_everything(registry, regions):
    _, key = regions.create("many", 8192)
    for index in range(3):
        registry.register_system(f"r{index}", key, index * 16, 16)
    assert regions.held(key) == 3  # a descriptor each
    registry.close()
    assert registry.status("system") == [] and regions.held(key) == 0


async def test_names_and_values(registry, regions):
    _, key = regions.create("names", 64)
    registry.register_system("a", key, 0, 64)
    with pytest.raises(AlreadyExistsError):
        registry.register_system("a", key, 0, 8)
    with pytest.raises(AlreadyExistsError):
        await registry.register_cuda("a", b"\0" * 64, 0, 8)  # one namespace for both kinds
    for bad in [("", key, 0, 8), ("b", 5, 0, 8), ("b", key, -1, 8), ("b", key, 0, 0),
                ("b", key, 0, 2.5), ("b", key, True, 8)]:  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            registry.register_system(*bad)
    with pytest.raises(NotFoundError):
        registry.lease("b")
    assert [s["name"] for s in registry.status("system")] == ["a"]


def test_outputs_are_checked_before_any_is_written(registry, regions):
    handle, key = regions.create("outs", 64)
    shm.set_shared_memory_region(handle, [np.full(64, 7, np.uint8)])
    registry.register_system("outs", key, 0, 64)
    request = RequestRegions(registry)
    request.request_outputs([
        RequestedOutput("A", _placed("outs", 16)),
        RequestedOutput("B", _placed("outs", 8, 16)),
        RequestedOutput("C", {}),  # on the wire
    ])  # fmt: skip
    response = InferenceResponse("m", "1", [
        OutputTensor("A", FP32, np.ones(4, np.float32)),
        OutputTensor("B", FP32, np.ones(4, np.float32)),  # 16 bytes for a window of 8
        OutputTensor("C", FP32, np.ones(4, np.float32)),
    ])  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="output 'B' \\(8 bytes\\)"):
        request.write_outputs(response)
    assert (shm.get_contents_as_numpy(handle, np.uint8, [64]) == 7).all()
    response.outputs[1].data = np.ones(2, np.float32)
    request.write_outputs(response)
    assert response.outputs[0].parameters == {
        "shared_memory_region": "outs", "shared_memory_byte_size": 16,
    }  # fmt: skip
    assert response.outputs[1].parameters["shared_memory_offset"] == 16
    assert response.outputs[2].parameters == {}
    written = shm.get_contents_as_numpy(handle, np.float32, [6])
    np.testing.assert_array_equal(written, np.ones(6, np.float32))
    request.close()


def test_shared_memory_needs_regions():
    with pytest.raises(UnsupportedError):
        shared_memory_input(None, _placed("r", 4), FP32, (1,), "input 'X'", False)
    assert shared_memory_input(None, {"binary_data_size": 4}, FP32, (1,), "input", True) is None


async def test_cuda_is_unavailable_here_and_says_why(registry):
    reason = cuda_unavailable_reason()
    if reason is None:
        pytest.skip("cupy and a CUDA device are present")
    assert not registry.cuda_available
    assert registry.status("cuda") == []
    with pytest.raises(UnavailableError, match="CUDA shared memory is not available"):
        await registry.register_cuda("gpu", b"\0" * 64, 0, 64)
    assert registry.status("cuda") == []


async def test_a_cuda_region_still_opening_when_the_registry_closes(registry, fake_cupy):
    """Its name is taken while the handle opens in a worker thread; once open, a closed
    registry closes it again instead of keeping it."""
    address = fake_cupy.runtime.malloc(64)
    handle = fake_cupy.runtime.ipcGetMemHandle(address)
    gate = fake_cupy.hold_opens()

    async def register() -> None:
        with pytest.raises(UnavailableError, match="the server is shutting down"):
            await registry.register_cuda("r", handle, 0, 64)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(register)
            assert await trio.to_thread.run_sync(fake_cupy.open_waiting.wait, 30)
            with pytest.raises(AlreadyExistsError):
                registry.register_system("r", "any-key", 0, 64)
            registry.close()
            gate.set()
    finally:
        gate.set()  # never leave a worker thread waiting on the gate
    assert registry.status("cuda") == []
    assert fake_cupy.open_handles() == 0


def test_parse_restrictions():
    assert parse_restrictions(["shared-memory,model-repository:Admin-Key=a=b"]) == {
        "shared-memory": Restriction("admin-key", "a=b"),
        "model-repository": Restriction("admin-key", "a=b"),
    }
    for bad in ["shared-memory", "shared-memory:key", ":k=v", "health:k=v"]:
        with pytest.raises(ValueError):
            parse_restrictions([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_restrictions(["shared-memory:a=b", "shared-memory:c=d"])
    with pytest.raises(ValueError):
        ServerConfig(http_restricted_apis={"everything": Restriction("k", "v")})


def test_restricted_api_flags():
    from trioserve._cli import _parser, config_from_args

    args = _parser().parse_args([
        "run", "--http-restricted-api", "shared-memory:Admin-Key=s3cret",
        "--grpc-restricted-protocol", "shared-memory,model-repository:k=v",
    ])  # fmt: skip
    config = config_from_args(args)
    assert config.http_restricted_apis == {"shared-memory": Restriction("admin-key", "s3cret")}
    assert set(config.grpc_restricted_apis) == {"shared-memory", "model-repository"}
    with pytest.raises(ValueError, match="unknown restricted API"):
        config_from_args(_parser().parse_args(["run", "--http-restricted-api", "infer:k=v"]))
