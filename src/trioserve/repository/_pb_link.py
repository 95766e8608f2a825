"""How Python-backend model code reaches the server it runs in: BLS requests (one
response, or a decoupled model's stream of them) and model control.

Model code runs outside trio: ``execute`` in a worker thread, an ``async`` one on its
instance's asyncio loop (``_pb_loop``), helper threads of its own. Each call here starts
a trio system task through the server's ``TrioToken`` and hands its outcome back by a
callback, which runs in trio and must not block; the callers wrap it (a thread waits on
an event, asyncio resolves a future with ``call_soon_threadsafe``). So no call needs a
trio worker thread, and an asyncio loop never blocks on one: ``asyncio.gather`` over
``async_exec`` calls runs them all at once in trio.

``ServerLink`` is the one door (``_pb_serving.Link``): a model running in an instance
process is handed ``_pb_remote.RemoteLink``, whose methods forward the same calls over
the process's link, where the server's ``InstanceProcess`` runs them on a
``ServerLink``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import trio

from .._errors import CancelledError, InferenceServerError, InternalError, UnavailableError
from .._served import ModelRepository
from .._types import InferenceRequest as CoreRequest
from .._types import InferenceResponse as CoreResponse
from ..tracing import Trace, infer_child
from ._pb_serving import Waiting

T = TypeVar("T")
Deliver = Callable[[T | BaseException], None]
Stream = Callable[[CoreResponse | InferenceServerError | None, bool], None]


class ServerLink(Waiting):
    """The server, as the code of its Python-backend models sees it."""

    def __init__(self, repository: ModelRepository, token: trio.lowlevel.TrioToken) -> None:
        self._repository = repository
        self._token = token

    def start(self, work: Callable[[], Awaitable[T]], deliver: Deliver[T]) -> Callable[[], None]:
        """Run ``work`` in trio and ``deliver`` its result or exception (in trio); returns
        a function that cancels it from any thread."""
        scope = trio.CancelScope()

        async def task() -> None:
            outcome: T | BaseException
            try:
                with scope:
                    outcome = await work()
                if scope.cancelled_caught:
                    outcome = CancelledError("the BLS request was cancelled")
            except trio.Cancelled as exc:  # the server is stopping
                deliver(UnavailableError("the server is shutting down"))
                raise exc
            except BaseException as exc:  # a system task must not raise: it would crash trio
                outcome = exc
            deliver(outcome)

        try:
            self._token.run_sync_soon(lambda: trio.lowlevel.spawn_system_task(task))
        except trio.RunFinishedError:
            deliver(UnavailableError("the server has stopped"))
        return lambda: self._cancel(scope)

    def _cancel(self, scope: trio.CancelScope) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(scope.cancel)

    # --- what runs in trio ----------------------------------------------------------

    async def infer(self, request: CoreRequest, trace: Trace | None) -> CoreResponse:
        """One response of a model that is not decoupled; traced under ``trace``, the
        trace of the request the model serves, if that one is traced."""
        served = self._repository.get(request.model_name, request.model_version)
        return await infer_child(served, request, trace)  # type: ignore[no-any-return]

    async def stream(self, request: CoreRequest, push: Stream) -> None:
        """Each answer of ``request`` with its final flag, the last final. A model that is
        not decoupled answers once, final."""
        served = self._repository.get(request.model_name, request.model_version)
        if not served.model.decoupled:
            push(await served.infer(request), True)
            return
        served.admit()
        ticket = served.submit(request)
        answers = ticket.answers()
        if answers is None:
            raise InternalError(f"model '{request.model_name}' answered no stream")
        try:
            async for answer, final in answers:
                push(answer, final)
        except trio.Cancelled:
            ticket.withdraw()
            raise

    async def load(self, name: str, config: str, files: Mapping[str, bytes]) -> None:
        await self._control().load(name, config or None, dict(files))

    async def unload(self, name: str, unload_dependents: bool) -> None:
        await self._control().unload(name, unload_dependents)

    async def model_ready(self, name: str, version: str) -> bool:
        return self._repository.model_ready(name, version)

    def _control(self) -> Any:
        control = self._repository.control
        if control is None:
            raise UnavailableError("this server has no model repository to load from")
        return control
