"""What an execution of a batch gave the runner (``_runner.py``), made of the model's
results; a sync model's worker thread, which runs the batches prefetched for it back to
back (``execute_chain``), and the checks and clock it uses."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import trio

from .._errors import InferenceServerError, InternalError
from .._model import Model, Result
from .._model_code import model_failure
from .._stats import ExecutionTimes
from .._types import InferenceRequest, InferenceResponse
from ._responses import response_of
from ._ticket import REQUEST, Ticket, model_error


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


def executed_batch(
    model: Model,
    version: str,
    batch: list[Ticket],
    dequeued_ns: int,
    input_ready_ns: int,
    results: Sequence[Result],
    now: Callable[[], int],
) -> Executed:
    """The batch's responses (or each one's error) and its execution times."""
    executed_ns = now()
    responses = [
        _response_or_error(model, version, ticket.request, result)
        for ticket, result in zip(batch, results, strict=True)
    ]
    times = ExecutionTimes(dequeued_ns, input_ready_ns, executed_ns, now())
    return Executed(batch, times, responses)


def _response_or_error(
    model: Model, version: str, request: InferenceRequest, result: Result
) -> InferenceResponse | InferenceServerError:
    """A result whose outputs do not fit the model's config fails its own request only,
    not the others of its batch."""
    if isinstance(result, InferenceServerError):
        return result
    try:
        return response_of(model, version, request, result)
    except Exception as exc:
        return model_error(model.name, exc)


def execute_chain(
    model: Model,
    version: str,
    prefetched: deque[list[Ticket]],
    complete_soon: Callable[[Executed], object],
    batch: list[Ticket],
    dequeued_ns: int,
    now: Callable[[], int],
    token: trio.lowlevel.TrioToken,
) -> Executed:
    """In a worker thread: execute ``batch``, then each batch prefetched meanwhile, back
    to back; every outcome but the last is completed by the event loop as soon as it can
    (``complete_soon``), the last by the instance's task (the return value).

    Taking the next batch here, not from the instance's task, is what keeps a busy model
    busy under overload: the task would resume only after two turns of the event loop,
    each as long as it takes to answer every ready connection.
    """
    while True:
        input_ready_ns = now()
        try:
            results = cast(Sequence[Result], model.execute(list(map(REQUEST, batch))))
            check_count(results, batch)
            executed = executed_batch(
                model, version, batch, dequeued_ns, input_ready_ns, results, now
            )
        except BaseException as exc:  # in a worker thread: always the model's
            failure = model_failure(exc, model.name, "in execute")
            executed = Executed(batch, error=model_error(model.name, failure))
        try:
            batch = prefetched.popleft()
        except IndexError:
            return executed
        dequeued_ns = now()
        token.run_sync_soon(complete_soon, executed)
