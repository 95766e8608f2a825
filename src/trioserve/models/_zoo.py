"""The reference zoo: the example models ``trioserve run`` serves without a repository.

Tests, examples and benchmarks use these names; each is version "1", one CPU instance.
The arithmetic models are ``async def``: their work takes far less time than a hop to a
worker thread, so they run in trio (a model with real compute should be a plain function,
which runs in a thread).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from .._errors import InvalidArgumentError
from .._model import DynamicBatching, Model, TensorSpec, model

Array = np.ndarray[Any, Any]


def _pair(datatype: str, dims: list[int], prefix: str) -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}{i}", datatype, dims) for i in (0, 1)]


@model(
    name="simple",
    inputs=_pair("INT32", [16], "INPUT"),
    outputs=_pair("INT32", [16], "OUTPUT"),
    max_batch_size=8,
    dynamic_batching=DynamicBatching(),
)
async def simple(INPUT0: Array, INPUT1: Array) -> dict[str, Array]:
    return {"OUTPUT0": INPUT0 + INPUT1, "OUTPUT1": INPUT0 - INPUT1}


def _decimal(array: Array, name: str) -> Array:
    try:
        return np.array([int(x) for x in array.reshape(-1)], dtype=np.int64).reshape(array.shape)
    except ValueError:
        raise InvalidArgumentError(f"{name} must hold decimal integers") from None


def _text(array: Array) -> Array:
    out = np.empty(array.shape, dtype=object)
    out.reshape(-1)[:] = [str(x).encode() for x in array.reshape(-1)]
    return out


@model(
    name="simple_string",
    inputs=_pair("BYTES", [16], "INPUT"),
    outputs=_pair("BYTES", [16], "OUTPUT"),
    max_batch_size=8,
    dynamic_batching=DynamicBatching(),
)
async def simple_string(INPUT0: Array, INPUT1: Array) -> dict[str, Array]:
    a, b = _decimal(INPUT0, "INPUT0"), _decimal(INPUT1, "INPUT1")
    return {"OUTPUT0": _text(a + b), "OUTPUT1": _text(a - b)}


def _identity(name: str, datatype: str) -> Model:
    async def identity(INPUT0: Array) -> dict[str, Array]:
        return {"OUTPUT0": INPUT0}

    return model(
        name=name,
        inputs=[TensorSpec("INPUT0", datatype, [-1])],
        outputs=[TensorSpec("OUTPUT0", datatype, [-1])],
    )(identity)


@model(
    name="delay",
    inputs=[TensorSpec("INPUT0", "FP32", [1])],
    outputs=[TensorSpec("OUTPUT0", "FP32", [1])],
    max_batch_size=8,
    dynamic_batching=DynamicBatching(max_queue_delay_microseconds=2000),
)
async def delay(INPUT0: Array) -> dict[str, Array]:
    # One sleep for the whole batch, in trio, so the event loop stays free.
    await trio.sleep(float(INPUT0.max(initial=0.0)) / 1000)
    return {"OUTPUT0": INPUT0}


@model(
    name="fail",
    inputs=[TensorSpec("INPUT0", "INT32", [1])],
    outputs=[TensorSpec("OUTPUT0", "INT32", [1])],
)
def fail(INPUT0: Array) -> dict[str, Array]:
    raise RuntimeError("the 'fail' model always fails")


def reference_zoo() -> list[Model]:
    """The zoo. Its models hold no state (runners do), so servers may share them."""
    return [
        simple,
        simple_string,
        _identity("identity_fp32", "FP32"),
        _identity("identity_bytes", "BYTES"),
        delay,
        fail,
    ]
