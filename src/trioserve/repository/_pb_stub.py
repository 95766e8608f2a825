"""The instance process of a Python-backend model: ``python -m
trioserve.repository._pb_stub FD``, FD its end of the link to the server (or, with
``inspect`` in place of FD, the short-lived process that inspects a model.py for the
server, ``_pb_inspect``).

It imports the model's model.py and runs its ``initialize``, ``execute`` and
``finalize`` as Triton's stub does (``_pb_execution``), or, told so by the ``init``
frame (``"api": "trioserve"``), a trioserve ``Model``'s ``load``, ``execute`` and
``unload`` (``_pb_own_model``, imported only then: it imports trio and trioserve). The
thread that reads a frame from the server runs the model's work it brings, in order, a
second thread reading while the model waits for the server (``_pb_turns``); an
``async`` execute runs on the instance's asyncio loop (``_pb_loop``). Model code reaches
the server through ``_pb_remote``. Only the standard library, numpy, ``trioserve.ipc``'s
arena, frames and blocking channel, and ``pb_utils`` are imported: the process may run
under another environment's interpreter (``EXECUTION_ENV_PATH``), with a folder that
holds only these modules on its path (``_pb_launch``).

Frames from the server: ``map`` (its arena's new segments, with their descriptors),
``windows`` / ``unwindow`` (client shared-memory regions handed over, and let go of:
``_pb_windows`` reads inputs from them and writes outputs into them), ``init``, ``exec``
(a batch, and the output blocks the server is done with), ``free``, ``reply`` (to a
call), ``finalize``. To the server: ``map``, ``ready``/``init_failed``, ``done`` (a
batch's responses or its failure), ``send`` (a decoupled response), ``call``,
``cancel``, ``release``, ``log``, ``metric``, ``finalized``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import InferenceServerError, InternalError
from ..ipc._arena import Arena, Block, SegmentMap
from ..ipc._blocking import BlockingChannel, LinkClosed
from . import _pb_utils as pb_utils
from ._pb_execution import (
    call_hook,
    checked_responses,
    described,
    failure_texts,
    import_model_module,
    run_execute,
)
from ._pb_inspect import INSPECT, answer_channel, inspect_files
from ._pb_loop import InstanceLoop
from ._pb_metrics import serving_metrics
from ._pb_remote import RemoteFamilies, RemoteLink, RemoteSender, ServerLogHandler
from ._pb_serving import Serving, serving
from ._pb_turns import Turns, Work
from ._pb_windows import ClientWindows
from ._pb_wire import (
    ARENA_LABEL,
    Array,
    FrameTensor,
    blocks_from_wire,
    error_to_wire,
    frame_block,
    frame_tensor,
    read_inline,
    read_tensor,
)

if TYPE_CHECKING:
    from ._pb_own_model import OwnInstance

logger = logging.getLogger("trioserve.python_backend")


class Stub:
    """One instance of one model, and its link to the server."""

    def __init__(self, channel: BlockingChannel) -> None:
        self.channel = channel
        self.server_memory = SegmentMap()  # the server's arena: inputs, BLS answers
        self.windows = ClientWindows()  # clients' regions: inputs read from them
        self.arena = Arena(1, 1)  # replaced at init by one of the server's sizes
        self.link = RemoteLink(self)
        self._families = RemoteFamilies(self)
        self._send_lock = threading.RLock()
        self.turns = Turns(self._read, self._failed)
        self._settings: dict[str, Any] = {}
        self._model_dir = Path()
        self._model: Any = None
        self._own: OwnInstance | None = None  # a trioserve Model's instance
        self._loop = InstanceLoop("model")

    def send(self, message: tuple[Any, ...], blocks: Sequence[Block] = ()) -> None:
        """Send a frame, announcing first the segments of ``blocks`` the server has not
        mapped yet (under one lock, so that no frame overtakes its segment's)."""
        with self._send_lock:
            fresh = self.arena.unannounced(list(blocks)) if blocks else []
            if fresh:
                segments = [(segment, size) for segment, _fd, size in fresh]
                self.channel.send(("map", segments), [fd for _segment, fd, _size in fresh])
            self.channel.send(message)

    def run(self) -> None:
        self.turns.run()

    @staticmethod
    def _failed() -> None:
        """A frame this process could not handle: the link cannot go on. Said on the
        inherited stderr (the server's), since the link may be what broke."""
        traceback.print_exc()
        _exit(1)

    def _read(self) -> Work | None:
        """The next frame from the server: handled, or the model's work it brings."""
        try:
            message, fds = self.channel.receive()
        except LinkClosed:  # the server is gone: nobody to answer
            _exit(1)
        kind = message[0]
        if kind == "map":
            for (segment, size), fd in zip(message[1], fds, strict=True):
                self.server_memory.add(segment, fd, size)
        elif kind == "reply":
            self.link.replied(message[1], message[2])
        elif kind == "exec":
            self._free(blocks_from_wire(message[3]))
            # Read now, before a later frame may let go of a region they lie in.
            requests, refused = self.windows.read_batch(message[2], self.arena)
            return lambda: self._execute(message[1], requests, refused)
        elif kind == "windows":
            self.windows.add(message[1], fds)
        elif kind == "unwindow":
            self.windows.forget(message[1])
        elif kind == "free":
            self._free(blocks_from_wire(message[1]))
        elif kind == "init":
            return lambda: self._initialize(message[1])
        elif kind == "finalize":
            return self._finalize
        return None

    def _free(self, blocks: list[Block]) -> None:
        for block in blocks:
            self.arena.free(block)

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        token = serving.set(Serving(self.link, self._model_dir))
        metrics = serving_metrics.set((self._families, self))
        try:
            yield
        finally:
            serving_metrics.reset(metrics)
            serving.reset(token)

    def _initialize(self, settings: dict[str, Any]) -> None:
        self._settings = settings
        self._model_dir = Path(settings["model_dir"])
        self.arena = Arena(settings["default_bytes"], settings["growth_bytes"], label=ARENA_LABEL)
        self._loop = InstanceLoop(settings["args"]["model_instance_name"])
        try:
            if settings.get("api") == "trioserve":
                from ._pb_own_model import OwnInstance

                self._own = OwnInstance(self, settings)
            else:
                module = import_model_module(Path(settings["model_file"]), settings["module"])
                self._model = module.TritonPythonModel()
                with self._serving():
                    hook = getattr(self._model, "initialize", None)
                    call_hook(self._loop, hook, settings["args"])
        except BaseException as exc:  # anything the model raised fails the load
            self.send(("init_failed", described(exc)))
            _exit(1)
        self.send(("ready",))

    def _execute(
        self,
        batch: int,
        requests: list[tuple[Any, ...]],
        refused: dict[int, tuple[int, InferenceServerError]],
    ) -> None:
        """Run a batch. ``refused``: the requests whose inputs could not be read (by
        their place in the batch: their key and error), answered with their error while
        the others run."""
        if self._own is not None:
            self._own.execute(batch, requests, refused)
            return
        settings = self._settings
        decoupled = settings["decoupled"]
        if decoupled:
            for key, error in refused.values():
                self.send(("send", key, ("error", error_to_wire(error)), True))
        if requests:
            with self._serving():
                served = [self._request(r, decoupled) for r in requests]
                try:
                    responses = run_execute(
                        self._model,
                        self._loop,
                        served,
                        decoupled,
                        lambda exc: self._failed_later(exc, served),
                    )
                except BaseException as exc:  # the model's, whatever it is
                    self.send(("done", batch, ("failed", error_to_wire(self._failure(exc)))))
                    return
        else:  # every request was refused
            served = []
            responses = None if decoupled else []
        try:
            checked = checked_responses(
                settings["name"], decoupled, settings["iterative"], served, responses
            )
        except InferenceServerError as exc:
            self.send(("done", batch, ("failed", error_to_wire(exc))))
            return
        blocks: list[Block] = []
        results = [
            ("rescheduled",)
            if response is None
            else self.response_result(response, blocks, request[6])
            for response, request in zip(checked, requests, strict=False)  # none if decoupled
        ]
        if refused and not decoupled:
            for place, (_key, error) in sorted(refused.items()):
                results.insert(place, ("error", error_to_wire(error)))
        self.send(("done", batch, ("results", results)), blocks)

    def _request(self, described: tuple[Any, ...], decoupled: bool) -> pb_utils.InferenceRequest:
        """A request of an ``exec`` frame (as ``_pb_process`` describes it)."""
        key, request_id, model, tensors, outputs, parameters, _placed = described
        inputs = [pb_utils.Tensor._received(t[0], self.array_of(t), t[1]) for t in tensors]
        return pb_utils.InferenceRequest._received(
            model,
            inputs,
            outputs,
            request_id,
            parameters,
            RemoteSender(self, key) if decoupled else None,
        )

    def array_of(self, tensor: FrameTensor) -> Array:
        """An input of an ``exec`` frame: read-only, in place unless BYTES."""
        if len(tensor) == 4:  # inline: what small inputs are
            return read_inline(tensor)
        in_block = frame_block(tensor)
        assert in_block is not None  # client windows were read into inline ones
        return read_tensor(in_block, self.server_memory.view(in_block.block))

    def response_result(
        self,
        response: pb_utils.InferenceResponse,
        blocks: list[Block],
        placed: dict[str, tuple[int, int, int, str]],
    ) -> tuple[Any, ...]:
        """A response for the ``done`` frame; its outputs' blocks are added to ``blocks``.
        ``placed``: the outputs to write into clients' regions (by name)."""
        error = response.error()
        if error is not None:
            return ("error", error_to_wire(pb_utils.server_error(error)))
        outputs = response.output_tensors()
        try:
            written = self.windows.write_outputs(outputs, placed) if placed else {}
        except InferenceServerError as exc:
            return ("error", error_to_wire(exc))
        arena = self.arena
        tensors = [
            written.get(t._name) or frame_tensor(arena, t._name, t._datatype.name, t._array, blocks)
            for t in outputs
        ]
        return ("outputs", tensors, response.parameters())

    def _failure(self, exc: BaseException) -> InferenceServerError:
        """What ``execute`` raised, logged once (in the server's log) and as the client
        reads it."""
        settings = self._settings
        if isinstance(exc, InferenceServerError):
            return exc
        logged, told = failure_texts(
            settings["args"]["model_instance_name"], exc, Path(settings["repository"])
        )
        logger.error("model '%s' version %s: %s", settings["name"], settings["version"], logged)
        return InternalError(told)

    def _failed_later(self, exc: BaseException, served: list[pb_utils.InferenceRequest]) -> None:
        """A decoupled ``async`` execute failed after it returned: each request it had not
        answered gets the error."""
        failure = self._failure(exc)
        for request in served:
            if request._sender is not None:
                with contextlib.suppress(InferenceServerError):
                    request._sender.send(failure, final=True)

    def _finalize(self) -> None:
        error = None
        try:
            if self._own is not None:
                self._own.unload()
            else:
                with self._serving():
                    call_hook(self._loop, getattr(self._model, "finalize", None))
        except BaseException as exc:
            error = described(exc)
        self._loop.stop()
        self.send(("finalized", error))
        _exit(0)


# How often the process looks for its server: while model code holds the thread that
# reads the link (a long ``execute``), nobody reads the end of a server that was killed.
PARENT_CHECK_S = 0.5


def _outlive_no_server(server: int) -> None:
    """End the process once its server is gone (the process was handed to another
    parent), whatever the model's code is doing."""
    while os.getppid() == server:
        time.sleep(PARENT_CHECK_S)
    _exit(1)


def _exit(status: int) -> None:
    """End the process now: model threads may be running, and nothing waits for them."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def _left_to_the_server(signum: int, frame: object) -> None:
    """SIGINT and SIGTERM: nothing (see ``main``)."""


def main(argv: list[str]) -> None:
    # The server ends its instance processes itself, once its drain is over: a Ctrl-C,
    # `timeout` or a service manager signals the whole process group, and must not end
    # them first, under requests the drain still answers through them. A server that
    # dies outright is seen by the watch below. A handler, not SIG_IGN: programs the
    # model starts get the default dispositions back (SIG_IGN would pass to them).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _left_to_the_server)
    threading.Thread(
        target=_outlive_no_server, args=(os.getppid(),), name="server watch", daemon=True
    ).start()
    work = argv[1]
    # Model code sees the command line of a script started without arguments (as under
    # ``trioserve run``): a model.py that parses its arguments reads its own defaults.
    del argv[1:]
    if work == INSPECT:
        inspect_files(sys.stdin, answer_channel())
        _exit(0)  # whatever threads the model's import started
    channel = BlockingChannel(socket.socket(fileno=int(work)))
    stub = Stub(channel)
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    handler = ServerLogHandler(stub)
    handler.setFormatter(logging.Formatter("%(message)s"))
    model_logger = logging.getLogger("trioserve.python_backend")
    model_logger.addHandler(handler)
    model_logger.setLevel(logging.DEBUG)  # the server's own logger decides what it shows
    model_logger.propagate = False
    stub.run()


if __name__ == "__main__":
    main(sys.argv)
