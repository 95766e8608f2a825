"""trioserve's own ``Model``s (the own layout's model.py) with each instance in a process
of its own: the server's side (``_pb_own_model`` is the process's).

A model opts in with ``parameters={"TRIOSERVE_INSTANCE_MODE": "process"}``; the
server's ``python_instance_mode`` is for Python-backend models only, since a trioserve
model's code may share state with the server or use its trio loop, which a process of
its own would silently break. Models handed to the server as objects
(``ServerConfig(models=...)``) stay in the server's process: there is no file for the
process to import.

``OwnProcessModel`` serves one version of such a model as ``ProcessBackendModel``
serves a Python-backend one, through the same ``InstanceProcess``es: the model.py is
imported in the server for its declaration (name, tensors, batching, instance count,
versions; its ``load`` is not called there), and each of its ``instance_count``
instances runs in a stub process told to take the model.py's ``model``
(``"api": "trioserve"``). It describes the same config as in thread mode. What cannot
cross into a process is refused at load, naming the model and the feature
(``REFUSED``): the sequence batcher (its sequences' state, controls and rescheduled
steps), ``withdraw_cancels_execution`` (a process's work is not cancelled),
``EXECUTION_ENV_PATH`` (the process imports the server's trioserve). A decoupled
model's responses cross as a Python-backend model's do (``send`` frames); the response
cache works in the server, before any process.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import trio

from .._model import Model, Result
from .._model_config import model_config
from .._served import ModelRepository
from .._types import InferenceRequest
from ._config import ConfigError
from ._own_layout import load_model_file, model_files
from ._pb_launch import ENV_PARAMETER, InstanceSpec
from ._pb_link import ServerLink
from ._pb_options import PythonOptions, instance_mode
from ._pb_processes import InstanceProcesses, ServedByProcesses

# What a trioserve model in process mode cannot have: why, given the model.
REFUSED: tuple[tuple[Callable[[Model], bool], str], ...] = (
    (lambda m: m.sequence_batching is not None, "the sequence batcher"),
    (lambda m: m.withdraw_cancels_execution, "withdraw_cancels_execution"),
    (lambda m: ENV_PARAMETER in m.parameters, ENV_PARAMETER),
)


def read_own(folder: Path, repository: ModelRepository, options: PythonOptions) -> list[Model]:
    """A folder of the own layout's models: each version of one that asks for process
    mode served by an ``OwnProcessModel``, any other as it is."""
    models: list[Model] = []
    for path, folder_version in model_files(folder):
        declared = load_model_file(path, folder.name, folder_version)
        if instance_mode(declared.parameters, declared.name) == "thread":
            models.append(declared)
            continue
        for why, feature in REFUSED:
            if why(declared):
                raise ConfigError(
                    f"model '{declared.name}': {feature} cannot be used with "
                    "TRIOSERVE_INSTANCE_MODE 'process'"
                )
        models += [
            OwnProcessModel(declared, v, path, folder_version, repository, options)
            for v in declared.versions
        ]
    return models


class OwnProcessModel(ServedByProcesses, Model):
    """One version of a trioserve ``Model``, each instance in its own process."""

    def __init__(
        self,
        declared: Model,
        version: str,
        model_file: Path,
        folder_version: str | None,
        repository: ModelRepository,
        options: PythonOptions,
    ) -> None:
        settings = {f.name: getattr(declared, f.name) for f in fields(Model) if f.init}
        super().__init__(**{**settings, "versions": (version,)})
        self._config = model_config(declared)  # what thread mode describes
        self._model_file = model_file
        self._folder_version = folder_version
        self._repository = repository
        self._processes = InstanceProcesses(self, options, None)

    async def load(self) -> None:
        """Start every instance's process; each has loaded the model when this returns."""
        link = ServerLink(self._repository, trio.lowlevel.current_trio_token())
        await self._processes.start(self._specs(), link, "load")

    def _specs(self) -> Iterator[InstanceSpec]:
        config = json.dumps(self._config)
        # A GPU model's instances see the device its config names (gpus: [0]), as a
        # Python-backend model's KIND_GPU instances do.
        gpu = 0 if self.device == "gpu" else None
        model_dir = self._model_file.parent
        for index in range(self.instance_count):
            instance = f"{self.name}_{index}"
            settings: dict[str, Any] = {
                "api": "trioserve",
                "args": {"model_config": config, "model_instance_name": instance},
                "name": self.name,
                "version": self.versions[0],
                "instance": index,
                "model_file": str(self._model_file),
                "folder_version": self._folder_version,
                "model_dir": str(model_dir),
            }
            yield self._processes.spec(instance, sys.executable, gpu, settings, True)

    async def execute(self, requests: Sequence[InferenceRequest]) -> Sequence[Result]:
        return await self._processes.execute(requests)

    async def unload(self) -> None:
        await self._processes.stop()

    def described_config(self) -> dict[str, Any]:
        return self._config
