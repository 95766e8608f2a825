"""The models a server instance serves, by name and version, and their readiness."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import trio

from ._errors import NotFoundError, unknown_model
from ._model import Model
from ._types import InferenceRequest, InferenceResponse


class ServedModel(Protocol):
    """One model version being served (a scheduler's runner)."""

    model: Model
    version: str
    ready: bool

    async def run(self, *, task_status: trio.TaskStatus[None] = ...) -> None: ...

    async def infer(self, request: InferenceRequest) -> InferenceResponse: ...

    def submit(self, request: InferenceRequest) -> Ticket: ...


class Ticket(Protocol):
    """A submitted request whose outcome is known once ``wait`` returns."""

    @property
    def finished(self) -> bool: ...

    async def wait(self) -> None: ...

    def outcome(self) -> InferenceResponse: ...

    def withdraw(self) -> None: ...

    @property
    def withdrawn(self) -> bool: ...


class ModelRepository:
    """The served model versions by name; ``run`` is their task tree."""

    def __init__(self, served: Iterable[ServedModel]) -> None:
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
        versions = self._versions(name)
        if not version:
            version = max(versions, key=int)
        runner = versions.get(version)
        if runner is None:
            raise NotFoundError(
                f"Request for unknown model: '{name}' version {version} is not found"
            )
        return runner

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            return self.get(name, version).ready
        except NotFoundError:
            return False

    def ready(self) -> bool:
        return all(runner.ready for runner in self)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load every model version, report started once all are ready, serve until cancelled."""
        async with trio.open_nursery() as nursery:
            for runner in self:
                await nursery.start(runner.run)
            task_status.started()

    def _versions(self, name: str) -> dict[str, ServedModel]:
        versions = self._models.get(name)
        if versions is None:
            raise unknown_model(name)
        return versions
