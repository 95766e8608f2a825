"""Serves one version of a decoupled model: zero, one or many responses per request.

A ``ModelRunner`` whose tickets carry the request's ``DecoupledResponses`` (its
``response_sender``). The model's answers reach the front end as they are sent; the
request's outcome (statistics, load report) is recorded once both its final flag has
arrived and its execution has returned, since the model may answer after ``execute``
returned, or answer everything before it does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from .._errors import InferenceServerError
from .._model import Result
from .._model_code import model_failure
from .._stats import ExecutionTimes, FailureReason
from .._types import InferenceRequest, InferenceResponse
from ._clock import now_ns
from ._decoupled import DecoupledResponses
from ._responses import response_of
from ._runner import ModelRunner
from ._ticket import REQUEST, Ticket, model_error, shutting_down


class DecoupledRunner(ModelRunner):
    """A runner whose model is ``decoupled``."""

    _chains_batches = False  # executes its own way

    def submit(self, request: InferenceRequest) -> Ticket:
        return self._answered_as_sent(super().submit(request))

    def _answered_as_sent(self, ticket: Ticket) -> Ticket:
        # Set before the batcher task runs (no checkpoint in between), so before execute.
        ticket.responses = DecoupledResponses(partial(self._deliver, ticket))
        ticket.request.response_sender = ticket.responses
        return ticket

    async def _execute_batch(self, batch: list[Ticket], dequeued_ns: int) -> None:
        try:
            input_ready_ns = now_ns()
            await self._call_model(list(map(REQUEST, batch)))
        except Exception as exc:
            error = model_error(self.name, exc)
            for ticket in batch:
                self._finish(ticket, error=error, reason=FailureReason.BACKEND)
        else:
            executed_ns = now_ns()
            times = ExecutionTimes(dequeued_ns, input_ready_ns, executed_ns, executed_ns)
            self.stats.executed(sum([p.item.batch_size for p in batch]), times)
            for ticket in batch:
                if ticket.request.rescheduled and self._kept(ticket):  # answers on later
                    continue
                ticket.execution = times
                assert ticket.responses is not None
                if ticket.responses.final_delivered:
                    self._finish(ticket, response=self._empty(ticket.request))
        finally:
            for ticket in batch:
                if ticket.execution is None and not (ticket.finished or self._kept(ticket)):
                    # the execution was cancelled
                    self._finish(ticket, error=shutting_down())

    async def _call_model(self, requests: list[InferenceRequest]) -> Sequence[Result]:
        await self._execute_model(requests)
        return ()  # it answers through the requests' senders

    def _deliver(
        self, ticket: Ticket, outputs: Mapping[str, Any] | Exception | None, final: bool
    ) -> None:
        """The model sent an answer (in the trio thread, in the order of the sends)."""
        assert ticket.responses is not None
        answer: InferenceResponse | InferenceServerError | None = None
        if isinstance(outputs, Exception):
            answer = model_error(self.name, outputs)
        elif outputs is not None:
            try:
                answer = response_of(self.model, self.version, ticket.request, outputs)
            except BaseException as exc:  # what the model sent cannot be answered
                failure = model_failure(exc, self.name, "in what it sent")
                answer = model_error(self.name, failure)
        ticket.responses.put(answer, final)
        if final and ticket.execution is not None:
            self._finish(ticket, response=self._empty(ticket.request))

    def _empty(self, request: InferenceRequest) -> InferenceResponse:
        return InferenceResponse(self.name, self.version, [], id=request.id)
