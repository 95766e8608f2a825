"""A request's way through a runner: its ticket, the messages the batcher gets about it,
and the errors it may end with."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

import trio

from .._errors import CancelledError, InferenceServerError, InternalError, UnavailableError
from .._model_code import failure_message
from .._served import Answer, raise_handed_over
from .._stats import ExecutionTimes
from .._types import InferenceRequest, InferenceResponse
from ._batching import QueuedItem
from ._decoupled import DecoupledResponses

logger = logging.getLogger("trioserve.scheduler")


class _Runner(Protocol):
    def withdraw(self, ticket: Ticket) -> None: ...

    def after_batch(self, flush: Callable[[], object]) -> bool: ...


@dataclass(eq=False, slots=True)
class Ticket:
    """A submitted request: ``finished`` once its one outcome is known.

    ``wait`` can be cancelled without consequence; the caller decides whether to
    ``withdraw`` the request. One task waits on a ticket (the front end that submitted
    it), so it is rescheduled directly rather than through a ``trio.Event``, which would
    cost a parking lot per request. A front end that collects many tickets in one task
    asks for a call instead (``when_finished``).
    """

    request: InferenceRequest
    item: QueuedItem
    runner: _Runner
    finished: bool = False
    response: InferenceResponse | None = None
    error: InferenceServerError | None = None
    execution: ExecutionTimes | None = None  # the batch that answered it
    cache_key: bytes | None = None  # set on a cache miss: store the response under it
    cache_ns: int = 0  # time spent looking it up in the response cache
    responses: DecoupledResponses | None = None  # a decoupled model's answers
    _waiter: trio.lowlevel.Task | None = None
    _on_finished: Callable[[], object] | None = None

    async def wait(self) -> None:
        """Return once the outcome is known."""
        if self.finished:
            await trio.lowlevel.checkpoint()
            return
        if self._waiter is not None:
            raise RuntimeError("another task already waits on this ticket")
        self._waiter = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort_wait)

    def _abort_wait(self, _: object) -> trio.lowlevel.Abort:
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def when_finished(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` once the outcome is known (now, if it is): it runs inside
        the runner, so it must not raise, and should only note the ticket for a task."""
        if self.finished:
            callback()
        else:
            self._on_finished = callback

    def after_batch(self, flush: Callable[[], object]) -> bool:
        """Inside ``when_finished``'s callback: call ``flush`` once every request of the
        batch this one finished in has its outcome (once per batch, however many of
        them ask); False, and no call, where this request finished on its own."""
        return self.runner.after_batch(flush)

    def _resolve(
        self, response: InferenceResponse | None, error: InferenceServerError | None
    ) -> None:
        self.response = response
        self.error = error
        self.finished = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter)
        callback = self._on_finished
        if callback is not None:
            self._on_finished = None
            callback()

    def withdraw(self) -> None:
        """The client gave up: fail this request as cancelled and take it out of the queue."""
        self.runner.withdraw(self)

    @property
    def withdrawn(self) -> bool:
        return isinstance(self.error, CancelledError)

    def answers(self) -> trio.MemoryReceiveChannel[tuple[Answer, bool]] | None:
        return None if self.responses is None else self.responses.receive

    def outcome(self) -> InferenceResponse:
        """The response, or the error raised (handed over: see ``Ticket.outcome``)."""
        if self.error is not None:
            raise_handed_over(self._take_error())
        assert self.response is not None
        return self.response

    def _take_error(self) -> InferenceServerError:
        """The error, taken from the ticket. A method of its own: were ``outcome`` to hold
        it in a local while raising, its frame would keep the error (and the request's
        data) in a cycle until a full collection."""
        error, self.error = self.error, None
        assert error is not None
        return error


@dataclass(frozen=True, slots=True)
class Withdraw:
    """A waiting request was cancelled by its client: take it out of the queue."""

    ticket: Ticket


WAKE = None  # an instance came free while requests wait: decide again


def tickets_leaving(items: list[QueuedItem]) -> list[Ticket]:
    """The tickets of items leaving the queue. A ticket and its item refer to each other;
    dropping the item's side here leaves no cycle for the garbage collector to find."""
    tickets: list[Ticket] = list(map(_PAYLOAD, items))  # in C: every request passes
    for item in items:
        item.payload = None
    return tickets


_PAYLOAD = attrgetter("payload")
REQUEST = attrgetter("request")
"""A ticket's request: ``list(map(REQUEST, batch))`` builds a batch's requests in C."""
FINISHED = attrgetter("finished")
"""Whether a ticket has its outcome: ``filterfalse(FINISHED, tickets)`` in C."""


def queue_full() -> UnavailableError:
    return UnavailableError("Exceeds maximum queue size")


def shutting_down() -> UnavailableError:
    return UnavailableError("server is shutting down")


def model_error(name: str, exc: Exception) -> InferenceServerError:
    if isinstance(exc, InferenceServerError):
        return exc
    logger.warning("model %r failed: %r", name, exc)
    return InternalError(failure_message(name, exc))
