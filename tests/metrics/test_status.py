"""The status page's document: windowed rates and percentiles, generative figures, and
how long each model took to load. Traffic runs through real runners under MockClock."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import trio

from trioserve import (
    InferenceRequest,
    InputTensor,
    InternalError,
    Model,
    Server,
    ServerConfig,
    TensorSpec,
    serve,
)
from trioserve import model as declare_model
from trioserve._context import server_metadata
from trioserve._errors import InvalidArgumentError
from trioserve._served import ModelRepository
from trioserve._tensor import datatype
from trioserve.metrics._status import StatusReport, histogram_percentile
from trioserve.models import TinyLM
from trioserve.scheduler import GenerationRequest, SamplingParams
from trioserve.scheduler._generative_runner import GenerativeRunner
from trioserve.scheduler._runner import ModelRunner

MS = 1_000_000  # ns
BOUNDS = (1 * MS, 2 * MS, 5 * MS, 10 * MS)


@declare_model(
    name="sleepy",
    inputs=[TensorSpec("X", "FP32", [1])],
    outputs=[TensorSpec("Y", "FP32", [1])],
)
async def sleepy(X: Any) -> dict[str, Any]:
    """Sleeps X milliseconds; a negative X fails."""
    if (X < 0).any():
        raise ValueError("negative")
    await trio.sleep(float(X.max()) / 1000)
    return {"Y": X}


def request(milliseconds: float) -> InferenceRequest:
    data = np.full((1,), milliseconds, dtype=np.float32)
    return InferenceRequest("sleepy", "", {"X": InputTensor("X", datatype("FP32"), (1,), data)})


def test_histogram_percentile() -> None:
    assert histogram_percentile((10, 20), (0, 0, 0), 0.5) is None
    # Four in (10, 20]: the median is halfway through the bucket.
    assert histogram_percentile((10, 20), (0, 4, 0), 0.5) == 15
    # From zero within the first bucket.
    assert histogram_percentile((10, 20), (2, 0, 0), 0.5) == 5
    assert histogram_percentile((10, 20), (1, 1, 2), 0.25) == 10
    # Above every bound: the highest bound, as Prometheus answers.
    assert histogram_percentile((10, 20), (1, 1, 2), 0.99) == 20


async def test_rates_and_percentiles_over_the_window(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    runner = ModelRunner(sleepy, "1", histogram_bounds_ns=BOUNDS)
    repository = ModelRepository([runner])
    await nursery.start(repository.run)
    report = StatusReport(repository, server_metadata(), window_s=10)
    start = trio.current_time()
    first = report.document(start)
    assert first["server"] == {
        "name": "trioserve", "version": first["server"]["version"], "ready": True,
        "watched_seconds": 0.0,
    }  # fmt: skip
    (model,) = first["models"]
    assert (model["requests_per_second"], first["window_seconds"]) == (None, None)
    assert (model["kind"], model["state"], model["pending"]) == ("tensor", "READY", 0)
    assert model["latency_ms"] == {"p50": None, "p90": None, "p99": None}

    for _ in range(4):
        await runner.infer(request(3.0))  # four in (2, 5] ms
    with pytest.raises(InternalError, match="negative"):
        await runner.infer(request(-1.0))
    await trio.sleep_until(start + 2)
    document = report.document(trio.current_time())
    (model,) = document["models"]
    assert document["window_seconds"] == 2.0
    assert (model["success"], model["fail"]) == (4, 1)
    assert model["requests_per_second"] == 2.5  # five finished in two seconds
    assert model["failures_per_second"] == 0.5
    assert model["mean_latency_ms"] == pytest.approx(3.0, abs=1e-6)
    # Ranks 2, 3.6 and 3.96 of four in (2, 5]: 2 + 3 * rank / 4 ms.
    assert model["latency_ms"] == pytest.approx({"p50": 3.5, "p90": 4.7, "p99": 4.97})

    # Eleven seconds later the window holds the sample of second 2 only, and nothing
    # finished since: no rate, no percentile, the totals stay.
    await trio.sleep_until(start + 11)
    (model,) = report.document(trio.current_time())["models"]
    assert model["requests_per_second"] == 0.0
    assert model["latency_ms"] == {"p50": None, "p90": None, "p99": None}
    assert model["mean_latency_ms"] is None
    assert (model["success"], model["fail"]) == (4, 1)


async def test_generative_figures(nursery: trio.Nursery, autojump_clock: Any) -> None:
    lm = TinyLM(num_kv_blocks=64)
    runner = GenerativeRunner(lm, "1", seed=0)
    repository = ModelRepository([runner])
    await nursery.start(repository.run)
    report = StatusReport(repository, server_metadata())
    (idle,) = report.document(trio.current_time())["models"]
    assert idle["kind"] == "generative"
    assert idle["generative"] == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}

    sampling = SamplingParams(max_tokens=50, ignore_eos=True)
    async with runner.generate(
        GenerationRequest("a", "hello", sampling, trio.current_time())
    ) as chunks:
        await chunks.__anext__()  # its prompt is in the cache, and it is running
        (busy,) = report.document(trio.current_time())["models"]
        state = runner.kv_cache_state()
        assert busy["generative"] == {
            "running": 1, "waiting": 0, "kv_cache_usage": state.used_blocks / 64,
        }  # fmt: skip
        assert state.used_blocks > 0


class SlowLoading(Model):
    async def load(self) -> None:
        await trio.sleep(2.5)


async def test_loading_is_logged_and_timed(
    nursery: trio.Nursery, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    slow = SlowLoading(name="slow", inputs=[], outputs=[], versions=("1", "2"))
    repository = ModelRepository([ModelRunner(slow, "1"), ModelRunner(slow, "2")])
    with caplog.at_level(logging.INFO, logger="trioserve"):
        await nursery.start(repository.run)
    assert repository.load_seconds == {("slow", "1"): 2.5, ("slow", "2"): 2.5}
    assert [r.getMessage() for r in caplog.records] == [
        "loading model 'slow' version 1 (1 of 2)",
        "loaded model 'slow' version 1 in 2.50 s",
        "loading model 'slow' version 2 (2 of 2)",
        "loaded model 'slow' version 2 in 2.50 s",
    ]
    (first, _) = StatusReport(repository, server_metadata()).document(0.0)["models"]
    assert first["load_seconds"] == 2.5


class FailsToLoad(Model):
    async def load(self) -> None:
        await trio.sleep(0.5)
        raise RuntimeError("weights are missing")


async def test_loading_and_failed_models(nursery: trio.Nursery, autojump_clock: Any) -> None:
    slow = SlowLoading(name="slow", inputs=[], outputs=[])
    broken = FailsToLoad(name="broken", inputs=[], outputs=[])
    config = ServerConfig(
        http_port=None, grpc_port=None, models=[slow, broken], model_control_mode="explicit"
    )
    server: Server = await nursery.start(serve, config)
    control = server.repository.control
    assert control is not None
    report = StatusReport(server.repository, server_metadata())

    def rows() -> list[tuple[Any, ...]]:
        document = report.document(trio.current_time())
        keys = ("name", "version", "state", "reason", "loading_seconds", "load_seconds")
        return [tuple(model[key] for key in keys) for model in document["models"]]

    # Found, not loaded: listed as the repository index lists them.
    assert rows() == [("broken", "", "", "", None, None), ("slow", "", "", "", None, None)]
    nursery.start_soon(control.load, "slow", None, {})
    await trio.sleep(1)
    assert rows() == [
        ("slow", "1", "LOADING", "", 1.0, None), ("broken", "", "", "", None, None),
    ]  # fmt: skip
    assert ("slow", "", "LOADING", "") in [tuple(e.values()) for e in control.index(False)]
    await trio.sleep(1.5)
    with pytest.raises(InvalidArgumentError, match="weights are missing"):
        await control.load("broken", None, {})
    assert rows() == [
        ("slow", "1", "READY", "", None, 2.5),
        ("broken", "", "UNAVAILABLE", "RuntimeError: weights are missing", None, None),
    ]
    served, failed = report.document(trio.current_time())["models"]
    assert served["success"] == 0 and failed["success"] is None  # no figures without a runner
