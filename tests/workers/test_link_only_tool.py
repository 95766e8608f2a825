"""``tools/link_only_core.py`` (``workers_bench.py --link-only``): its core answers a
worker's inferences with their inputs, without the pipeline, over HTTP and gRPC, and
refuses a large tensor without keeping the worker's memory."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from ._served import Served

TOOL = Path(__file__).resolve().parents[2] / "tools" / "link_only_core.py"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    # A small arena: a large input that the core kept would soon leave no room.
    server = Served("--worker-arena-max-bytes", str(256 * 1024), workers=1, server=(str(TOOL),))
    try:
        yield server
    finally:
        server.stop()


def _infer(client: Any, module: Any, rows: int) -> Any:
    first = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)
    inputs = [module.InferInput(f"INPUT{i}", [rows, 16], "INT32") for i in (0, 1)]
    inputs[0].set_data_from_numpy(first)
    inputs[1].set_data_from_numpy(first * 3)
    return client.infer("simple", inputs)


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_the_core_answers_with_the_inputs_and_refuses_large_ones(
    served: Served, module: Any
) -> None:
    url = served.url if module is httpclient else served.grpc_url
    client = module.InferenceServerClient(url)
    try:
        result = _infer(client, module, 1)
        # Not the sums a model would give: the inputs as they came.
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(16).reshape(1, 16))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.arange(16).reshape(1, 16) * 3)
        for _ in range(8):  # 64 KiB each: a block in the worker's 256 KiB arena
            with pytest.raises(InferenceServerException, match="small tensors only"):
                _infer(client, module, 1024)
        assert _infer(client, module, 2).as_numpy("OUTPUT0").shape == (2, 16)
    finally:
        client.close()


def test_inferences_sent_together_are_answered_with_their_inputs_too(served: Served) -> None:
    """Many in flight at once reach the core in shared frames, alike ones merged into
    INFERS: this core answers those at once too, each call with its own inputs."""
    count = 64
    answers: dict[int, Any] = {}
    answered = threading.Condition()

    def note(number: int, result: Any, error: Any) -> None:
        with answered:
            answers[number] = error if error is not None else result.as_numpy("OUTPUT0")
            answered.notify()

    with grpcclient.InferenceServerClient(served.grpc_url) as client:
        for number in range(count):
            inputs = [grpcclient.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in (0, 1)]
            for tensor in inputs:
                tensor.set_data_from_numpy(np.full((1, 16), number, np.int32))
            client.async_infer("simple", inputs, partial(note, number))
        with answered:
            assert answered.wait_for(lambda: len(answers) == count, timeout=60)
    for number, output in answers.items():
        np.testing.assert_array_equal(output, np.full((1, 16), number))  # not the sum
