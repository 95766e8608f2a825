"""Serves one version of one tensor model: admission, the batcher task, executions.

A front end calls ``ModelRunner.infer``, which validates the request, puts it in the
runner's inbox and waits for its outcome. The batcher task (``run``) owns the queue; it
applies ``decide`` from ``_batching`` and hands each batch straight to an idle instance
task (one per model instance, ``instance_count`` of them). An instance that comes free
while requests wait decides at once itself (``_dispatch``), then wakes the batcher; a
request that finds the batcher asleep and an instance idle wakes that instance to decide
instead (``_post``).

Under load, every turn of the event loop answers every ready connection, and each step
from a finished execution to the next one waited for such a turn. So a sync model's
worker thread runs back to back the full batches prefetched for it while it works
(``_executed.execute_chain``), and ``admit`` refuses what a full queue would refuse
before the front end decodes it: at ten times the clients a model can serve, it still completes
more than nine tenths of its peak (``tools/overload_bench.py``).

An instance the model says is down (``Model.instance_down``: a process restarting or
given up on) hands the batch it was given to another instance and takes none until it
is up again (``_stays_down``), unless every other instance is down too.

Every request ends in ``_resolve``, exactly once: a response, or an error whose kind says
why (model failure, full queue, timeout in queue, cancellation). ``_finish`` resolves a
request and records its statistics (``_stats.py`` names the timestamps it uses); those an
execution answers, the usual case, are resolved by ``_complete``, which records their
statistics together, then calls what their owners asked to run after (``after_batch``).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from itertools import filterfalse
from typing import ClassVar, cast

import trio

from .._errors import CancelledError, InferenceServerError, UnavailableError
from .._load_facts import LoadFacts, QueueState
from .._model import MODEL_INSTANCE, FunctionModel, Model, Result
from .._model_code import raise_failure
from .._stats import FailureReason, ModelStatistics, ModelStats
from .._types import InferenceRequest, InferenceResponse
from .._validation import validate_request
from ._batching import Dispatch, QueuedItem, RequestQueue, Wait, decide
from ._cache import ResponseCache, cache_key
from ._clock import now_ns, ns_to_seconds
from ._executed import Executed, check_count, execute_chain, executed_batch, thread_clock
from ._handoff import Handoff
from ._inbox import Inbox
from ._model_calls import call_hook, unload
from ._policy import policy_for
from ._ticket import (
    FINISHED,
    REQUEST,
    WAKE,
    Ticket,
    Withdraw,
    model_error,
    queue_full,
    shutting_down,
    tickets_leaving,
)

logger = logging.getLogger("trioserve.scheduler")


class ModelRunner:
    """One model version's task tree and the front ends' way into it."""

    # Whether a sync model's worker thread runs prefetched batches back to back
    # (execute_chain); runners that execute their own way turn it off.
    _chains_batches: ClassVar[bool] = True
    # Whether any instance may run any batch (not so for sequences, kept to theirs).
    _instances_alike: ClassVar[bool] = True

    def __init__(
        self,
        model: Model,
        version: str,
        *,
        cache: ResponseCache | None = None,
        histogram_bounds_ns: Sequence[int] = (),
    ) -> None:
        self.model = model
        self.version = version
        self.stats = ModelStats(model.name, version, histogram_bounds_ns=histogram_bounds_ns)
        self._cache = cache  # None: this version does not use the response cache
        self.policy = policy_for(model)
        # Whether like requests may be submitted as one, rows stacked (``submit_coalesced``):
        # where the model stacks a batch's rows itself (``FunctionModel.execute``, not a
        # subclass's), and a request is no more than its rows (no queue limit counts it,
        # no cache entry, sequence or stream).
        self.coalesces = (
            type(self) is ModelRunner and type(model).execute is FunctionModel.execute
            and self.policy.batching and not self.policy.max_queue_size
            and cache is None and model.device == "cpu"
        )  # fmt: skip
        self.ready = False
        self._inbox = Inbox[Ticket | Withdraw | None]()
        # Batches go to the model instances' tasks; ``_idle`` counts instances waiting.
        self._batches = Handoff[tuple[list[Ticket], int]]()
        # An idle instance may decide for the batcher (``_post``) where no batch waits out a
        # queue delay (the batcher times it) and the batch loop is this class's.
        self._instances_decide = not self.policy.max_queue_delay_ns and (
            type(self)._batch_loop is ModelRunner._batch_loop
        )
        self._deciding = False  # an instance was handed _DECIDE and has not run yet
        self._execute_is_async = False  # settled once the model is loaded
        self._idle = model.instance_count
        # Instances down (``Model.instance_down``), neither idle nor busy; only models
        # that can have one are asked, batch by batch.
        self._down = 0
        self._may_go_down = type(model).instance_down is not Model.instance_down
        self._watches_instances = self._instances_alike and self._may_go_down
        self._queue = RequestQueue(self.policy.priority_levels)
        # Batches decided while every instance was busy, for the first worker thread that
        # finishes to run next without a trip through the event loop (see execute_chain).
        self._prefetched: deque[list[Ticket]] = deque()
        self._threads_running = 0
        self._changes = trio.lowlevel.ParkingLot()  # woken whenever statistics() may change
        # Executions that a withdrawal cancels (``Model.withdraw_cancels_execution``).
        self._executions: dict[Ticket, trio.CancelScope] = {}
        self._load_facts = LoadFacts(queue=self.statistics)  # asked on every load report
        # What ``now_ns`` reads, asked directly for each arrival once the runner runs:
        # ``trio.current_time`` reaches it through two more Python calls.
        self._clock: Callable[[], float] = trio.current_time
        self._executed = partial(executed_batch, model, version)  # (a batch, its times)
        # While ``_complete`` finishes a batch's requests: what their owners asked to run
        # once all have their outcomes (``after_batch``), each once.
        self._after_batch: list[Callable[[], object]] | None = None

    @property
    def name(self) -> str:
        return self.model.name

    def statistics(self) -> QueueState:
        busy = self.model.instance_count - self._idle - self._down
        return QueueState(queued=self._pending(), executing=busy)

    def inference_statistics(self) -> ModelStatistics:
        return self.stats.statistics(
            pending=self._pending(), response_cache=self._cache is not None
        )

    def load_facts(self) -> LoadFacts:
        return self._load_facts

    async def wait_until(self, predicate: Callable[[QueueState], bool]) -> None:
        """Return once ``predicate(self.statistics())`` holds (checked on every change)."""
        while not predicate(self.statistics()):
            await self._changes.park()

    async def drain(self) -> None:
        """Take no more requests; return once every request taken has its outcome."""
        self.ready = False
        await self.wait_until(lambda s: not (s.queued or s.executing or self._inbox))

    def admit(self) -> None:
        # The queue itself refuses what arrives while it is full (``_handle``); this asks
        # the same of a request not yet decoded, so that under overload a refusal costs
        # a small fraction of an answer.
        limit = self.policy.max_queue_size
        if limit and len(self._queue) >= limit and not self._idle:
            now = now_ns()
            self.stats.failed(now, now, FailureReason.REJECTED)
            self._notify()
            raise queue_full()

    def submit_coalesced(self, request: InferenceRequest, requests: int) -> Ticket:
        """``submit`` a request that stacks the rows of ``requests`` alike ones (only where
        ``coalesces``): one queue place and execution, its statistics those of each."""
        ticket = self.submit(request)
        ticket.item.requests = requests  # before the batcher queues it, a turn later
        return ticket

    def submit(self, request: InferenceRequest) -> Ticket:
        """Validate and queue ``request``; its outcome arrives on the returned ticket."""
        if not self.ready:
            raise UnavailableError(f"model '{self.name}' version {self.version} is not ready")
        size, key = validate_request(self.model, request)
        arrival = round(self._clock() * 1e9)  # now_ns(), as ``_clock`` says
        policy = self.policy
        if request.parameters:  # a priority or a timeout may be asked for
            level = policy.level(request.priority)
            deadline = policy.deadline(arrival, request.timeout_us)
        else:  # ``policy.deadline(arrival, 0)``, without the call on every request
            level = policy.default_priority_level
            deadline = arrival + policy.default_timeout_ns if policy.default_timeout_ns else None
        item = QueuedItem(size, key, arrival, level, deadline)
        ticket = Ticket(request, item, self)
        item.payload = ticket
        if self._cache is not None and self._answer_from_cache(ticket):
            return ticket
        self._post(ticket)
        return ticket

    def _post(self, ticket: Ticket) -> None:
        """Queue ``ticket`` for the next decision: where the batcher sleeps with nothing
        timed and an instance is idle, that instance decides as it next runs, as the
        batcher would have then, and runs the batch (one wake-up instead of two)."""
        if self._deciding:
            self._inbox.put_quietly(ticket)
        elif self._instances_decide and self._inbox.sleeping and self._batches.waiting:
            self._inbox.put_quietly(ticket)
            self._deciding = True
            self._batches.put(_DECIDE)
        else:
            self._inbox.put(ticket)

    def _answer_from_cache(self, ticket: Ticket) -> bool:
        """Finish ``ticket`` from the response cache if it holds the answer; on a miss,
        note the key so that a successful response gets stored."""
        assert self._cache is not None
        key = cache_key(ticket.request, self.name, self.version)
        response = self._cache.lookup(key, ticket.request)
        ticket.cache_ns = now_ns() - ticket.item.arrival_ns  # the lookup starts on arrival
        if response is None:
            ticket.cache_key = key
            return False
        ticket.item.payload = None  # never queued: no cycle left for the collector
        self._finish(ticket, response=response)
        return True

    def withdraw(self, ticket: Ticket) -> None:
        """The client gave up: fail the ticket as cancelled and take it out of the queue."""
        cancelled = CancelledError("request cancelled")
        if self._finish(ticket, error=cancelled, reason=FailureReason.CANCELED):
            self._inbox.put(Withdraw(ticket))
            execution = self._executions.get(ticket)
            if execution is not None:  # the model stops working on it
                execution.cancel()

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Queue ``request`` and wait for its outcome; cancelling this withdraws it."""
        ticket = self.submit(request)
        try:
            await ticket.wait()
        except trio.Cancelled:
            self.withdraw(ticket)
            raise
        return ticket.outcome()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, serve until cancelled, then fail what waits and unload."""
        await call_hook(self.model.load, self.name, "in load", abandon_on_cancel=True)
        self._execute_is_async = self.model.is_async
        self._clock = trio.lowlevel.current_clock().current_time
        self.stats.memory_usage = tuple(self.model.memory_usage())
        self.ready = True
        task_status.started()
        try:
            async with trio.open_nursery() as instances:
                for index in range(self.model.instance_count):
                    instances.start_soon(self._instance, index)
                await self._batch_loop()
        finally:
            self.ready = False
            for ticket in self._take_waiting():
                self._finish(ticket, error=shutting_down())
            with trio.CancelScope(shield=True):
                await unload(self.model, self.version)

    def _waiting(self) -> int:
        """Requests waiting to execute (a coalesced one counts once: see ``_pending``)."""
        return len(self._queue) + sum(map(len, self._prefetched))

    def _pending(self) -> int:
        """Requests waiting to execute, as reported: each coalesced one as many."""
        if not self.coalesces:
            return self._waiting()
        prefetched = sum(t.item.requests for batch in self._prefetched for t in batch)
        return self._queue.requests + prefetched

    def _take_waiting(self) -> list[Ticket]:
        """Every waiting request, out of the queue (the server stops)."""
        waiting = tickets_leaving(self._queue.pop_front(len(self._queue)))
        while self._prefetched:
            waiting += self._prefetched.popleft()
        return waiting

    async def _batch_loop(self) -> None:
        now = now_ns()
        while True:
            decision = self._dispatch(now)
            if isinstance(decision, Dispatch):
                continue  # nothing was awaited: decide again as of the same moment
            until = math.inf if decision.until_ns is None else ns_to_seconds(decision.until_ns)
            self._handle_all(await self._inbox.take(until))
            now = now_ns()

    def _dispatch(self, now: int) -> Dispatch | Wait:
        """Fail the requests whose queue timeout expired, then decide; a batch decided goes
        to an idle instance's task."""
        for ticket in tickets_leaving(self._queue.pop_expired(now)):
            self._finish(
                ticket,
                error=UnavailableError("Request timeout expired"),
                reason=FailureReason.REJECTED,
            )
        decision = decide(self._queue, now, self._idle, self.policy)
        if isinstance(decision, Dispatch):
            batch = self._pop_batch(decision.count)
            if batch:  # else all withdrawn; their Withdraw messages find nothing
                self._idle -= 1
                self._batches.put((batch, now))  # now: dequeued into a batch
                self._notify()
        else:
            self._prefetch(now)
        return decision

    def _prefetch(self, now: int) -> None:
        """Prefetch for busy worker threads, which take a batch as they finish: only
        batches that waiting could not improve (full ones), and only while no queued
        request could still time out."""
        while (
            _PREFETCH_DEPTH * self._threads_running > len(self._prefetched)
            and self._queue.next_deadline() is None
        ):
            ready = decide(self._queue, now, 1, self.policy)
            if not (isinstance(ready, Dispatch) and ready.count == self.policy.max_batch_size):
                return
            batch = self._pop_batch(ready.count)
            if batch:
                self._prefetched.append(batch)
                self._notify()

    def _pop_batch(self, count: int) -> list[Ticket]:
        return list(filterfalse(FINISHED, tickets_leaving(self._queue.pop_front(count))))

    def _handle_all(self, messages: list[Ticket | Withdraw | None]) -> None:
        for message in messages:
            self._handle(message)
        self._notify()  # once for them all: the watchers run later anyway

    def _handle(self, message: Ticket | Withdraw | None) -> None:
        """One message of the inbox (``_handle_all`` notifies the watchers after)."""
        if isinstance(message, Ticket):
            if message.finished:
                message.item.payload = None  # cancelled before the batcher saw it
                return
            if self.policy.max_queue_size and len(self._queue) >= self.policy.max_queue_size:
                self._finish(message, error=queue_full(), reason=FailureReason.REJECTED)
            else:
                self._queue.push(message.item)
        elif isinstance(message, Withdraw):
            item = message.ticket.item
            if self._queue.remove(item):
                item.payload = None

    async def _instance(self, index: int) -> None:
        """One model instance: runs the batches the batcher hands it, one at a time."""
        MODEL_INSTANCE.set(index)  # this task's context; worker threads get a copy
        while True:
            handed = self._batches.take_nowait()
            batch, dequeued_ns = handed if handed is not None else await self._batches.get()
            del handed
            if not batch:  # _DECIDE (``_post``): as the batcher, then take what it decided
                self._decide_here()
                continue
            if self._watches_instances and self._stays_down(index, batch, dequeued_ns):
                del batch
                await self._while_down(index)
                continue
            try:
                await self._execute(batch, dequeued_ns)
            finally:
                self._idle += 1
                self._notify()
            del batch  # held until the next batch, it would keep its tensors alive
            if self._prefetched:  # prefetched after the thread looked for the last time
                self._idle -= 1
                self._batches.put((self._prefetched.popleft(), now_ns()))
            elif self._waiting():
                # Take the next batch here rather than wake the batcher's task to hand
                # it over: under load each task switch waits its turn behind every
                # connection's task, and the model would idle for two of those turns.
                self._dispatch(now_ns())
                if self._waiting():  # for the other instances, or a batch still forming
                    self._inbox.put(WAKE)

    def _decide_here(self) -> None:
        self._deciding = False
        self._handle_all(self._inbox.take_nowait())
        now = now_ns()
        while isinstance(decision := self._dispatch(now), Dispatch):
            pass  # (for the other idle instances too)
        if decision.until_ns is not None:  # a batch forming, a timeout: the batcher waits
            self._inbox.put(WAKE)

    def _stays_down(self, index: int, batch: list[Ticket], dequeued_ns: int) -> bool:
        """Whether instance ``index`` cannot run ``batch`` while another can: the batch
        goes to an idle instance, or first to the next one that finishes. With every
        other instance down too it runs here (waiting for a restart, or failing)."""
        if self.model.instance_down(index) is None or self._down >= self.model.instance_count - 1:
            return False
        if self._idle:
            self._idle -= 1
            self._batches.put((batch, dequeued_ns))
        else:
            self._prefetched.appendleft(batch)
        self._down += 1
        return True

    async def _while_down(self, index: int) -> None:
        """Take no batch until instance ``index`` can run them again."""
        while (down := self.model.instance_down(index)) is not None:
            await down()
        self._down -= 1
        self._idle += 1
        self._notify()
        if self._waiting():
            self._inbox.put(WAKE)

    async def _execute(self, batch: list[Ticket], dequeued_ns: int) -> None:
        if self.model.withdraw_cancels_execution:
            with trio.CancelScope() as scope:
                self._executions[batch[0]] = scope
                try:
                    await self._execute_batch(batch, dequeued_ns)
                finally:
                    del self._executions[batch[0]]
        else:
            await self._execute_batch(batch, dequeued_ns)

    async def _execute_batch(self, batch: list[Ticket], dequeued_ns: int) -> None:
        try:
            if self._chains_batches and not (
                self._execute_is_async or self.model.withdraw_cancels_execution
            ):
                self._threads_running += 1
                try:
                    now = thread_clock()
                    executed = await trio.to_thread.run_sync(
                        execute_chain, self.model, self.version, self._prefetched,
                        self._complete_soon, batch, dequeued_ns, now,
                        trio.lowlevel.current_trio_token(),
                    )  # fmt: skip
                finally:
                    self._threads_running -= 1
                batch = executed.batch
            else:
                input_ready_ns = now_ns()
                try:
                    results = await self._call_model(list(map(REQUEST, batch)))
                    executed = self._executed(batch, dequeued_ns, input_ready_ns, results, now_ns)
                except Exception as exc:
                    executed = Executed(batch, error=model_error(self.name, exc))
            self._complete(executed)
        finally:
            for ticket in batch:
                if not (ticket.finished or self._kept(ticket)):  # the execution was cancelled
                    self._finish(ticket, error=shutting_down())

    def _kept(self, ticket: Ticket) -> bool:
        """Whether an executed request stays to run again (an iterative sequence's step)
        rather than end with this execution."""
        return False

    def _complete_soon(self, executed: Executed) -> None:
        # Called by trio between tasks, where an exception would end the whole run.
        try:
            self._complete(executed)
            if self._queue:  # the thread took the prefetched batch: prefetch its next
                self._dispatch(now_ns())
        except Exception:
            logger.exception("model %r: completing a batch failed", self.name)

    def after_batch(self, flush: Callable[[], object]) -> bool:
        """Inside a finished request's callback: call ``flush`` once, as every request of
        its batch has its outcome (this turn), however many ask. False, and no call, for
        one that finished on its own (withdrawn, timed out, refused, shut down)."""
        waiting = self._after_batch
        if waiting is None:
            return False
        if flush not in waiting:
            waiting.append(flush)
        return True

    def _complete(self, executed: Executed) -> None:
        """Record an executed batch, then call what its requests' owners asked (``after_batch``)."""
        self._after_batch = waiting = list[Callable[[], object]]()
        try:
            self._complete_batch(executed)
        finally:
            self._after_batch = None
            for flush in waiting:
                flush()

    def _complete_batch(self, executed: Executed) -> None:
        batch, times, responses, error = executed
        if times is None or responses is None:
            assert error is not None
            for ticket in batch:
                self._finish(ticket, error=error, reason=FailureReason.BACKEND)
            return
        # The requests answered as the batch's outputs are ready (no clock to read) have
        # their statistics recorded together, after the loop, and the watchers of the
        # statistics are woken once: this runs for every request.
        answered: list[int] = []  # their arrivals
        inferences = executed_size = 0
        for ticket, response in zip(batch, responses, strict=True):
            executed_size += ticket.item.batch_size
            if ticket.request.rescheduled and self._kept(ticket):
                continue
            ticket.execution = times
            if isinstance(response, InferenceServerError):  # failed on its own
                self._finish(ticket, error=response, reason=FailureReason.BACKEND)
            elif ticket.cache_key is not None and not ticket.finished:
                self._store_in_cache(ticket.cache_key, ticket.cache_ns, response)
                self._finish(ticket, response=response)  # sent after the insertion
            elif self._resolve(ticket, response, None):
                item = ticket.item
                if item.requests == 1:
                    answered.append(item.arrival_ns)
                else:  # coalesced: it counts as each of the requests it stands for
                    answered += [item.arrival_ns] * item.requests
                inferences += item.batch_size
        self.stats.executed(executed_size, times)
        if answered:
            self.stats.batch_succeeded(answered, times.output_ready_ns, inferences, times)
        self._notify()

    async def _call_model(self, requests: list[InferenceRequest]) -> Sequence[Result]:
        results = cast(Sequence[Result], await self._execute_model(requests))
        check_count(results, requests)
        return results

    @trio.lowlevel.enable_ki_protection  # see _model_code: a Ctrl-C is not the model's
    async def _execute_model(self, requests: list[InferenceRequest]) -> object:
        """The model's ``execute`` (in trio when async, else in a worker thread); what it
        raises comes out as an ``Exception``, the server's cancellation excepted."""
        try:
            if self._execute_is_async:
                return await self.model.execute(requests)  # type: ignore[misc]
            return await trio.to_thread.run_sync(self.model.execute, requests)
        except BaseException as exc:
            raise_failure(exc, self.name, "in execute")

    def _store_in_cache(self, key: bytes, lookup_ns: int, response: InferenceResponse) -> None:
        assert self._cache is not None
        start = now_ns()
        try:
            self._cache.insert(key, response)
        except Exception:  # outputs it cannot copy (a device array): answered, not cached
            logger.exception("model %r: a response could not be cached", self.name)
        self.stats.cache_miss(lookup_ns + now_ns() - start)

    def _notify(self) -> None:
        if self._changes:  # waking an empty parking lot still costs, on every request
            self._changes.unpark_all()

    def _finish(
        self,
        ticket: Ticket,
        *,
        response: InferenceResponse | None = None,
        error: InferenceServerError | None = None,
        reason: FailureReason = FailureReason.OTHER,
    ) -> bool:
        """Record a request's one outcome, handed over now; False if it already had one."""
        if not self._resolve(ticket, response, error):
            return False
        sent_ns = now_ns()
        arrival_ns = ticket.item.arrival_ns
        if error is not None:
            self.stats.failed(arrival_ns, sent_ns, reason, ticket.item.requests)
        elif ticket.execution is not None:
            self.stats.succeeded(arrival_ns, sent_ns, ticket.item.batch_size, ticket.execution)
        else:
            self.stats.cache_hit(arrival_ns, sent_ns, ticket.cache_ns)
        self._notify()
        return True

    def _resolve(
        self,
        ticket: Ticket,
        response: InferenceResponse | None,
        error: InferenceServerError | None,
    ) -> bool:
        """Give a request its one outcome (its statistics are the caller's to record);
        False if it already had one."""
        if ticket.finished:
            return False
        if ticket.responses is not None:  # a decoupled model's answers end here
            ticket.responses.end(error)
        ticket._resolve(response, error)
        if ticket.request.trace is not None:
            ticket.request.trace.queued(ticket.item.arrival_ns, ticket.execution)
        return True


# Batches prefetched per worker thread running: the thread takes one as it finishes, and
# the event loop puts the next one there while the thread runs that one, a turn of the
# loop later; a second covers turns longer than an execution.
_PREFETCH_DEPTH = 2
_DECIDE: tuple[list[Ticket], int] = ([], 0)  # an instance's batch: decide, then take one
