"""A Python-backend model whose instances run in processes of their own (process mode),
as Triton runs them: ``ProcessBackendModel`` starts one ``InstanceProcess``
(``_pb_process``) per count of each instance group, hands each batch to the instance
the runner picked, and ends them at unload. That part (``InstanceProcesses``, and
``ServedByProcesses``, what the runner asks of such a model) serves trioserve's own
models in processes too (``_own_processes``).

Which mode a model gets: its config.pbtxt parameter ``TRIOSERVE_INSTANCE_MODE``
(``thread`` or ``process``), else the server's ``python_instance_mode``. Thread mode
costs no process and no copy into shared memory, and keeps one process exact under the
testing kit's clock; process mode gives each instance a core of its own (the GIL is per
process), survives a model that crashes, and lets a model bring its own Python
environment (``EXECUTION_ENV_PATH``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import trio

from .._model import MODEL_INSTANCE, Model, Result
from .._model_code import raise_failure
from .._stats import MemoryUsage
from .._types import InferenceRequest
from . import _pb_launch
from ._config import CONFIG_FILE, ConfigError, complete_config, config_document, model_settings
from ._generated.model_config_pb2 import ModelInstanceGroup
from ._layout import Reading, chosen_versions, version_folders
from ._pb_inspect import INSPECT, ModelFileError, auto_complete, import_model_class
from ._pb_launch import InstanceSpec, RestartPolicy
from ._pb_link import ServerLink
from ._pb_metrics_export import CustomMetrics
from ._pb_options import PythonOptions
from ._pb_process import InitializeFailed, InstanceProcess
from ._python_backend import PythonBackendModel, completed_config, model_module_name


class InstanceProcesses:
    """The instance processes of one model version, by instance index: what a model
    whose instances run in processes does at load, per batch and at unload (a
    Python-backend model's, ``ProcessBackendModel``, and a trioserve ``Model``'s,
    ``_own_processes``)."""

    def __init__(self, model: Model, options: PythonOptions, metrics: CustomMetrics | None) -> None:
        self._model = model
        self._options = options
        self._metrics = metrics
        self._processes: list[InstanceProcess] = []

    def spec(
        self,
        instance: str,
        python: str,
        gpu: int | None,
        settings: dict[str, Any],
        whole_package: bool = False,
    ) -> InstanceSpec:
        """What one instance's process starts with; ``settings``, its ``init`` frame, gets
        the arena's sizes."""
        options = self._options.settings
        return InstanceSpec(
            model=self._model.name,
            instance=instance,
            python=python,
            gpu=gpu,
            default_bytes=options.shm_default_bytes,
            growth_bytes=options.shm_growth_bytes,
            settings={
                **settings,
                "default_bytes": options.shm_default_bytes,
                "growth_bytes": options.shm_growth_bytes,
            },
            whole_package=whole_package,
        )

    async def start(self, specs: Iterable[InstanceSpec], link: ServerLink, hook: str) -> None:
        """Start a process per spec, one after the other; each has run the model's
        ``hook`` (its initialize, its load) when this returns. A failure stops those
        started and is raised as the model's load error."""
        policy = RestartPolicy(
            self._options.settings.restart_limit,
            self._options.settings.restart_window_s,
            self._options.settings.stub_timeout_s,
        )
        try:
            for spec in specs:
                process = InstanceProcess(spec, link, self._metrics, self._model, policy)
                self._processes.append(process)
                await process.start()
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await self.stop()
            if isinstance(exc, InitializeFailed):
                raise ConfigError(f"model '{self._model.name}' failed in {hook}: {exc}") from None
            raise_failure(exc, self._model.name, f"in {hook}")

    async def execute(self, requests: Sequence[InferenceRequest]) -> Sequence[Result]:
        process = self._processes[MODEL_INSTANCE.get()]
        return await process.execute(requests, self._model.decoupled)

    async def stop(self) -> None:
        processes, self._processes = self._processes, []
        async with trio.open_nursery() as nursery:
            for process in processes:
                nursery.start_soon(process.stop)

    def unavailable(self) -> str | None:
        """Why the model cannot serve: an instance down for good, or what the model
        itself says in an instance's process (a trioserve Model's ``unavailable()``)."""
        reasons = [
            reason
            for p in self._processes
            for reason in (p.unavailable, p.model_unavailable)
            if reason is not None
        ]
        return "; ".join(dict.fromkeys(reasons)) if reasons else None

    def memory_usage(self) -> list[MemoryUsage]:
        """What the model's instances reported holding once loaded, summed over their
        processes (each holds its own copy) by memory kind and device."""
        total: dict[tuple[str, int], int] = {}
        for process in self._processes:
            for kind, device, size in process.model_memory:
                total[kind, device] = total.get((kind, device), 0) + size
        return [MemoryUsage(kind, device, size) for (kind, device), size in total.items()]

    def instance_down(self, index: int) -> Callable[[], Awaitable[None]] | None:
        """A restarting instance is down until its process serves again; one given up
        on, for good (an event nobody sets)."""
        if index >= len(self._processes):  # unloading
            return None
        process = self._processes[index]
        if process.unavailable is not None:
            return trio.Event().wait
        return None if process.serving.is_set() else process.serving.wait

    def pids(self) -> list[int | None]:
        return [p.pid for p in self._processes]


class ServedByProcesses:
    """What the runner asks of a model whose instances are ``_processes``, mixed into
    such a model class before ``Model``."""

    _processes: InstanceProcesses
    response_cache: bool

    @property
    def reads_client_windows(self) -> bool:
        """The instance processes read inputs from clients' system regions themselves
        (``_pb_regions``), unless the response cache needs the bytes for its key."""
        return not self.response_cache

    def unavailable(self) -> str | None:
        return self._processes.unavailable()

    def memory_usage(self) -> list[MemoryUsage]:
        return self._processes.memory_usage()

    def instance_down(self, index: int) -> Callable[[], Awaitable[None]] | None:
        return self._processes.instance_down(index)

    def instance_pids(self) -> list[int | None]:
        """The process of each instance (None while one starts again): for operators
        and tests."""
        return self._processes.pids()


class ProcessBackendModel(ServedByProcesses, PythonBackendModel):
    """One version of a Python-backend model, each instance in its own process."""

    def __init__(self, *args: Any, options: PythonOptions, **settings: Any) -> None:
        super().__init__(*args, **settings)
        self._processes = InstanceProcesses(self, options, self._metrics)

    async def load(self) -> None:  # type: ignore[override]
        """Start every instance's process; each has initialized when this returns."""
        self._link = ServerLink(self._repository, trio.lowlevel.current_trio_token())
        try:
            await self._processes.start(self._specs(), self._link, "initialize")
        except BaseException:
            self._release_metrics()
            raise

    def _specs(self) -> Iterator[InstanceSpec]:
        for group in self._config.instance_group:
            gpu = group.kind == ModelInstanceGroup.KIND_GPU
            for index in range(group.count):
                yield self._spec(self._args(group, index, gpu))

    def _spec(self, args: dict[str, str]) -> InstanceSpec:
        gpu = (
            int(args["model_instance_device_id"]) if args["model_instance_kind"] == "GPU" else None
        )
        return self._processes.spec(
            args["model_instance_name"],
            _pb_launch.interpreter(self.parameters, self._model_dir.parent),
            gpu,
            {
                "args": args,
                "name": self.name,
                "version": self.versions[0],
                "model_file": str(self._model_file),
                "module": model_module_name(self.name, int(self.versions[0])),
                "model_dir": str(self._model_dir),
                "repository": str(self._folder.parent),
                "decoupled": self.decoupled,
                "iterative": self.iterative,
            },
        )

    async def execute(self, requests: Sequence[InferenceRequest]) -> Sequence[Result]:  # type: ignore[override]
        return await self._processes.execute(requests)

    async def unload(self) -> None:  # type: ignore[override]
        try:
            await self._processes.stop()
        finally:
            self._release_metrics()


def read_python(reading: Reading) -> list[Model]:
    """A folder's python-backend models, one per version (``_backends``' row): each
    instance in a process of its own, or in a thread of the server (``PythonOptions``
    and the model's ``TRIOSERVE_INSTANCE_MODE``)."""
    config, folder, strict = reading.config, reading.folder, reading.strict
    versions = chosen_versions(config, folder)
    folders = version_folders(folder)
    files = {
        v: (reading.model_file(folders[v]), model_module_name(folder.name, v)) for v in versions
    }
    python = reading.python or PythonOptions()
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    in_processes = python.mode_of(parameters, folder.name) == "process"
    document = None if strict else config_document(config)
    classes: dict[int, type] = {}
    try:
        if in_processes:
            document = _inspected(folder, parameters, list(files.values()), document)
        else:
            classes = {v: import_model_class(*files[v], folder.name) for v in versions}
            if document is not None:
                auto_complete(classes[versions[-1]], document, folder / CONFIG_FILE, folder.name)
    except ModelFileError as exc:
        raise ConfigError(str(exc)) from None
    if document is not None:
        completed_config(config, document, folder / CONFIG_FILE)
    if not config.default_model_filename:
        config.default_model_filename = "model.py"  # what Triton's python backend names
    complete_config(config, folder)
    settings = model_settings(config, folder)
    repository, metrics = reading.repository, reading.metrics

    def made(version: int) -> Model:
        place = (folders[version].parent, version, repository, metrics, files[version][0])
        if in_processes:
            return ProcessBackendModel(None, config, *place, options=python, **settings)
        return PythonBackendModel(classes[version], config, *place, **settings)

    return [made(v) for v in versions]


def _inspected(
    folder: Path,
    parameters: dict[str, str],
    files: list[tuple[Path, str]],
    document: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """What a process of the model's own, under its interpreter, finds of its files
    (``_pb_inspect``): the config's form completed (None if ``document`` was), or the
    ``ConfigError`` that keeps it from loading. The server imports none of them."""
    try:
        python = _pb_launch.interpreter(parameters, folder)
    except FileNotFoundError as exc:
        raise ConfigError(f"model '{folder.name}': {exc}") from None
    asked = {
        "model": folder.name,
        "files": [[str(p), m] for p, m in files],
        "config": document,
        "config_file": str(folder / CONFIG_FILE),
    }
    done = subprocess.run(
        _pb_launch.command(python, INSPECT),
        input=json.dumps(asked).encode(),
        stdout=subprocess.PIPE,
        env=_pb_launch.environment(None),
        check=False,
    )
    try:
        reply = json.loads(done.stdout)
    except ValueError:
        ended = _pb_launch.how_it_ended(done.returncode)
        raise ConfigError(f"model '{folder.name}': {ended} while it imported model.py") from None
    if "error" in reply:
        raise ConfigError(reply["error"])
    completed: dict[str, Any] | None = reply["config"]
    return completed
