"""One Python-backend model instance in a process of its own, as the server sees it.

``InstanceProcess`` starts the stub (``_pb_stub``, by ``_pb_launch``'s command) and
supervises it from a trio system task: a nursery holding the task that reads the
process's frames and the BLS calls the model makes. ``execute`` writes the batch's
inputs once into the instance's arena (small ones ride in the frame, ``_pb_wire``; those
in a client's system region stay there, ``_pb_regions``), sends one ``exec`` frame and
waits for its ``done`` frame; the outputs are read in place from
the process's arena (small ones from the frame), each block given back (``free``) once
the last array viewing it is gone.

A process that dies (a signal, ``os._exit``, an out-of-memory kill) fails only what it
had in flight, with an error naming the model, the instance and how the process ended;
it is started again (``initialize`` runs again) while the other instances serve. One
that dies ``RestartPolicy.deaths`` times within ``window_s`` is left down: its
``execute`` fails at once and the model reports the reason (``unavailable``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio

from .._errors import CancelledError, InferenceServerError, InternalError, UnavailableError
from .._model import ResponseOutputs, Result
from .._tensor import datatype
from .._types import InferenceRequest as CoreRequest
from .._types import InferenceResponse as CoreResponse
from .._types import InputTensor, RequestedOutput, ResponseSender
from ..ipc import (
    Arena,
    Block,
    FrameError,
    LinkClosed,
    PendingCalls,
    SegmentMap,
    TrioChannel,
    channel_pair,
)
from . import _pb_launch
from ._pb_given_back import GivenBack
from ._pb_launch import InstanceSpec, RestartPolicy
from ._pb_link import ServerLink
from ._pb_metrics import MetricError
from ._pb_metrics_export import CustomMetrics
from ._pb_regions import HandedRegions
from ._pb_wire import (
    ARENA_LABEL,
    FrameTensor,
    WireTensor,
    blocks_to_wire,
    error_from_wire,
    error_to_wire,
    frame_block,
    leased,
    put_tensor,
    read_inline,
    read_tensor,
)

logger = logging.getLogger("trioserve.python_backend")
_COPY_BELOW = 64 * 1024  # an output this small is copied out and its block given back


class InitializeFailed(Exception):
    """The model's ``initialize`` (or import) failed in its process."""


class InstanceProcess:
    def __init__(
        self,
        spec: InstanceSpec,
        link: ServerLink,
        metrics: CustomMetrics | None,
        owner: object,
        policy: RestartPolicy,
    ) -> None:
        self.spec = spec
        self._link = link
        self._metrics = metrics
        self._owner = owner
        self._policy = policy
        self._token = trio.lowlevel.current_trio_token()
        # The inputs' memory.
        self._arena = Arena(spec.default_bytes, spec.growth_bytes, label=ARENA_LABEL)
        self._theirs = SegmentMap()  # the process's arena: outputs, BLS inputs
        # Clients' regions the process reads inputs from and writes outputs into.
        self._windows = HandedRegions(spec.settings["args"]["model_config"])
        self._channel: TrioChannel | None = None
        self._process: trio.Process | None = None
        self._batches = PendingCalls[tuple[Any, ...]]()
        self._batch_inputs: dict[int, list[Block]] = {}
        self._senders: dict[int, tuple[ResponseSender, list[Block]]] = {}
        self._keys = itertools.count(1)
        self._calls: dict[int, trio.CancelScope] = {}
        self._given_back = GivenBack(spec.growth_bytes, self._flush_soon)
        self._nursery: trio.Nursery | None = None
        self._initialized = trio.Event()
        self._init_error: str | None = None
        self.serving = trio.Event()  # set while a process serves, or the instance is down
        self._scope = trio.CancelScope()
        self._supervised = trio.Event()
        self._stopping = False
        self._deaths: list[float] = []
        self.unavailable: str | None = None  # why the instance stays down
        # What a trioserve Model in the process reports of itself ("state" frames):
        # its ``unavailable()`` and, from its load, its ``memory_usage()``.
        self.model_unavailable: str | None = None
        self.model_memory: tuple[tuple[str, int, int], ...] = ()

    @property
    def pid(self) -> int | None:
        """The serving process's; None from its end until the next one starts."""
        process = self._process
        return None if process is None or process.returncode is not None else process.pid

    # --- life -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the process; returns once its ``initialize`` returned."""
        outcome: list[BaseException | None] = []
        started = trio.Event()

        def first(error: BaseException | None) -> None:
            outcome.append(error)
            started.set()

        trio.lowlevel.spawn_system_task(self._supervise, first)
        await started.wait()
        if outcome[0] is not None:
            raise outcome[0]

    async def _supervise(self, first: Callable[[BaseException | None], None] | None) -> None:
        try:
            with self._scope:
                while True:
                    ended = await self._run_once(first)
                    if ended is None:  # the first start failed: nothing to restart
                        return
                    first = None
                    self.serving = trio.Event()
                    self._fail_in_flight(ended)
                    if self._stopping or not self._may_restart(ended):
                        self.serving.set()
                        return
                    logger.warning("model '%s': %s; starting it again", self.spec.model, ended)
        except Exception:  # a system task must not raise: it would end the server
            logger.exception("model '%s': supervising its process failed", self.spec.model)
            self.unavailable = self.unavailable or "its supervision failed"
            self.serving.set()
        finally:
            process = self._process
            if process is not None and process.returncode is None:  # stopped by force
                with trio.CancelScope(shield=True):
                    process.kill()
                    await process.wait()
            self._supervised.set()

    async def _run_once(self, first: Callable[[BaseException | None], None] | None) -> str | None:
        """Run one process until it ends; how it ended (None: its first start failed)."""
        failed = None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                failed = await self._spawn(nursery)
                if failed is not None:
                    nursery.cancel_scope.cancel()
                else:
                    if first is not None:
                        first(None)
                    self.serving.set()
                    if self._stopping:  # stop() came while it started
                        await self._finalize()
        finally:
            self._nursery = None
        ended = await self._reap()
        if failed is None:
            return ended
        if first is not None:
            first(InitializeFailed(failed))
            return None
        return f"its initialize failed: {failed}"

    async def _spawn(self, nursery: trio.Nursery) -> str | None:
        """Start a process and initialize the model there; why that failed, if it did."""
        spec = self.spec
        parent, child = channel_pair()
        try:
            self._process = await trio.lowlevel.open_process(
                _pb_launch.command(spec.python, str(child.fileno())),
                pass_fds=(child.fileno(),),
                env=_pb_launch.environment(spec.gpu, spec.whole_package),
            )
        finally:
            child.close()
        self._arena.forget_peer()
        self._theirs.close()
        self._theirs = SegmentMap()
        self._channel = TrioChannel(parent)
        self._windows.reset(self._channel)
        self._initialized = trio.Event()
        self._init_error = None
        nursery.start_soon(self._read, self._channel, nursery)
        with contextlib.suppress(LinkClosed):
            await self._channel.send(("init", spec.settings))
        await self._initialized.wait()
        return self._init_error

    async def _read(self, channel: TrioChannel, nursery: trio.Nursery) -> None:
        """Handle the process's frames until its link closes; then end its nursery."""
        try:
            while True:
                for message, fds in await channel.receive():
                    self._handle(message, fds, nursery)
        except (LinkClosed, FrameError, OSError):
            pass
        finally:
            channel.close()
            if not self._initialized.is_set():
                self._init_error = "the process ended before its initialize returned"
                self._initialized.set()
            nursery.cancel_scope.cancel()

    async def _reap(self) -> str:
        """Wait for the process to end (killing it if its link closed but it lives on);
        how it ended."""
        process = self._process
        assert process is not None
        with trio.move_on_after(self._policy.stop_timeout_s if self._stopping else 1.0):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
        return _pb_launch.how_it_ended(process.returncode)

    def _may_restart(self, ended: str) -> bool:
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < self._policy.window_s]
        self._deaths.append(now)
        if len(self._deaths) >= self._policy.deaths:
            self.unavailable = (
                f"instance '{self.spec.instance}' ended {len(self._deaths)} times within "
                f"{self._policy.window_s:g} s, the last time {ended}"
            )
            logger.error("model '%s': %s: it is not restarted", self.spec.model, self.unavailable)
            return False
        return True

    def _fail_in_flight(self, ended: str) -> None:
        error = InternalError(f"model '{self.spec.model}' instance '{self.spec.instance}': {ended}")
        self._batches.fail_all(error)
        senders, self._senders = self._senders, {}
        for sender, blocks in senders.values():
            with contextlib.suppress(InferenceServerError):
                sender.send(error, final=True)
            self._free_all(blocks)
        inputs, self._batch_inputs = self._batch_inputs, {}
        for blocks in inputs.values():
            self._free_all(blocks)
        self._given_back.next_process()
        self.model_unavailable = None  # the next process's load reports afresh

    async def stop(self) -> None:
        """Finalize and end the process (killed after ``stop_timeout_s``). A process
        starting meanwhile is told to finalize once it has initialized."""
        self._stopping = True
        await self._finalize()
        with trio.move_on_after(self._policy.stop_timeout_s):
            await self._supervised.wait()
        self._scope.cancel()  # the supervisor kills what still runs
        await self._supervised.wait()
        self._theirs.close()
        self._arena.close()

    async def _finalize(self) -> None:
        channel = self._channel
        if channel is not None:
            with contextlib.suppress(LinkClosed):
                await channel.send(("finalize",))

    # --- batches ------------------------------------------------------------------

    async def execute(self, requests: Sequence[CoreRequest], decoupled: bool) -> list[Result]:
        await self.serving.wait()
        if self.unavailable is not None:
            raise UnavailableError(f"model '{self.spec.model}' is unavailable: {self.unavailable}")
        channel = self._channel
        assert channel is not None
        described: list[tuple[Any, ...]] = []  # as _pb_stub.Stub._request reads them
        keys: list[int] = []
        blocks: list[Block] = []
        all_inputs: list[Block] = []
        for request in requests:
            inputs: list[Block] = []
            tensors = [
                self._windows.frame_tensor(self._arena, t.name, t.datatype.name, t.data, inputs)
                for t in request.inputs.values()
            ]
            key = next(self._keys)
            keys.append(key)
            all_inputs += inputs
            if decoupled and request.response_sender is not None:
                self._senders[key] = (request.response_sender, inputs)
            else:
                blocks += inputs
            wanted = request.outputs  # usually none by name: every output
            placed = self._windows.placed_outputs(wanted) if wanted and not decoupled else {}
            described.append(
                (key, request.id, request.model_name, tensors,
                 [o.name for o in wanted] if wanted else [], dict(request.parameters), placed)
            )  # fmt: skip
        pending = self._batches.open()
        batch = pending.call
        self._batch_inputs[batch] = blocks
        try:
            if self._windows.unannounced:  # no checkpoint since frame_tensor
                await self._windows.announce(channel)
            if all_inputs:
                await self._announce(channel, all_inputs)
            given_back = blocks_to_wire(self._given_back.take())
            await channel.send(("exec", batch, described, given_back))
            answer = await pending.wait()
        except LinkClosed:  # it died before this batch reached it
            self._batches.withdraw(batch)
            self._free_all(self._batch_inputs.pop(batch, []))
            for key in keys:
                entry = self._senders.pop(key, None)
                if entry is not None:
                    self._free_all(entry[1])
            raise UnavailableError(
                f"model '{self.spec.model}' instance '{self.spec.instance}' is restarting"
            ) from None
        except trio.Cancelled:
            self._batches.withdraw(batch)  # its inputs are freed when its answer comes
            raise
        if isinstance(answer, BaseException):
            raise answer
        kind, value = answer
        if kind == "failed":
            raise error_from_wire(value)
        answered = zip(value, requests, keys, strict=False)  # a decoupled model's: maybe none
        return [self._result(*each) for each in answered]

    def _result(self, result: tuple[Any, ...], request: CoreRequest, key: int) -> Result:
        if result[0] == "rescheduled":  # it runs again (and sends under its next key)
            request.rescheduled = True
            self._free_all(self._senders.pop(key, (None, []))[1])
            return {}
        if result[0] == "error":
            return error_from_wire(result[1])
        _kind, tensors, parameters = result
        outputs = {t[0]: self._received(t, request) for t in tensors}
        if parameters == "{}":  # what nearly every response has: nothing to parse
            return outputs
        parsed = json.loads(parameters)
        return ResponseOutputs(outputs, parsed) if parsed else outputs

    def _received(self, tensor: FrameTensor, request: CoreRequest) -> np.ndarray[Any, Any]:
        if len(tensor) != 4:  # not inline: maybe written into a client's region
            written = self._windows.written(tensor, request.outputs)
            if written is not None:
                return written
        return self._from_frame(tensor)

    def _from_frame(self, tensor: FrameTensor) -> np.ndarray[Any, Any]:
        """An output as ``_pb_wire.frame_tensor`` placed it: inline, or in a block."""
        if len(tensor) == 4:  # inline: what small outputs are
            return read_inline(tensor)
        in_block = frame_block(tensor)
        assert in_block is not None  # neither inline nor in a client's region: in a block
        return self._leased(in_block)

    def _leased(self, tensor: WireTensor) -> np.ndarray[Any, Any]:
        """The output in place in the process's arena, its block given back when the last
        array reading it goes (a BYTES output is decoded, a small one copied, and their
        blocks given back at once)."""
        array = read_tensor(tensor, self._theirs.view(tensor.block))
        if datatype(tensor.datatype).is_bytes or tensor.block.size < _COPY_BELOW:
            # Decoded, or small enough that a copy costs less than watching the views.
            array = array if datatype(tensor.datatype).is_bytes else array.copy()
            self._given_back.give_back(tensor.block, self._given_back.generation)
            return array
        return leased(array, self._given_back.give_back, tensor.block, self._given_back.generation)

    def _flush_soon(self) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._start_flush)

    def _start_flush(self) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._flush)

    async def _flush(self) -> None:
        blocks = self._given_back.take()
        if blocks and self._channel is not None:
            with contextlib.suppress(LinkClosed):
                await self._channel.send(("free", blocks_to_wire(blocks)))

    async def _announce(self, channel: TrioChannel, blocks: list[Block]) -> None:
        """Send the segments of ``blocks`` the process has not mapped yet. No checkpoint
        comes before the send queues them, so no frame using them can overtake it."""
        fresh = self._arena.unannounced(blocks)
        if fresh:
            segments = [(segment, size) for segment, _fd, size in fresh]
            await channel.send(("map", segments), [fd for _segment, fd, _size in fresh])

    def _free_all(self, blocks: list[Block]) -> None:
        for block in blocks:
            self._arena.free(block)

    # --- the process's frames -------------------------------------------------------

    def _handle(self, message: tuple[Any, ...], fds: list[int], nursery: trio.Nursery) -> None:
        kind = message[0]
        if kind == "map":
            for (segment, size), fd in zip(message[1], fds, strict=True):
                self._theirs.add(segment, fd, size)
        elif kind == "done":
            self._free_all(self._batch_inputs.pop(message[1], []))
            if not self._batches.deliver(message[1], message[2]):
                self._give_back_results(message[2])
        elif kind == "send":
            self._decoupled_response(*message[1:])
        elif kind == "call":
            nursery.start_soon(self._call, *message[1:])
        elif kind == "cancel":
            scope = self._calls.get(message[1])
            if scope is not None:
                scope.cancel()
        elif kind == "release":
            self._free_all(message[1])
        elif kind == "log":
            logging.getLogger(message[1]).log(message[2], "%s", message[3])
        elif kind == "metric":
            self._metric(*message[1:])
        elif kind == "state":
            self.model_unavailable = message[1]
            if message[2] is not None:
                self.model_memory = tuple(message[2])
        elif kind in ("ready", "init_failed"):
            self._init_error = message[1] if kind == "init_failed" else None
            self._initialized.set()
        elif kind == "finalized" and message[1] is not None:
            logger.error("model '%s' failed in finalize: %s", self.spec.model, message[1])

    def _give_back_results(self, answer: tuple[Any, ...]) -> None:
        """A withdrawn batch's outputs: nobody reads them."""
        generation = self._given_back.generation
        if answer[0] == "results":
            for result in answer[1]:
                if result[0] == "outputs":
                    for tensor in result[1]:
                        in_block = frame_block(tensor)
                        if in_block is not None:
                            self._given_back.give_back(in_block.block, generation)

    def _decoupled_response(self, key: int, payload: Any, final: bool) -> None:
        entry = self._senders.pop(key, None) if final else self._senders.get(key)
        if entry is None:
            return
        sender, inputs = entry
        outputs: Any = None
        if payload is not None:
            kind, value = payload
            outputs = (
                error_from_wire(value)
                if kind == "error"
                else {t[0]: self._from_frame(t) for t in value}
            )
        with contextlib.suppress(InferenceServerError):
            sender.send(outputs, final=final)
        if final:
            self._free_all(inputs)

    def _metric(
        self, family: tuple[str, str, int], key: Any, bounds: list[float], change: str, value: float
    ) -> None:
        if self._metrics is None:
            return
        with contextlib.suppress(MetricError):
            state = self._metrics.family(*family, self._owner)
            getattr(state.series(key, bounds), change)(value)

    # --- BLS and model control, for the model ----------------------------------------

    async def _call(self, call_id: int, kind: str, args: tuple[Any, ...]) -> None:
        outcome: tuple[Any, ...]
        with trio.CancelScope() as scope:
            self._calls[call_id] = scope
            try:
                outcome = await self._run_call(call_id, kind, args)
            except Exception as exc:
                outcome = ("error", error_to_wire(exc))
            finally:
                del self._calls[call_id]
        if scope.cancelled_caught:
            outcome = ("error", error_to_wire(CancelledError("the BLS request was cancelled")))
        await self._reply(call_id, outcome)

    async def _reply(self, call_id: int, outcome: tuple[Any, ...]) -> None:
        channel = self._channel
        if channel is None:
            return
        blocks = [t.block for t in outcome[1][2]] if outcome[0] == "response" else []
        if outcome[0] == "item" and outcome[1] is not None and outcome[1][0] == "response":
            blocks = [t.block for t in outcome[1][1][2]]
        with contextlib.suppress(LinkClosed):
            await self._announce(channel, blocks)
            await channel.send(("reply", call_id, outcome))

    async def _run_call(self, call_id: int, kind: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
        link = self._link
        if kind == "infer":
            return self._response_wire(await link.infer(self._request(args[0]), None))
        if kind == "stream":
            await self._stream(call_id, self._request(args[0]))
            return ("value", None)
        if kind == "cancelled":
            entry = self._senders.get(args[0])
            return ("value", entry is None or entry[0].cancelled)
        if kind == "family":
            return ("value", self._family(*args))
        if kind == "load":
            await link.load(*args)
            return ("value", None)
        if kind == "unload":
            await link.unload(*args)
            return ("value", None)
        if kind == "model_ready":
            return ("value", await link.model_ready(*args))
        raise InternalError(f"unknown call '{kind}'")

    def _family(self, name: str, description: str, kind: int) -> str | None:
        if self._metrics is None:
            return None
        try:
            self._metrics.family(name, description, kind, self._owner)
        except MetricError as exc:
            return str(exc)
        return None

    async def _stream(self, call_id: int, request: CoreRequest) -> None:
        """A decoupled BLS request: each response goes to the process as it comes, in
        order."""
        send, receive = trio.open_memory_channel[tuple[Any, bool]](math.inf)

        def push(answer: CoreResponse | InferenceServerError | None, final: bool) -> None:
            send.send_nowait((answer, final))

        async def forward() -> None:
            async for answer, final in receive:
                if isinstance(answer, CoreResponse):
                    wire: Any = self._response_wire(answer)
                elif answer is None:
                    wire = None
                else:
                    wire = ("error", error_to_wire(answer))
                await self._reply(call_id, ("item", wire, final))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(forward)
            with send:
                await self._link.stream(request, push)

    def _request(self, described: tuple[Any, ...]) -> CoreRequest:
        """A BLS request from the process: its inputs read in place (the process keeps
        them until the call ends)."""
        name, version, tensors, requested, request_id, parameters = described
        inputs = {
            t.name: InputTensor(
                t.name, datatype(t.datatype), t.shape, read_tensor(t, self._theirs.view(t.block))
            )
            for t in tensors
        }
        outputs = [RequestedOutput(o) for o in requested]
        return CoreRequest(name, version, inputs, outputs, id=request_id, parameters=parameters)

    def _response_wire(self, response: CoreResponse) -> tuple[Any, ...]:
        tensors = [
            put_tensor(self._arena, t.name, t.datatype.name, t.data) for t in response.outputs
        ]
        return (
            "response",
            (response.model_name, response.model_version, tensors, response.id,
             dict(response.parameters)),
        )  # fmt: skip
