"""What an execution of a batch gave the runner (``_runner.py``), and the checks and clock
its worker thread uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import trio

from .._errors import InferenceServerError, InternalError
from .._model import Result
from .._stats import ExecutionTimes
from .._types import InferenceResponse
from ._ticket import Ticket


class Executed(NamedTuple):
    """An executed batch: its times and responses, or the error that failed it whole."""

    batch: list[Ticket]
    times: ExecutionTimes | None = None
    responses: list[InferenceResponse | InferenceServerError] | None = None
    error: InferenceServerError | None = None


def check_count(results: Sequence[Result], requests: Sequence[object]) -> None:
    if len(results) != len(requests):
        raise InternalError(f"model returned {len(results)} results for {len(requests)} requests")


def thread_clock() -> Callable[[], int]:
    """``now_ns`` for a worker thread, which cannot ask trio: the run's clock itself."""
    clock = trio.lowlevel.current_clock()
    return lambda: round(clock.current_time() * 1e9)
