"""trioserve.testing: a server for in-process tests, timed models and the generative
fake, all exact under the mock clock."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import trioserve
from trioserve import DynamicBatching, InferenceRequest, MemoryUsage, TensorSpec
from trioserve.models import reference_zoo
from trioserve.testing import (
    ExecutedStep,
    TimedLM,
    TimedModel,
    batch_size_counts,
    gated,
    model_statistics,
    open_test_server,
    timed,
)

from ._model_repository import write_model


def zoo(name: str) -> trioserve.Model:
    return next(m for m in reference_zoo() if m.name == name)


class Hooked(trioserve.Model):
    """A subclassed model with plain hooks, to check that ``timed`` keeps them."""

    def __init__(self) -> None:
        super().__init__(
            name="hooked",
            inputs=[TensorSpec("X", "INT32", [2])],
            outputs=[TensorSpec("Y", "INT32", [2])],
            max_batch_size=8,
            dynamic_batching=DynamicBatching(max_queue_delay_microseconds=1000),
            versions=("1", "2"),
        )
        self.calls: list[str] = []

    def load(self) -> None:
        self.calls.append("load")

    def unload(self) -> None:
        self.calls.append("unload")

    def memory_usage(self) -> Sequence[MemoryUsage]:
        return [MemoryUsage("CPU", 0, 1024)]

    def execute(self, requests: Sequence[InferenceRequest]) -> list[dict[str, Any]]:
        return [{"Y": r.inputs["X"].data * 10} for r in requests]


async def test_cost_as_a_function_of_the_batch_size(autojump_clock: Any) -> None:
    hooked = Hooked()
    model = timed(hooked, lambda size: 0.001 * size)
    assert isinstance(model, TimedModel) and model.versions == ("1", "2")
    async with open_test_server([model]) as server:
        assert (server.http_port, server.grpc_port, server.http_addresses) == (None, None, [])
        assert hooked.calls == ["load", "load"]  # one per version
        start = trio.current_time()

        async def send(batch: int, request_id: str) -> None:
            x = np.arange(2 * batch, dtype=np.int32).reshape(batch, 2)
            response = await server.infer("hooked", {"X": x}, request_id=request_id)
            np.testing.assert_array_equal(response.as_numpy("Y"), x * 10)

        async with trio.open_nursery() as clients:
            clients.start_soon(send, 3, "a")
            clients.start_soon(send, 2, "b")
        [execution] = model.executions
        assert sorted(execution.request_ids) == ["a", "b"]
        assert sorted(execution.request_sizes) == [2, 3]
        # Both waited out the 1 ms queue delay, then five elements took 5 ms.
        times = (execution.started - start, execution.finished - start)
        assert times == pytest.approx((0.001, 0.006))
        await send(1, "c")
        assert model.batch_sizes == [5, 1]
        assert batch_size_counts(server, "hooked") == {5: 1, 1: 1}
        assert batch_size_counts(server, "hooked", version=1) == {}
        stats = model_statistics(server, "hooked", version="2")
        assert (stats.version, stats.inference_count, stats.execution_count) == ("2", 6, 2)
        assert stats.queue.ns == 2 * 1_000_000 + 1_000_000
        assert stats.compute_infer.ns == 5_000_000 * 2 + 1_000_000  # a batch's time, per request
        assert stats.memory_usage == (MemoryUsage("CPU", 0, 1024),)
    assert hooked.calls == ["load", "load", "unload", "unload"]


async def test_timed_async_models_and_failures(autojump_clock: Any) -> None:
    simple = timed(zoo("simple"), 0.25)
    async with open_test_server([simple, timed(zoo("fail"), 0.5)]) as server:
        x = np.ones((1, 16), np.int32)
        start = trio.current_time()
        response = await server.infer("simple", {"INPUT0": x, "INPUT1": x})
        assert response.as_numpy("OUTPUT0").tolist() == [[2] * 16]
        assert trio.current_time() - start == 0.25
        with pytest.raises(trioserve.InternalError, match="fail"):
            await server.infer("fail", {"INPUT0": np.zeros(1, np.int32)})
        assert trio.current_time() - start == 0.25  # it failed before its time ran
        stats = model_statistics(server, "fail")
        assert (stats.fail.count, stats.execution_count) == (1, 0)


def test_timed_refuses_what_it_cannot_time() -> None:
    with pytest.raises(TypeError, match="TimedLM"):
        timed(TimedLM(), 1.0)
    with pytest.raises(ValueError, match="negative"):
        timed(zoo("simple"), -1.0)
    with pytest.raises(ValueError, match="negative"):
        TimedLM(step_cost=-0.5)


async def test_a_negative_cost_fails_the_batch(autojump_clock: Any) -> None:
    async with open_test_server([timed(zoo("simple"), lambda size: -1.0)]) as server:
        x = np.ones((1, 16), np.int32)
        with pytest.raises(trioserve.InternalError, match="negative"):
            await server.infer("simple", {"INPUT0": x, "INPUT1": x})


async def test_concurrent_generations_share_steps(autojump_clock: Any) -> None:
    lm = TimedLM("lm", step_cost=lambda batch: 0.002 * len(batch))
    async with open_test_server([lm]) as server:
        start = trio.current_time()
        times: dict[str, list[float]] = {}
        texts: dict[str, str] = {}

        async def generate(prompt: str, sampling: dict[str, Any]) -> None:
            times[prompt] = []
            texts[prompt] = ""
            async for piece in server.generate("lm", prompt, **sampling):
                texts[prompt] += piece
                times[prompt].append(trio.current_time() - start)

        async with trio.open_nursery() as clients:
            clients.start_soon(generate, "a", {"max_tokens": 3})
            clients.start_soon(generate, "v", {"temperature": 1.7})  # the text leaves no choice
    assert texts == {"a": "bcd", "v": "wxyz"}
    # Every step ran both sequences (4 ms) until "a" ended after its third token.
    assert times["a"] == pytest.approx([0.004, 0.008, 0.012])
    assert times["v"] == pytest.approx([0.004, 0.008, 0.012, 0.014])
    last = lm.steps[-1]
    assert isinstance(last, ExecutedStep)
    assert (last.started - start, last.finished - start) == pytest.approx((0.014, 0.016))
    # "v" ran alone once "a" ended, and its end of sequence took a step of its own.
    assert [s.tokens for s in lm.steps] == [(1, 1), (1, 1), (1, 1), (1,), (1,)]


async def test_test_server_settings_reach_the_config(autojump_clock: Any) -> None:
    async with open_test_server([zoo("simple")], response_cache_bytes=1 << 16) as server:
        assert server.config.response_cache_bytes == 1 << 16
        assert server.config.http_port is None and server.config.grpc_port is None


_SLOW_INITIALIZE = """
import time

class TritonPythonModel:
    def initialize(self, args):
        time.sleep(0.05)  # real work in the load's worker thread

    def execute(self, requests):
        raise NotImplementedError
"""


async def test_repository_loads_under_the_jumping_clock(
    autojump_clock: Any, tmp_path: Path
) -> None:
    """A load takes real time in its worker thread while the mock clock jumps: a load
    time limit on that clock would run out at once, so the test server sets none."""
    config = (
        'backend: "python"\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    write_model(tmp_path, "slow", config, _SLOW_INITIALIZE)
    async with open_test_server([], model_repositories=[tmp_path]) as server:
        assert server.config.model_load_timeout_s == 0
        assert server.repository.model_ready("slow", "")


async def test_engine_sizes_reach_the_fake(autojump_clock: Any) -> None:
    lm = TimedLM(step_cost=0.001, max_num_seqs=1)  # one sequence at a time
    async with open_test_server([lm]) as server:
        start = trio.current_time()
        finished: dict[str, float] = {}

        async def generate(prompt: str) -> None:
            async for _ in server.generate("timed_lm", prompt, max_tokens=2):
                pass
            finished[prompt] = trio.current_time() - start

        async with trio.open_nursery() as clients:
            clients.start_soon(generate, "a")
            await trio.sleep(0.0001)  # "a" arrives first
            clients.start_soon(generate, "k")
    assert finished == pytest.approx({"a": 0.002, "k": 0.004})
    assert [s.tokens for s in lm.steps] == [(1,)] * 4


async def test_a_gated_model_holds_executions_until_released(autojump_clock: Any) -> None:
    model = gated(zoo("simple"))
    assert (model.name, model.inputs, model.max_batch_size) == (
        "simple",
        zoo("simple").inputs,
        zoo("simple").max_batch_size,
    )
    inputs = {"INPUT0": np.ones((1, 16), np.int32), "INPUT1": np.ones((1, 16), np.int32)}
    answers: list[Any] = []
    async with open_test_server([model]) as server:
        async with trio.open_nursery() as nursery:

            async def infer() -> None:
                answers.append(await server.infer("simple", inputs))

            nursery.start_soon(infer)
            await model.entered.wait()
            await trio.sleep(3600)  # held, whatever the time
            assert (model.waiting, answers) == (1, [])
            model.release.set()
        assert model.waiting == 0
        assert answers[0].outputs[0].data.tolist() == [[2] * 16]
        assert model_statistics(server, "simple").success.count == 1


def test_a_generative_model_cannot_be_gated() -> None:
    with pytest.raises(TypeError, match="steps"):
        gated(TimedLM(step_cost=0.01))
