"""What a trace records, read back from Triton's JSON trace file: exact timestamps under
the mock clock for a batched request, a queued one and an ensemble's steps (children
linked by parent_id), tensors at the TENSORS level, rotation with log_frequency, and a
server that traces nothing writing nothing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import trio
from google.protobuf import text_format

from trioserve import (
    DynamicBatching,
    InferenceRequest,
    InputTensor,
    Model,
    ServerConfig,
    TensorSpec,
    model,
)
from trioserve._context import server_context
from trioserve._inprocess import InProcessFrontEnd
from trioserve._served import ModelRepository, ServedModel
from trioserve._tensor import datatype
from trioserve.repository._config import complete_config, model_settings
from trioserve.repository._ensemble import EnsembleModel, ensemble_steps
from trioserve.repository._generated.model_config_pb2 import ModelConfig
from trioserve.scheduler._decoupled_runner import DecoupledRunner
from trioserve.scheduler._runner import ModelRunner
from trioserve.tracing import TraceConfig

MS = 1_000_000  # ns
SPEC = [TensorSpec("X", "INT32", [1])]


def x(value: int) -> dict[str, Any]:
    return {"X": np.array([[value]], np.int32)}


OUT = [TensorSpec("Y", "INT32", [1])]


def slow_model(name: str, factor: int, **settings: Any) -> ModelRunner:
    """Y = X * factor, 10 ms per execution."""

    @model(name=name, inputs=SPEC, outputs=OUT, max_batch_size=4, **settings)
    async def run(X: np.ndarray[Any, Any]) -> dict[str, Any]:
        await trio.sleep(0.010)
        return {"Y": X * factor}

    return ModelRunner(run, "1")


@asynccontextmanager
async def serving(
    served: Sequence[ServedModel], trace: TraceConfig
) -> AsyncIterator[InProcessFrontEnd]:
    """The in-process front end over ``served``; the trace file is written on the way out."""
    repository = ModelRepository(served)
    config = ServerConfig(http_port=None, grpc_port=None, trace=trace)
    context = server_context(config, repository)
    async with trio.open_nursery() as nursery:
        await nursery.start(context.tracing.run)
        await nursery.start(repository.run)
        yield InProcessFrontEnd(context)
        nursery.cancel_scope.cancel()


def traces(path: Path) -> dict[str, dict[str, Any]]:
    """The file's traces by request id: the trace's record, with its timestamps (ns from
    the first REQUEST_START in the file, in ms) and tensors."""
    records = json.loads(path.read_text())
    by_id: dict[int, dict[str, Any]] = {}
    for record in records:
        trace = by_id.setdefault(record["id"], {"tensors": []})
        if "timestamps" in record:
            trace["timestamps"] = [(t["name"], t["ns"]) for t in record["timestamps"]]
        elif "tensor" in record:
            trace["tensors"].append((record["activity"], record["tensor"]))
        else:
            trace.update(record)
    start = min(ns for t in by_id.values() for _, ns in t["timestamps"])
    for trace in by_id.values():
        trace["ms"] = [(name, (ns - start) / MS) for name, ns in trace["timestamps"]]
    return {f"{t['model_name']}:{t['request_id']}": t for t in by_id.values()}


def compute(start: float, end: float) -> list[tuple[str, float]]:
    return [
        ("COMPUTE_START", start),
        ("COMPUTE_INPUT_END", start),
        ("COMPUTE_OUTPUT_START", end),
        ("COMPUTE_END", end),
    ]


async def test_a_batched_and_a_queued_request(autojump_clock: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    batching = DynamicBatching(max_queue_delay_microseconds=5000)
    runner = slow_model("batcher", 2, dynamic_batching=batching)
    config = TraceConfig(level=("TIMESTAMPS",), rate=1, file=str(path))
    async with serving([runner], config) as front, trio.open_nursery() as clients:
        for request_id in ("a", "b"):  # batched together after the 5 ms queue delay
            clients.start_soon(lambda r=request_id: front.infer("batcher", x(1), request_id=r))
        await trio.sleep(0.006)
        # The instance runs a and b until 15 ms: c waits for it.
        clients.start_soon(lambda: front.infer("batcher", x(1), request_id="c"))
    found = traces(path)
    assert set(found) == {"batcher:a", "batcher:b", "batcher:c"}
    for request_id in ("a", "b"):
        assert found[f"batcher:{request_id}"]["ms"] == [
            ("REQUEST_START", 0.0),
            ("QUEUE_START", 0.0),
            *compute(5.0, 15.0),
            ("REQUEST_END", 15.0),
        ]
    queued = found["batcher:c"]
    assert queued["ms"] == [
        ("REQUEST_START", 6.0),
        ("QUEUE_START", 6.0),
        *compute(15.0, 25.0),
        ("REQUEST_END", 25.0),
    ]
    assert queued["model_version"] == 1 and "parent_id" not in queued  # a root, as Triton writes it
    assert queued["tensors"] == []  # TIMESTAMPS only


CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "double" input_map { key: "X" value: "IN" } output_map { key: "Y" value: "twice" } },
    { model_name: "triple" input_map { key: "X" value: "twice" } output_map { key: "Y" value: "OUT" } }
  ]
}
"""


def chain(folder: Path, repository: ModelRepository) -> ModelRunner:
    config = text_format.Parse(CHAIN, ModelConfig())
    (folder / "chain").mkdir()
    complete_config(config, folder / "chain")
    del config.instance_group[:]
    ensemble = EnsembleModel(
        ensemble_steps(config, folder), config, 1, repository, {}, **model_settings(config, folder)
    )
    return ModelRunner(ensemble, "1")


async def test_an_ensembles_steps_are_traced_under_it(autojump_clock: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    steps = [slow_model("double", 2), slow_model("triple", 3)]
    repository = ModelRepository(steps)
    ensemble = chain(tmp_path, repository)
    config = TraceConfig(level=("TIMESTAMPS", "TENSORS"), rate=1, file=str(path))
    async with trio.open_nursery() as nursery:
        await nursery.start(repository.run)
        async with serving([ensemble], config) as front:
            response = await front.infer("chain", {"IN": np.array([[7]], np.int32)}, request_id="r")
            assert response.as_numpy("OUT").tolist() == [[42]]
        nursery.cancel_scope.cancel()
    found = traces(path)
    parent, double, triple = found["chain:r"], found["double:r"], found["triple:r"]
    assert "parent_id" not in parent
    assert double["parent_id"] == triple["parent_id"] == parent["id"]
    assert parent["ms"] == [
        ("REQUEST_START", 0.0),
        ("QUEUE_START", 0.0),
        *compute(0.0, 20.0),
        ("REQUEST_END", 20.0),
    ]
    for step, start in ((double, 0.0), (triple, 10.0)):
        assert step["ms"] == [
            ("REQUEST_START", start),
            ("QUEUE_START", start),
            *compute(start, start + 10),
            ("REQUEST_END", start + 10),
        ]
    tensor = {"shape": "1,1", "dtype": "INT32"}
    assert parent["tensors"] == [
        ("TENSOR_QUEUE_INPUT", {"name": "IN", "data": "7", **tensor}),
        ("TENSOR_BACKEND_OUTPUT", {"name": "OUT", "data": "42", **tensor}),
    ]
    assert double["tensors"] == [
        ("TENSOR_QUEUE_INPUT", {"name": "X", "data": "7", **tensor}),
        ("TENSOR_BACKEND_OUTPUT", {"name": "Y", "data": "14", **tensor}),
    ]


class Counter(Model):
    """Decoupled: answers I = 0 .. N-1, one every 10 ms, then the final flag alone."""

    def __init__(self) -> None:
        super().__init__(name="counter", inputs=SPEC, outputs=[TensorSpec("I", "INT32", [1])],
                         decoupled=True)  # fmt: skip

    async def execute(self, requests: Sequence[InferenceRequest]) -> None:
        for request in requests:
            sender = request.response_sender
            assert sender is not None
            for i in range(int(request.inputs["X"].data[0])):
                await trio.sleep(0.010)
                sender.send({"I": np.array([i], np.int32)})
            sender.send(final=True)


async def test_a_decoupled_request_is_traced_to_its_last_response(
    autojump_clock: Any, tmp_path: Path
) -> None:
    path = tmp_path / "trace.json"
    config = TraceConfig(level=("TIMESTAMPS", "TENSORS"), rate=1, file=str(path))
    runner = DecoupledRunner(Counter(), "1")
    async with serving([runner], config) as front:
        data = np.array([2], np.int32)
        request = InferenceRequest(
            "counter", "", {"X": InputTensor("X", datatype("INT32"), (1,), data)}, id="d"
        )
        delivered: list[bool] = []

        async def deliver(answer: Any, final: bool) -> None:
            delivered.append(final)

        pipeline = front._context.pipeline
        await pipeline.infer_decoupled(runner, lambda regions: request, deliver)
    assert delivered == [False, False, True]
    traced = traces(path)["counter:d"]
    assert traced["ms"] == [
        ("REQUEST_START", 0.0),
        ("QUEUE_START", 0.0),
        *compute(0.0, 20.0),
        ("REQUEST_END", 20.0),
    ]
    tensor = {"shape": "1", "dtype": "INT32"}
    assert traced["tensors"] == [
        ("TENSOR_QUEUE_INPUT", {"name": "X", "data": "2", **tensor}),
        ("TENSOR_BACKEND_OUTPUT", {"name": "I", "data": "0", **tensor}),
        ("TENSOR_BACKEND_OUTPUT", {"name": "I", "data": "1", **tensor}),
    ]


async def test_log_frequency_rotates_the_file(autojump_clock: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    config = TraceConfig(level=("TIMESTAMPS",), rate=2, file=str(path), log_frequency=2)
    async with serving([slow_model("double", 2)], config) as front:
        for index in range(10):  # one in two traced: five traces
            await front.infer("double", x(index), request_id=str(index))
    files = sorted(p.name for p in tmp_path.iterdir())  # noqa: ASYNC240 - the server is gone
    assert files == ["trace.json.0", "trace.json.1", "trace.json.2"]
    requests = [sorted(traces(tmp_path / name)) for name in files]
    assert requests == [["double:1", "double:3"], ["double:5", "double:7"], ["double:9"]]


async def test_trace_count_stops_tracing(autojump_clock: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    config = TraceConfig(level=("TIMESTAMPS",), rate=1, count=2, file=str(path))
    async with serving([slow_model("double", 2)], config) as front:
        for index in range(4):
            await front.infer("double", x(index), request_id=str(index))
        assert front._context.tracing.settings()["trace_count"] == "0"
    assert sorted(traces(path)) == ["double:0", "double:1"]


async def test_nothing_is_written_when_tracing_is_off(autojump_clock: Any, tmp_path: Path) -> None:
    config = TraceConfig(level=("OFF",), rate=1, file=str(tmp_path / "trace.json"))
    async with serving([slow_model("double", 2)], config) as front:
        assert not front._context.tracing.active
        await front.infer("double", x(1))
        # A model turned on alone is traced; the others are not.
        front._context.tracing.update("double", {"trace_level": ["TIMESTAMPS"]})
        await front.infer("double", x(1), request_id="on")
    assert sorted(traces(tmp_path / "trace.json")) == ["double:on"]
