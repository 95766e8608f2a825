"""The models, clients and helpers of the gRPC service tests (fixtures: ``conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import grpc
import numpy as np
import pytest
import trio
import trio.testing
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import trioserve
from trioserve import (
    DynamicBatching,
    InferenceRequest,
    Model,
    Server,
    TensorSpec,
)

# Every datatype of the protocol, each as an optional input echoed to its output.
DATATYPES = [
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BF16", "BYTES",
]  # fmt: skip

_MAX = 2**31 - 1  # tritonclient's own message limit
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX),
    ("grpc.max_receive_message_length", _MAX),
]


def all_types_model() -> Model:
    @trioserve.model(
        name="all_types",
        inputs=[TensorSpec(f"IN_{dt}", dt, [-1], optional=True) for dt in DATATYPES],
        outputs=[TensorSpec(f"OUT_{dt}", dt, [-1]) for dt in DATATYPES],
    )
    def all_types(**inputs: Any) -> dict[str, Any]:
        return {f"OUT_{name[3:]}": array for name, array in inputs.items()}

    return all_types


class Gate:
    """The ``gated`` model: it records each batch, and the first one waits for ``release``.

    With one instance busy on that first batch, later requests wait in the queue, where
    a test can cancel them and watch them leave.
    """

    def __init__(self) -> None:
        self.entered = trio.Event()
        self.release = trio.Event()
        self.batches: list[list[float]] = []

    def model(self) -> Model:
        @trioserve.model(
            name="gated",
            inputs=[TensorSpec("INPUT0", "FP32", [1])],
            outputs=[TensorSpec("OUTPUT0", "FP32", [1])],
            max_batch_size=8,
            dynamic_batching=DynamicBatching(),
        )
        async def gated(INPUT0: np.ndarray[Any, Any]) -> dict[str, Any]:
            self.batches.append(INPUT0.reshape(-1).tolist())
            self.entered.set()
            await self.release.wait()
            return {"OUTPUT0": INPUT0}

        return gated


class Recorder(Model):
    """Echoes INPUT0 and keeps every request it executed, parameters included."""

    def __init__(self) -> None:
        super().__init__(
            name="recorder",
            inputs=[TensorSpec("INPUT0", "INT32", [1])],
            outputs=[TensorSpec("OUTPUT0", "INT32", [1])],
        )
        self.requests: list[InferenceRequest] = []

    def execute(self, requests: Sequence[InferenceRequest]) -> list[dict[str, Any]]:
        self.requests.extend(requests)
        return [{"OUTPUT0": r.inputs["INPUT0"].data} for r in requests]


TIMEOUT = 20  # seconds; generous for a loaded machine, still fails a hung test

Client = grpcclient.InferenceServerClient


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a blocking client call in a thread; abandoned if the test times out."""
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs), abandon_on_cancel=True)


async def expect_error(status: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Call, expect tritonclient's exception with ``status``; return its message."""
    with pytest.raises(InferenceServerException) as info:
        await call(fn, *args, **kwargs)
    assert info.value.status() == f"StatusCode.{status}", info.value
    return str(info.value.message())


async def expect_rpc_error(status: grpc.StatusCode, fn: Callable[..., Any], *args: Any) -> str:
    with pytest.raises(grpc.RpcError) as info:
        await call(fn, *args)
    assert info.value.code() == status, info.value.details()
    return str(info.value.details())


async def wait_queued(server: Server, model: str, count: int) -> None:
    await server.repository.get(model).wait_until(lambda stats: stats.queued == count)  # type: ignore[attr-defined]


def infer_input(name: str, array: np.ndarray[Any, Any], datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def simple_inputs(rows: int) -> tuple[list[grpcclient.InferInput], np.ndarray[Any, Any]]:
    a = np.arange(16 * rows, dtype=np.int32).reshape(rows, 16)
    return [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", a * 3, "INT32")], a


def gated_input(value: float) -> list[grpcclient.InferInput]:
    return [infer_input("INPUT0", np.array([[value]], dtype=np.float32), "FP32")]
