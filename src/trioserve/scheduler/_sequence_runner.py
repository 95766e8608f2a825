"""Serves one version of a stateful model: the sequence batcher.

A ``ModelRunner`` whose queue is a ``SequenceTable`` (``_sequences``): a request joins
its sequence when it is submitted (so a request for an unknown sequence is refused at
once, with Triton's message), the batcher task applies ``decide`` and, before handing a
batch to a model instance, adds each request's control inputs and implicit state. After
the execution the state outputs are kept for the sequence's next request. The batch
runs as the model instance its sequences belong to (``MODEL_INSTANCE``), so a model
that keeps a sequence's state in its instance finds it there.

Cancelling a request (its client went away, its stream was cancelled) ends its
sequence: the requests of it still waiting fail as cancelled, and later ones are
refused as for any unknown sequence.

Iterative sequences (``iterative_sequence``, Triton's iterative sequencer): a request
without a correlation id gets a new one and the START flag, and ends its sequence when
released. A request the model marks ``rescheduled`` is not finished: it goes back first
in its sequence's queue, flags cleared, and its slot stays taken until an execution
releases it. ``DecoupledSequenceRunner`` does the same for a decoupled model.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import CancelledError, InternalError, InvalidArgumentError, UnavailableError
from .._model import MODEL_INSTANCE, Model, Result
from .._sequence_batching import SequenceBatching, SequenceControl
from .._stats import FailureReason
from .._tensor import Datatype
from .._types import InferenceRequest, InputTensor
from .._validation import validate_request
from ._batching import QueuedItem, Wait
from ._clock import now_ns, ns_to_seconds
from ._decoupled_runner import DecoupledRunner
from ._runner import ModelRunner
from ._sequences import (
    CorrelationId,
    DispatchSequences,
    LiveSequence,
    NotStarted,
    SequencePolicy,
    SequenceTable,
    decide,
)
from ._ticket import WAKE, Ticket, Withdraw, tickets_leaving

logger = logging.getLogger("trioserve.scheduler")

_UINT64 = 1 << 64
_INT64_HALF = 1 << 63


def sequence_policy(model: Model) -> SequencePolicy:
    batching = model.sequence_batching
    assert batching is not None
    per_instance = max(model.max_batch_size, 1)
    oldest = batching.strategy == "oldest"
    return SequencePolicy(
        oldest=oldest,
        max_batch_size=per_instance,
        slots=batching.max_candidate_sequences if oldest else per_instance * model.instance_count,
        slots_per_instance=per_instance,
        max_queue_delay_ns=batching.max_queue_delay_microseconds * 1000,
        preferred_batch_sizes=tuple(batching.preferred_batch_size),
        idle_ns=batching.max_sequence_idle_microseconds * 1000,
    )


def sequence_flags(request: InferenceRequest) -> tuple[CorrelationId, bool, bool]:
    """The correlation id and the START and END flags a request carries."""
    parameters = request.parameters
    correlation_id = parameters.get("sequence_id", 0)
    if type(correlation_id) is int:
        if not -_INT64_HALF <= correlation_id < _UINT64:
            raise InvalidArgumentError(
                f"parameter 'sequence_id' must be a 64-bit unsigned integer, not {correlation_id}"
            )
        correlation_id %= _UINT64  # a uint64 id may travel as a negative int64 (gRPC)
    elif type(correlation_id) is not str:
        raise InvalidArgumentError("parameter 'sequence_id' must be an integer or a string")
    flags = []
    for key in ("sequence_start", "sequence_end"):
        value = parameters.get(key, False)
        if type(value) is not bool:
            raise InvalidArgumentError(f"parameter '{key}' must be a boolean")
        flags.append(value)
    return correlation_id, flags[0], flags[1]


class SequenceRunner(ModelRunner):
    """A runner whose model has ``sequence_batching``."""

    _chains_batches = False  # executes its own way
    _instances_alike = False  # a sequence's requests all run on its instance

    def __init__(self, model: Model, version: str, **settings: Any) -> None:
        super().__init__(model, version, **settings)
        assert model.sequence_batching is not None
        self._batching: SequenceBatching = model.sequence_batching
        self._table = SequenceTable(sequence_policy(model))
        # The sequence of each waiting request, and its START and END flags; then of
        # each executing one.
        self._joined: dict[Ticket, tuple[LiveSequence, bool, bool]] = {}
        self._executing: dict[Ticket, LiveSequence] = {}
        self._free_instances = set(range(model.instance_count))
        self._iterative_ids = itertools.count(1)

    def submit(self, request: InferenceRequest) -> Ticket:
        if not self.ready:
            raise UnavailableError(f"model '{self.name}' version {self.version} is not ready")
        size, key = validate_request(self.model, request)
        correlation_id, start, end, last = self._sequence_of(request)
        if correlation_id in (0, ""):
            raise InvalidArgumentError(
                f"inference request to model '{self.name}' must specify a non-zero or "
                "non-empty correlation ID"
            )
        if size > 1:
            raise InvalidArgumentError(
                f"inference request to model '{self.name}' must specify batch-size 1 due to "
                "requirements of sequence batcher"
            )
        self._check_correlation_type(correlation_id)
        arrival = now_ns()
        self._note_down_instances()
        try:
            sequence, conflict = self._table.admit(correlation_id, start, last, arrival)
        except NotStarted:
            raise InvalidArgumentError(
                f"inference request for sequence {correlation_id} to model '{self.name}' "
                "must specify the START flag on the first request of the sequence"
            ) from None
        if conflict:
            logger.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not end "
                "before this sequence start. Previous sequence will be terminated early.",
                correlation_id,
                self.name,
            )
        item = QueuedItem(size, key, arrival, 1, None)
        ticket = Ticket(request, item, self)
        item.payload = ticket
        sequence.pending.append(item)
        self._joined[ticket] = (sequence, start, end)
        self._inbox.put(WAKE)
        return ticket

    def _sequence_of(self, request: InferenceRequest) -> tuple[CorrelationId, bool, bool, bool]:
        """A request's correlation id, its START and END flags, and whether it is the last
        request of its sequence."""
        correlation_id, start, end = sequence_flags(request)
        if correlation_id in (0, "") and self._batching.iterative_sequence:
            # An iterative sequence of its own, as Triton's iterative sequencer makes it:
            # a new id, the START flag; its slot frees once an execution releases it.
            correlation_id = next(self._iterative_ids)
            while self._table.get(correlation_id) is not None:  # a client's live sequence
                correlation_id = next(self._iterative_ids)
            request.parameters = {
                **request.parameters,
                "sequence_id": correlation_id,
                "sequence_start": True,
            }
            return correlation_id, True, False, True
        return correlation_id, start, end, end

    def _kept(self, ticket: Ticket) -> bool:
        return (
            self._batching.iterative_sequence and ticket.request.rescheduled and not ticket.finished
        )

    def _check_correlation_type(self, correlation_id: CorrelationId) -> None:
        for control in self._batching.controls:
            if control.kind != "CORRID":
                continue
            if (control.datatype == "BYTES") != isinstance(correlation_id, str):
                kind = "a string" if control.datatype == "BYTES" else "an integer"
                raise InvalidArgumentError(
                    f"sequence batching control '{control.name}' of model '{self.name}' "
                    f"expects {kind} correlation ID"
                )
            _correlation_value(control, correlation_id)  # refused now, not in the batcher

    def _note_down_instances(self) -> None:
        """Tell the table which instances are down now, for new sequences to avoid (none
        when all are: the sequences wait for a restart, or fail naming theirs)."""
        if not self._may_go_down:
            return
        count = self.model.instance_count
        down = frozenset(i for i in range(count) if self.model.instance_down(i) is not None)
        avoided = down if len(down) < count else frozenset()
        if avoided != self._table.avoided:
            self._table.avoided = avoided
            self._table.fill_slots()  # a restarted instance's slots take the backlog

    def _waiting(self) -> int:
        return self._table.waiting()

    def _take_waiting(self) -> list[Ticket]:
        items = []
        for sequence, _, _ in list(self._joined.values()):
            items += self._table.cancel(sequence)
        return tickets_leaving(items)

    async def _batch_loop(self) -> None:
        now = now_ns()
        while True:
            for sequence in self._table.release_idle(now):
                logger.info(
                    "sequence %s of model '%s' was idle too long: released",
                    sequence.correlation_id,
                    self.name,
                )
            self._note_down_instances()
            ready = self._table.ready()
            decision = decide(
                ready, now, self._free_instances, self._table.policy, self._table.avoided
            )
            if isinstance(decision, DispatchSequences):
                batch = [self._prepare(t) for t in tickets_leaving(self._table.take(decision))]
                batch = [t for t in batch if not self._skip_withdrawn(t)]
                if batch:
                    self._idle -= 1
                    self._free_instances.remove(decision.instance)
                    self._batches.put((batch, now))
                del batch
                self._notify()
                continue
            until = _earliest(decision, self._table.next_idle_ns())
            self._handle_all(await self._inbox.take(until))
            now = now_ns()

    def _handle(self, message: Ticket | Withdraw | None) -> None:
        if isinstance(message, Withdraw):
            ticket = message.ticket
            joined = self._joined.pop(ticket, None)
            if joined is not None:
                sequence = joined[0]
                if ticket.item in sequence.pending:
                    sequence.pending.remove(ticket.item)
                    ticket.item.payload = None
                self._end_cancelled(sequence)
            elif ticket in self._executing:
                self._end_cancelled(self._executing[ticket])

    def _skip_withdrawn(self, ticket: Ticket) -> bool:
        """A request withdrawn before the batcher heard of it does not execute."""
        if not ticket.finished:
            return False
        self._table.executed(self._executing.pop(ticket), now_ns())
        return True

    def _end_cancelled(self, sequence: LiveSequence) -> None:
        for ticket in tickets_leaving(self._table.cancel(sequence)):
            self._joined.pop(ticket, None)
            self._finish(
                ticket,
                error=CancelledError(f"sequence {sequence.correlation_id} was cancelled"),
                reason=FailureReason.CANCELED,
            )

    def _prepare(self, ticket: Ticket) -> Ticket:
        """Add the control inputs and the implicit state to a request about to execute."""
        sequence, start, end = self._joined.pop(ticket)
        self._executing[ticket] = sequence
        try:
            ticket.request.inputs = self._with_controls(ticket.request, sequence, start, end)
        except Exception as exc:  # this request's data: it fails alone, not the batcher
            logger.exception("model %r: preparing a sequence request failed", self.name)
            error = InternalError(f"model '{self.name}' could not prepare the request: {exc}")
            self._finish(ticket, error=error)  # finished: _skip_withdrawn lets it go
        return ticket

    def _with_controls(
        self, request: InferenceRequest, sequence: LiveSequence, start: bool, end: bool
    ) -> dict[str, InputTensor]:
        batched = self.model.batches
        inputs = dict(request.inputs)
        for control in self._batching.controls:
            data = _control_value(control, start, end, sequence.correlation_id)
            inputs[control.name] = _tensor(control.name, control.wire_datatype, (1,), data, batched)
        states = sequence.state if isinstance(sequence.state, dict) and not start else {}
        for state in self._batching.states:
            value = states.get(state.input_name, state.initial)
            inputs[state.input_name] = _tensor(
                state.input_name, state.wire_datatype, tuple(state.dims), value, batched
            )
        return inputs

    async def _execute(self, batch: list[Ticket], dequeued_ns: int) -> None:
        instance = self._executing[batch[0]].instance
        assert instance is not None
        token = MODEL_INSTANCE.set(instance)  # the sequences' instance, not this task's
        try:
            await super()._execute(batch, dequeued_ns)
        finally:
            MODEL_INSTANCE.reset(token)
            self._free_instances.add(instance)
            executed_ns = now_ns()
            for ticket in batch:
                sequence = self._executing.pop(ticket)
                if ticket.request.rescheduled and self._kept(ticket):  # its slot stays taken
                    self._queue_again(ticket, sequence)
                self._table.executed(sequence, executed_ns)
            self._inbox.put(WAKE)  # a sequence's next request, or a slot, is free

    def _queue_again(self, ticket: Ticket, sequence: LiveSequence) -> None:
        """A request the model rescheduled goes first in its sequence's queue, with
        neither flag (Triton's iterative sequencer clears them)."""
        request = ticket.request
        request.rescheduled = False
        request.parameters = {**request.parameters, "sequence_start": False, "sequence_end": False}
        ticket.item.payload = ticket
        sequence.pending.appendleft(ticket.item)
        self._joined[ticket] = (sequence, False, False)

    async def _call_model(self, requests: list[InferenceRequest]) -> Sequence[Result]:
        results = await super()._call_model(requests)
        if not self._batching.states:
            return results
        by_request = {id(t.request): sequence for t, sequence in self._executing.items()}
        return [
            self._keep_state(by_request[id(request)], result)
            for request, result in zip(requests, results, strict=True)
        ]

    def _keep_state(self, sequence: LiveSequence, result: Result) -> Result:
        if not isinstance(result, Mapping):
            return result  # the request failed: the state stays as it was
        kept = {}
        for state in self._batching.states:
            if state.output_name not in result:
                return InternalError(
                    f"model '{self.name}' did not produce the state output '{state.output_name}'"
                )
            array = np.asarray(result[state.output_name], dtype=state.wire_datatype.dtype)
            kept[state.input_name] = array.reshape(state.dims)
        sequence.state = kept
        return result


class DecoupledSequenceRunner(SequenceRunner, DecoupledRunner):
    """A decoupled model's iterative sequences: batched by the sequence batcher, each
    request answered as its model sends, over as many executions as it is rescheduled."""

    def submit(self, request: InferenceRequest) -> Ticket:
        return self._answered_as_sent(super().submit(request))


def _control_value(
    control: SequenceControl, start: bool, end: bool, correlation_id: CorrelationId
) -> Any:
    if control.kind == "CORRID":
        return _correlation_value(control, correlation_id)
    flag = {"START": start, "END": end, "READY": True}[control.kind]
    return control.false_true[1] if flag else control.false_true[0]


def _correlation_value(control: SequenceControl, correlation_id: CorrelationId) -> bytes | int:
    """The CORRID control's value: a string id in UTF-8, an integer id (a uint64) as the
    control's type holds it (a signed type reads it in two's complement)."""
    if isinstance(correlation_id, str):
        try:
            return correlation_id.encode()
        except UnicodeEncodeError:  # a lone surrogate: JSON can escape one, UTF-8 cannot
            raise InvalidArgumentError(
                "parameter 'sequence_id' is not valid Unicode text"
            ) from None
    limits = np.iinfo(control.wire_datatype.dtype)
    value = (
        correlation_id - _UINT64
        if limits.min < 0 and correlation_id >= _INT64_HALF
        else correlation_id
    )
    if not limits.min <= value <= limits.max:
        raise InvalidArgumentError(
            f"parameter 'sequence_id' {correlation_id} does not fit the {control.datatype} "
            f"control '{control.name}'"
        )
    return value


def _tensor(
    name: str, wire: Datatype, dims: tuple[int, ...], value: Any, batched: bool
) -> InputTensor:
    """An input the batcher adds: ``dims`` per request, under a batch dimension of 1."""
    if wire.is_bytes:
        array = np.array([value], dtype=object).reshape(dims)
    else:
        array = np.asarray(value, dtype=wire.dtype).reshape(dims)
    if batched:
        array = array[np.newaxis]
    return InputTensor(name, wire, tuple(array.shape), array)


def _earliest(decision: Wait, idle_ns: int | None) -> float:
    times = [t for t in (decision.until_ns, idle_ns) if t is not None]
    return ns_to_seconds(min(times)) if times else math.inf
