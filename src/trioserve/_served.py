"""The models a server instance serves, by name and version, and their readiness.

Models can come and go while the server runs (the repository API's load and unload):
``install`` starts a model's new versions before they replace the old ones, which then
finish the requests they took before they stop; ``remove`` does the same without a
replacement. ``control`` is what answers the repository API, when the server has one.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn, Protocol

import trio

from ._errors import InferenceServerError, InvalidArgumentError, NotFoundError, unknown_model
from ._load_facts import LoadFacts
from ._model import Model
from ._stats import ModelStatistics
from ._types import InferenceRequest, InferenceResponse

logger = logging.getLogger("trioserve")
_INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")


def version_number(version: str) -> int:
    """A request's version string as a number; INVALID_ARG, in Triton's words, when it
    is not a whole number >= 0."""
    if _INTEGER.fullmatch(version) is None:
        raise InvalidArgumentError(
            f"failed to get model version from specified version string '{version}', "
            "version should be an integral value > 0"
        )
    number = int(version)
    if number < 0:
        raise InvalidArgumentError(
            f"invalid model version specified '{version}' , version should be an integral value > 0"
        )
    return number


class LoadTimeout(Exception):
    """A model took longer to load than its deadline allowed."""


class ServedModel(Protocol):
    """One model version being served (a scheduler's runner)."""

    model: Model
    version: str
    ready: bool

    async def run(self, *, task_status: trio.TaskStatus[None] = ...) -> None: ...

    async def infer(self, request: InferenceRequest) -> InferenceResponse: ...

    def admit(self) -> None:
        """Raise the refusal a new request would meet now (a full queue), before the
        front end spends anything on decoding it; the refusal is counted."""
        ...

    def submit(self, request: InferenceRequest) -> Ticket: ...

    def inference_statistics(self) -> ModelStatistics:
        """Triton's statistics of this version (what the statistics extension and the
        nv_inference_* metrics report)."""
        ...

    def load_facts(self) -> LoadFacts:
        """What it can tell about its load (its queue, its KV cache), for load reports."""
        ...


class Ticket(Protocol):
    """A submitted request whose outcome is known once ``wait`` returns."""

    @property
    def finished(self) -> bool: ...

    async def wait(self) -> None: ...

    def when_finished(self, callback: Callable[[], object], /) -> None:
        """Call ``callback`` once the outcome is known (now, if it is), instead of a task
        waiting; it runs where the outcome is set, so it must not raise."""
        ...

    def after_batch(self, flush: Callable[[], object], /) -> bool:
        """Inside ``when_finished``'s callback: call ``flush`` once every request of the
        batch this one finished in has its outcome, in the same turn of the event loop
        (once per batch, however many of its requests ask: a front end answers them
        together). False, and no call, where this request finished on its own."""
        ...

    def outcome(self) -> InferenceResponse:
        """The response, or the error raised, only once: the ticket hands the error over
        and keeps no reference to it. The error's traceback holds the frames that hold
        the ticket, and that cycle would keep what those frames hold (a refused request's
        data) until a full collection."""
        ...

    def withdraw(self) -> None: ...

    @property
    def withdrawn(self) -> bool: ...

    def answers(self) -> trio.MemoryReceiveChannel[tuple[Answer, bool]] | None:
        """A decoupled model's answers, each with its final flag (None for other models):
        a response, an error for that response, or None for a final flag sent alone."""
        ...


Answer = InferenceResponse | InferenceServerError | None


class UploadedFile(Protocol):
    """A load request's file whose contents are written as it is decoded (a REST
    upload's base64 text), so that a large upload is never held decoded as well."""

    def write_to(self, path: Path) -> None: ...


def raise_handed_over(error: Exception) -> NoReturn:
    """Raise a ticket's error, taken from the ticket; this frame lets go of it too."""
    try:
        raise error
    finally:
        del error


class RepositoryControl(Protocol):
    """The model repository extension: index, load and unload."""

    def index(self, ready_only: bool) -> list[dict[str, str]]: ...

    async def load(
        self, name: str, config: str | None, files: Mapping[str, bytes | UploadedFile]
    ) -> None: ...

    async def unload(self, name: str, unload_dependents: bool) -> None: ...

    def failed_models(self) -> list[str]:
        """The models that should serve but failed to load and serve no version."""
        ...


class ModelRepository:
    """The served model versions by name; ``run`` is their task tree."""

    def __init__(self, served: Iterable[ServedModel]) -> None:
        self.control: RepositoryControl | None = None
        self._nursery: trio.Nursery | None = None
        self._scopes: dict[int, trio.CancelScope] = {}  # id(runner) -> its task's scope
        self._models: dict[str, dict[str, ServedModel]] = {}
        for entry in served:
            # Several Model objects may share a name when each serves other versions
            # (one model.py per version folder).
            versions = self._models.setdefault(entry.model.name, {})
            if entry.version in versions:
                raise ValueError(
                    f"model {entry.model.name!r} version {entry.version} is defined twice"
                )
            versions[entry.version] = entry
        # What a request naming no version gets, looked up once rather than per request.
        self._latest = {
            name: versions[max(versions, key=int)] for name, versions in self._models.items()
        }
        # (name, version) -> seconds its last load took: what a person waiting on a slow
        # load reads in the log and on the status page.
        self.load_seconds: dict[tuple[str, str], float] = {}
        # (name, version) -> when its load began, while it loads; version "" while the
        # model's files are read, before its versions are known.
        self.loading: dict[tuple[str, str], float] = {}
        # Readiness also says no while a model fails to load or loads (strict readiness).
        self.strict_readiness = False

    def __iter__(self) -> Iterator[ServedModel]:
        for versions in self._models.values():
            yield from versions.values()

    def names(self) -> list[str]:
        return list(self._models)

    def versions(self, name: str) -> list[str]:
        """Version strings of ``name``, oldest first."""
        return sorted(self._versions(name), key=int)

    def get(self, name: str, version: str = "") -> ServedModel:
        """The runner for ``name`` at ``version`` ("" picks the latest version)."""
        if not version:
            latest = self._latest.get(name)
            if latest is None:
                raise unknown_model(name)
            return latest
        versions = self._versions(name)
        runner = versions.get(version)
        if runner is None:
            runner = versions.get(str(version_number(version)))  # e.g. "01" is version 1
        if runner is None:
            raise NotFoundError(
                f"Request for unknown model: '{name}' version {version} is not found"
            )
        return runner

    def statistics(self, name: str = "", version: str = "") -> list[ModelStatistics]:
        """The statistics of every version of every model (no name), of every version of
        ``name`` (no version), or of one version; NOT_FOUND for an unknown one. As in
        Triton, a version without a name is ignored."""
        if not name:
            names = sorted(self._models)
        elif version:
            return [self.get(name, version).inference_statistics()]
        else:
            names = [name]
        return [
            self._versions(n)[v].inference_statistics() for n in names for v in self.versions(n)
        ]

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            served = self.get(name, version)
            return served.ready and served.model.unavailable() is None
        except (NotFoundError, InvalidArgumentError):
            return False

    def ready(self) -> bool:
        if self.strict_readiness and (
            self.loading or (self.control is not None and self.control.failed_models())
        ):
            return False
        return all(runner.ready for runner in self)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load every model version, report started once all are ready, serve until cancelled."""
        async with trio.open_nursery() as nursery:
            served = list(self)
            for position, runner in enumerate(served, 1):
                await self._start(nursery, runner, f" ({position} of {len(served)})")
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()  # models installed later run here too

    async def _start(self, nursery: trio.Nursery, runner: ServedModel, progress: str = "") -> None:
        """Load ``runner`` and start serving it, logging what loads and how long it took."""
        name, version = runner.model.name, runner.version
        logger.info("loading model '%s' version %s%s", name, version, progress)
        with self.loading_model(name, version):
            began = self.loading[name, version]
            await nursery.start(self._serve, runner)
        took = self.load_seconds[name, version] = trio.current_time() - began
        logger.info("loaded model '%s' version %s in %.2f s", name, version, took)

    @contextmanager
    def loading_model(self, name: str, version: str = "") -> Iterator[None]:
        """Mark ``name`` (one ``version``, or "" for the whole model) as loading."""
        self.loading[name, version] = trio.current_time()
        try:
            yield
        finally:
            del self.loading[name, version]

    async def _serve(
        self, runner: ServedModel, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.CancelScope() as scope:
            self._scopes[id(runner)] = scope
            try:
                await runner.run(task_status=task_status)
            finally:
                del self._scopes[id(runner)]

    async def install(
        self, name: str, runners: Sequence[ServedModel], deadline: float = math.inf
    ) -> None:
        """Load ``runners`` (the versions of ``name``), then serve them in place of the
        versions served so far. A version that fails to load, or loads past ``deadline``
        (``LoadTimeout``), leaves the old ones serving."""
        assert self._nursery is not None, "the repository is not running"
        assert runners, "a model serves at least one version"
        started: list[ServedModel] = []
        try:
            with trio.CancelScope(deadline=deadline) as loading:
                for runner in runners:
                    await self._start(self._nursery, runner)
                    started.append(runner)
            if loading.cancelled_caught:
                raise LoadTimeout(name)
        except BaseException:
            with trio.CancelScope(shield=True):  # even when the load itself was cancelled
                await self._stop(started)
            raise
        old = self._models.get(name, {})
        self._models[name] = {runner.version: runner for runner in runners}
        self._latest[name] = self._models[name][max(self._models[name], key=int)]
        await self._stop(list(old.values()))

    async def remove(self, name: str) -> None:
        """Stop serving ``name``: requests in flight finish first."""
        old = self._models.pop(name, {})
        self._latest.pop(name, None)
        await self._stop(list(old.values()))

    async def _stop(self, runners: list[ServedModel]) -> None:
        for runner in runners:
            # Runners that can finish what they took (``drain``) do so; not part of
            # ServedModel, which the front ends check generative models against.
            drain = getattr(runner, "drain", None)
            if drain is not None:
                await drain()
            # What the model exports about itself goes as it stops serving, not once its
            # unload (which runs after, in its runner) has finished.
            stopped = getattr(runner.model, "stopped_serving", None)
            if stopped is not None:
                stopped()
            scope = self._scopes.get(id(runner))
            if scope is not None:
                scope.cancel()

    def has(self, name: str) -> bool:
        return name in self._models

    def _versions(self, name: str) -> dict[str, ServedModel]:
        versions = self._models.get(name)
        if versions is None:
            raise unknown_model(name)
        return versions
