"""Triton's Python backend: a version's ``model.py`` with ``class TritonPythonModel``.

One ``TritonPythonModel`` object per model instance, as in Triton: ``initialize(args)``
when the version loads (Triton's ``args`` keys, every value a string), ``execute(requests)``
for each batch, one ``pb_utils.InferenceRequest`` per request of the batch, and
``finalize()`` when it unloads. ``execute`` runs in a worker thread; an ``async`` one
(and an ``async`` ``initialize`` or ``finalize``, which Triton would not await) runs on
the instance's own asyncio loop (``_pb_loop``), the worker thread waiting for it as
Triton's stub does, except for a decoupled model, whose ``async`` execute runs on while
the instance takes its next batch (Triton's behaviour too). Model code reaches the server
(BLS, model control) only through ``_pb_link.ServerLink``, so that it could run in
another process.

An exception from ``execute`` fails every request of the batch with Triton's message
(its type, message and the model's traceback, innermost frame first) and is logged once
at ERROR; a response carrying an error fails its own request. A decoupled model's
``execute`` returns None and answers through ``request.get_response_sender()``, from any
thread, even after it returned.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import sys
import traceback
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import trio

from .._errors import InferenceServerError, InternalError
from .._model import MODEL_INSTANCE, Model, ResponseOutputs, Result
from .._model_code import import_model_code, model_failure, raise_failure
from .._served import ModelRepository
from .._types import InferenceRequest
from . import _pb_utils as pb_utils
from ._config import (
    CONFIG_FILE,
    ConfigError,
    complete_config,
    config_document,
    config_json,
    model_settings,
)
from ._generated.model_config_pb2 import ModelConfig, ModelInstanceGroup
from ._layout import Reading, chosen_versions, version_folders
from ._pb_link import ServerLink, Serving, serving
from ._pb_loop import InstanceLoop
from ._pb_metrics import CustomMetrics, serving_metrics

MODULE_NAME = "triton_python_backend_utils"
logger = logging.getLogger("trioserve.python_backend")
# Frames of these folders are the server's, not the model's: a traceback leaves them out.
_SERVER_FILES = (
    str(Path(__file__).parents[1]),
    str(Path(inspect.getfile(Future)).parents[2] / "asyncio"),
    str(Path(inspect.getfile(Future)).parents[1]),
)


def import_model_file(path: Path, model_name: str, version: int) -> type:
    """Import a model.py and return its ``TritonPythonModel`` class."""
    # Models import the utilities by Triton's name; ours stands in for it.
    sys.modules.setdefault(MODULE_NAME, pb_utils)
    module_name = f"trioserve_python_models.{model_name}.v{version}"
    module = import_model_code(path, module_name, model_name, ConfigError)
    return _model_class(module, path)


def _model_class(module: ModuleType, path: Path) -> type:
    found = getattr(module, "TritonPythonModel", None)
    if not isinstance(found, type):
        raise ConfigError(f"{path}: defines no class 'TritonPythonModel'")
    if not callable(getattr(found, "execute", None)):
        raise ConfigError(f"{path}: TritonPythonModel has no 'execute' method")
    return found


def auto_complete(model_class: type, config: ModelConfig, path: Path) -> None:
    """Let the model's ``auto_complete_config`` fill in the config, as Triton does when
    the config is not strict."""
    hook = getattr(model_class, "auto_complete_config", None)
    if hook is None:
        return
    try:
        returned = hook(pb_utils.ModelConfig(config))
    except BaseException as exc:
        failure = model_failure(exc, config.name or path.parent.name, "in auto_complete_config")
        raise ConfigError(f"{path}: auto_complete_config failed: {failure}") from None
    if not isinstance(returned, pb_utils.ModelConfig):
        raise ConfigError(f"{path}: auto_complete_config must return the config it received")


@dataclass(slots=True)
class _Instance:
    """One ``TritonPythonModel`` object, its name and its asyncio loop."""

    model: Any
    name: str
    loop: InstanceLoop


def read_python(reading: Reading) -> list[Model]:
    """A folder's python-backend models, one per version (``_backends``' row)."""
    config, folder, strict = reading.config, reading.folder, reading.strict
    versions = chosen_versions(config, folder)
    folders = version_folders(folder)
    files = {v: reading.model_file(folders[v]) for v in versions}
    classes = {v: import_model_file(files[v], folder.name, v) for v in versions}
    if not strict:
        auto_complete(classes[versions[-1]], config, folder / CONFIG_FILE)
    if not config.default_model_filename:
        config.default_model_filename = "model.py"  # what Triton's python backend names
    complete_config(config, folder)
    settings = model_settings(config, folder)
    repository, metrics = reading.repository, reading.metrics
    return [
        PythonBackendModel(
            classes[v], config, folders[v].parent, v, repository, metrics, files[v], **settings
        )
        for v in versions
    ]


class PythonBackendModel(Model):
    """One version of a Python-backend model."""

    def __init__(
        self,
        model_class: type,
        config: ModelConfig,
        folder: Path,
        version: int,
        repository: ModelRepository,
        metrics: CustomMetrics | None,
        model_file: Path,
        **settings: Any,
    ) -> None:
        super().__init__(versions=(str(version),), **settings)
        self._class = model_class
        self._config = config
        self._folder = folder
        self._model_dir = model_file.parent
        self._repository = repository
        self._metrics = metrics
        self._link: ServerLink | None = None  # made at load, in a trio worker thread
        self._instances: list[_Instance] = []  # by index: the runner's model instances
        self._document = config_document(config)

    def execute(self, requests: Sequence[InferenceRequest]) -> Sequence[Result]:
        """The instance's responses (in a worker thread)."""
        instance = self._instances[MODEL_INSTANCE.get()]  # running one batch at a time
        with self._serving():
            served = [pb_utils.InferenceRequest._served(r) for r in requests]
            try:
                responses = instance.model.execute(served)
                if inspect.isawaitable(responses):
                    if self.decoupled:  # runs on; the instance takes its next batch
                        self._in_background(instance, responses, served)
                        return []
                    responses = instance.loop.run(_coroutine(responses))
            except Exception as exc:
                raise self._failure(instance, exc) from exc
        return self._outputs(requests, responses)

    def described_config(self) -> dict[str, Any]:
        return self._document

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        """What the model's code reaches through pb_utils while it runs: the server its
        BLS requests go to, the server's custom metrics."""
        assert self._link is not None, "the model is not loaded"
        token = serving.set(Serving(self._link, self._model_dir))
        metrics = None if self._metrics is None else serving_metrics.set((self._metrics, self))
        try:
            yield
        finally:
            if metrics is not None:
                serving_metrics.reset(metrics)
            serving.reset(token)

    def load(self) -> None:
        """Create and initialize one instance per count of each instance group."""
        self._link = ServerLink(
            self._repository, trio.from_thread.run_sync(trio.lowlevel.current_trio_token)
        )
        with self._serving():
            for group in self._config.instance_group:
                gpu = group.kind == ModelInstanceGroup.KIND_GPU
                for index in range(group.count):
                    args = self._args(group, index, gpu)
                    name = args["model_instance_name"]
                    instance = _Instance(None, name, InstanceLoop(name))
                    try:
                        instance.model = self._class()
                        self._call(instance, getattr(instance.model, "initialize", None), args)
                    except BaseException as exc:
                        instance.loop.stop()
                        raise_failure(exc, self.name, "in initialize")
                    self._instances.append(instance)

    @staticmethod
    def _call(instance: _Instance, hook: Callable[..., Any] | None, *args: Any) -> None:
        """Call ``initialize`` or ``finalize``; an ``async`` one runs on the instance's loop."""
        if hook is not None:
            returned = hook(*args)
            if inspect.isawaitable(returned):
                instance.loop.run(_coroutine(returned))

    def _args(self, group: Any, index: int, gpu: bool) -> dict[str, str]:
        return {
            "model_config": config_json(self._config),
            "model_instance_kind": "GPU" if gpu else "CPU",
            "model_instance_name": f"{group.name}_{index}",
            "model_instance_device_id": str(group.gpus[index % len(group.gpus)] if gpu else 0),
            "model_repository": str(self._folder),
            "model_version": self.versions[0],
            "model_name": self.name,
        }

    def unload(self) -> None:
        instances, self._instances = self._instances, []
        try:
            with self._serving():
                for instance in instances:
                    try:
                        self._call(instance, getattr(instance.model, "finalize", None))
                    except BaseException as exc:
                        raise_failure(exc, self.name, "in finalize")
                    finally:
                        instance.loop.stop()
        finally:
            if self._metrics is not None:
                self._metrics.release(self)

    def _in_background(
        self, instance: _Instance, work: Awaitable[Any], served: list[pb_utils.InferenceRequest]
    ) -> None:
        """Run a decoupled model's ``async`` execute on its loop without waiting for it;
        if it fails, the requests it had not answered get the error."""

        def ended(future: Future[Any]) -> None:
            exc = None if future.cancelled() else future.exception()
            if isinstance(exc, BaseException):
                failure = self._failure(instance, model_failure(exc, self.name, "in execute"))
                for request in served:
                    if request._sender is not None:
                        with contextlib.suppress(InferenceServerError):
                            request._sender.send(failure, final=True)

        instance.loop.submit(_coroutine(work)).add_done_callback(ended)

    def _failure(self, instance: _Instance, exc: Exception) -> InferenceServerError:
        """What ``execute`` raised, as Triton words it, logged once for the batch."""
        if isinstance(exc, InferenceServerError):
            return exc
        failed = f"Failed to process the request(s) for model instance '{instance.name}', message: "
        logger.error(
            "model '%s' version %s: %s%s", self.name, self.versions[0], failed, _described(exc)
        )
        # The client reads the model's own frames by their place in the repository: the
        # server's folders are not its business.
        return InternalError(failed + _described(exc, self._folder.parent))

    def _outputs(self, requests: Sequence[InferenceRequest], responses: Any) -> list[Result]:
        if self.decoupled:
            if responses is not None:
                raise InternalError(
                    f"model '{self.name}' is decoupled: execute must return None and answer "
                    "through each request's response sender"
                )
            return []
        if not isinstance(responses, list | tuple) or len(responses) != len(requests):
            count = len(responses) if isinstance(responses, list | tuple) else "no list of"
            raise InternalError(
                f"model '{self.name}': execute returned {count} responses for "
                f"{len(requests)} requests"
            )
        results: list[Result] = []
        for response in responses:
            if not isinstance(response, pb_utils.InferenceResponse):
                raise InternalError(
                    f"model '{self.name}': execute returned {type(response).__name__}, "
                    "not an InferenceResponse"
                )
            error = response.error()
            if error is not None:
                results.append(pb_utils.server_error(error))
            else:
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
                parameters = json.loads(response.parameters())
                results.append(ResponseOutputs(outputs, parameters) if parameters else outputs)
        return results


async def _coroutine(work: Awaitable[Any]) -> Any:
    return await work


def _described(exc: Exception, repository: Path | None = None) -> str:
    """An exception as Triton's stub tells it: type, message, then "At:" and the model's
    frames, innermost first. Given the ``repository`` folder, only the frames of its files,
    named relative to it."""
    frames = []
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename)
        if frame.filename.startswith(_SERVER_FILES):
            continue
        if repository is not None:
            if not path.is_relative_to(repository):
                continue
            path = path.relative_to(repository)
        frames.append(f"  {path}({frame.lineno}): {frame.name}\n")
    text = f"{type(exc).__name__}: {exc}"
    return f"{text}\n\nAt:\n{''.join(frames)}" if frames else text
