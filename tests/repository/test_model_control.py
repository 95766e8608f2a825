"""The model control modes over time: poll mode picking up folder changes, version
policies, strict configs, and unloads and reloads that let requests in flight finish.

The servers run in-process without front ends; requests go to the repository directly.
The model sleeps in trio (``trio.from_thread.run`` from its worker thread) for the
delay its request asks, so under ``autojump_clock`` every wait below takes an exact,
virtual, time. The clock jumps only after ``THREAD_GRACE_S`` of real time with every task
blocked: a model's worker thread on its way into trio must not let it jump.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from trioserve import Server, ServerConfig, serve
from trioserve._errors import NotFoundError
from trioserve._tensor import datatype
from trioserve._types import InferenceRequest, InputTensor, RequestedOutput
from trioserve.repository import RepositoryManager

from .._model_repository import write_model

THREAD_GRACE_S = 0.5


@pytest.fixture
def clock(autojump_clock: trio.testing.MockClock) -> trio.testing.MockClock:
    autojump_clock.autojump_threshold = THREAD_GRACE_S
    return autojump_clock


CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "DELAY" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "VERSION" data_type: TYPE_INT32 dims: [ 1 ] }} ]
{extra}
"""

# Answers its version after sleeping (in trio) as long as the request asks.
SLEEPING_MODEL = """
import numpy as np
import trio
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "DELAY", "data_type": "TYPE_FP32", "dims": [1]})
        config.add_output({"name": "VERSION", "data_type": "TYPE_INT32", "dims": [1]})
        return config

    def initialize(self, args):
        self.version = int(args["model_version"])

    def execute(self, requests):
        responses = []
        for request in requests:
            delay = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()[0]
            trio.from_thread.run(trio.sleep, float(delay))
            version = np.array([self.version], np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("VERSION", version)]))
        return responses
"""


def add_model(root: Path, name: str, versions: list[int], extra: str = "") -> None:
    config = CONFIG.format(name=name, extra=extra)
    for version in versions:
        write_model(root, name, config, SLEEPING_MODEL, version=str(version))


async def infer(server: Server, name: str, delay: float = 0.0, version: str = "") -> int:
    """The version that answered a request to ``name`` that takes ``delay`` seconds."""
    data = np.array([delay], np.float32)
    inputs = {"DELAY": InputTensor("DELAY", datatype("FP32"), (1,), data)}
    request = InferenceRequest(name, version, inputs, [RequestedOutput("VERSION")])
    response = await server.repository.get(name, version).infer(request)
    return int(response.outputs[0].data[0])


def manager(server: Server) -> RepositoryManager:
    control = server.repository.control
    assert isinstance(control, RepositoryManager)
    return control


def states(server: Server) -> dict[str, list[tuple[str, str]]]:
    """name -> [(version, state)] from the repository index."""
    found: dict[str, list[tuple[str, str]]] = {}
    for entry in manager(server).index(ready_only=False):
        found.setdefault(entry["name"], []).append((entry["version"], entry["state"]))
    return found


async def start(nursery: trio.Nursery, root: Path, **settings: Any) -> Server:
    # No load timeout: while a model's import runs in its worker thread, autojump_clock
    # would jump straight to the load's deadline.
    config = ServerConfig(
        model_repositories=[root],
        http_port=None,
        grpc_port=None,
        model_load_timeout_s=0,
        **settings,
    )
    server: Server = await nursery.start(serve, config)
    return server


async def test_poll_mode_adds_changes_and_removes_models(
    nursery: trio.Nursery, tmp_path: Path, clock: trio.testing.MockClock
) -> None:
    add_model(tmp_path, "kept", [1])
    add_model(tmp_path, "changed", [1])
    server = await start(nursery, tmp_path, model_control_mode="poll", repository_poll_s=5.0)
    assert states(server) == {"changed": [("1", "READY")], "kept": [("1", "READY")]}
    add_model(tmp_path, "added", [1])
    add_model(tmp_path, "changed", [2])  # latest 1: version 2 replaces version 1
    began = trio.current_time()
    await manager(server).next_poll()
    assert trio.current_time() - began == 5.0
    assert states(server) == {
        "added": [("1", "READY")],
        "changed": [("2", "READY")],
        "kept": [("1", "READY")],
    }
    assert await infer(server, "changed") == 2
    shutil.rmtree(tmp_path / "added")
    await manager(server).next_poll()
    assert trio.current_time() - began == 10.0
    assert not server.repository.has("added")
    assert states(server)["kept"] == [("1", "READY")]
    with pytest.raises(NotFoundError):
        await infer(server, "added")


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        ("", ["3"]),
        ("version_policy: { latest: { num_versions: 2 } }", ["2", "3"]),
        ("version_policy: { all: {} }", ["1", "2", "3"]),
        ("version_policy: { specific: { versions: [ 1, 3 ] } }", ["1", "3"]),
    ],
)
async def test_version_policy_over_the_index_and_infer(
    nursery: trio.Nursery, tmp_path: Path, policy: str, served: list[str]
) -> None:
    add_model(tmp_path, "versions", [1, 2, 3], extra=policy)
    server = await start(nursery, tmp_path)
    assert states(server) == {"versions": [(v, "READY") for v in served]}
    for version in served:
        assert await infer(server, "versions", version=version) == int(version)
    assert await infer(server, "versions") == int(served[-1])  # no version: the latest
    for version in {"1", "2", "3"} - set(served):
        with pytest.raises(NotFoundError, match=f"version {version} is not found"):
            await infer(server, "versions", version=version)


@pytest.mark.parametrize("strict", [True, False])
async def test_strict_model_config_refuses_a_model_without_config(
    nursery: trio.Nursery, tmp_path: Path, strict: bool
) -> None:
    add_model(tmp_path, "configured", [1])
    add_model(tmp_path, "bare", [1])
    (tmp_path / "bare" / "config.pbtxt").unlink()
    server = await start(nursery, tmp_path, strict_model_config=strict)
    index = {e["name"]: e for e in manager(server).index(ready_only=False)}
    assert index["configured"]["state"] == "READY"
    if strict:
        assert index["bare"]["state"] == "UNAVAILABLE"
        assert "config.pbtxt: missing (--strict-model-config)" in index["bare"]["reason"]
    else:  # completed by the model's auto_complete_config
        assert index["bare"]["state"] == "READY"
        assert await infer(server, "bare") == 1


async def test_unload_lets_requests_in_flight_finish(
    nursery: trio.Nursery, tmp_path: Path, clock: trio.testing.MockClock
) -> None:
    add_model(tmp_path, "slow", [1])
    server = await start(nursery, tmp_path, model_control_mode="explicit", load_models=["slow"])
    began = trio.current_time()
    answers: list[tuple[int, float]] = []

    async def in_flight() -> None:
        answers.append((await infer(server, "slow", delay=10.0), trio.current_time() - began))

    nursery.start_soon(in_flight)
    await trio.sleep(1.0)
    await manager(server).unload("slow", unload_dependents=False)
    assert trio.current_time() - began == 10.0  # the unload waited for the request
    await trio.testing.wait_all_tasks_blocked()  # its caller resumes
    assert answers == [(1, 10.0)]  # answered, not failed
    assert not server.repository.model_ready("slow")
    with pytest.raises(NotFoundError):
        await infer(server, "slow")


async def test_reload_swaps_versions_without_failing_a_request_in_flight(
    nursery: trio.Nursery, tmp_path: Path, clock: trio.testing.MockClock
) -> None:
    add_model(tmp_path, "swapped", [1])
    server = await start(nursery, tmp_path, model_control_mode="explicit", load_models=["*"])
    began = trio.current_time()
    answers: list[tuple[int, float]] = []

    async def in_flight() -> None:
        answers.append((await infer(server, "swapped", delay=10.0), trio.current_time() - began))

    nursery.start_soon(in_flight)
    await trio.sleep(1.0)
    # Time stands still while version 2 loads (in worker threads), so version 1 still
    # holds the request when the versions swap.
    clock.autojump_threshold = math.inf
    add_model(tmp_path, "swapped", [2])
    nursery.start_soon(manager(server).load, "swapped", None, {})
    while states(server) != {"swapped": [("2", "READY")]}:
        await trio.testing.wait_all_tasks_blocked()
    assert answers == []
    assert await infer(server, "swapped") == 2  # new requests go to version 2 at once
    clock.autojump_threshold = THREAD_GRACE_S
    await trio.sleep(10.0)
    assert answers == [(1, 10.0)]  # version 1 answered what it had taken
