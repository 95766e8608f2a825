"""The models a server instance serves, by name and version, and their readiness."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import trio

from ._errors import NotFoundError, unknown_model
from ._model import Model
from .scheduler._runner import ModelRunner


class ModelRepository:
    """Owns one ``ModelRunner`` per model version; ``run`` is their task tree."""

    def __init__(self, models: Iterable[Model]) -> None:
        self._models: dict[str, dict[str, ModelRunner]] = {}
        for model in models:
            # Several Model objects may share a name when each serves other versions
            # (one model.py per version folder).
            versions = self._models.setdefault(model.name, {})
            for version in model.versions:
                if version in versions:
                    raise ValueError(f"model {model.name!r} version {version} is defined twice")
                versions[version] = ModelRunner(model, version)

    def __iter__(self) -> Iterator[ModelRunner]:
        for versions in self._models.values():
            yield from versions.values()

    def names(self) -> list[str]:
        return list(self._models)

    def versions(self, name: str) -> list[str]:
        """Version strings of ``name``, oldest first."""
        return sorted(self._versions(name), key=int)

    def get(self, name: str, version: str = "") -> ModelRunner:
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

    def _versions(self, name: str) -> dict[str, ModelRunner]:
        versions = self._models.get(name)
        if versions is None:
            raise unknown_model(name)
        return versions
