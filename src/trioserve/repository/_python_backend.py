"""Triton's Python backend: a version's ``model.py`` with ``class TritonPythonModel``.

One ``TritonPythonModel`` object per model instance, as in Triton: ``initialize(args)``
when the version loads (Triton's ``args`` keys, every value a string), ``execute(requests)``
for each batch, one ``pb_utils.InferenceRequest`` per request of the batch, and
``finalize()`` when it unloads. A plain ``execute`` runs in a worker thread, an ``async``
one in trio. An exception from ``execute`` fails every request of the batch; a response
carrying an error fails its own request. A decoupled model's ``execute`` returns None
and answers through ``request.get_response_sender()``, from any thread, even after it
returned.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Awaitable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from .._errors import InferenceServerError, InternalError
from .._model import MODEL_INSTANCE, Model, ResponseOutputs, Result
from .._model_code import failure_text, model_failure, raise_failure
from .._repository import ModelRepository
from .._types import InferenceRequest
from . import _pb_utils as pb_utils
from ._config import ConfigError, config_document, config_json
from ._generated.model_config_pb2 import ModelConfig, ModelInstanceGroup
from ._pb_metrics import CustomMetrics, serving_metrics

MODULE_NAME = "triton_python_backend_utils"


def import_model_file(path: Path, model_name: str, version: int) -> type:
    """Import a model.py and return its ``TritonPythonModel`` class."""
    # Models import the utilities by Triton's name; ours stands in for it.
    sys.modules.setdefault(MODULE_NAME, pb_utils)
    spec = importlib.util.spec_from_file_location(
        f"trioserve_python_models.{model_name}.v{version}", path
    )
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # sys.exit or argparse at import fails this load only
        failure = model_failure(exc, model_name, "at import")
        raise ConfigError(f"{path}: failed to import: {failure_text(failure)}") from None
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


class PythonBackendModel(Model):
    """One version of a Python-backend model."""

    def __init__(
        self,
        model_class: type,
        config: ModelConfig,
        folder: Path,
        version: int,
        repository: ModelRepository,
        metrics: CustomMetrics | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(versions=(str(version),), **settings)
        self._class = model_class
        self._config = config
        self._folder = folder
        self._repository = repository
        self._metrics = metrics
        self._instances: list[Any] = []  # by index: the runner's model instances
        self._document = config_document(config)
        self._async = inspect.iscoroutinefunction(model_class.execute)  # type: ignore[attr-defined]

    @property
    def is_async(self) -> bool:
        return self._async

    def execute(
        self, requests: Sequence[InferenceRequest]
    ) -> Sequence[Result] | Awaitable[Sequence[Result]]:
        """The instance's responses; awaitable when its ``execute`` is ``async def``."""
        if self._async:
            return self._execute_async(requests)
        return self._execute_sync(requests)

    def described_config(self) -> dict[str, Any]:
        return self._document

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        """What the model's code reaches through pb_utils while it runs: the repository
        its BLS requests go to, the server's custom metrics."""
        token = pb_utils.serving_repository.set(self._repository)
        metrics = None if self._metrics is None else serving_metrics.set((self._metrics, self))
        try:
            yield
        finally:
            if metrics is not None:
                serving_metrics.reset(metrics)
            pb_utils.serving_repository.reset(token)

    def load(self) -> None:
        """Create and initialize one instance per count of each instance group."""
        with self._serving():
            for group in self._config.instance_group:
                gpu = group.kind == ModelInstanceGroup.KIND_GPU
                for index in range(group.count):
                    try:
                        instance = self._class()
                        initialize = getattr(instance, "initialize", None)
                        if initialize is not None:
                            initialize(self._args(group, index, gpu))
                    except BaseException as exc:
                        raise_failure(exc, self.name, "in initialize")
                    self._instances.append(instance)

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
                    finalize = getattr(instance, "finalize", None)
                    if finalize is not None:
                        try:
                            finalize()
                        except BaseException as exc:
                            raise_failure(exc, self.name, "in finalize")
        finally:
            if self._metrics is not None:
                self._metrics.release(self)

    def _execute_sync(self, requests: Sequence[InferenceRequest]) -> list[Result]:
        instance = self._instances[MODEL_INSTANCE.get()]  # running one batch at a time
        with self._serving():
            served = [pb_utils.InferenceRequest._served(r) for r in requests]
            try:
                responses = instance.execute(served)
            except Exception as exc:
                raise self._failure(exc) from exc
        return self._outputs(requests, responses)

    async def _execute_async(self, requests: Sequence[InferenceRequest]) -> list[Result]:
        instance = self._instances[MODEL_INSTANCE.get()]
        with self._serving():
            served = [pb_utils.InferenceRequest._served(r) for r in requests]
            try:
                responses = await instance.execute(served)
            except Exception as exc:
                raise self._failure(exc) from exc
        return self._outputs(requests, responses)

    def _failure(self, exc: Exception) -> InferenceServerError:
        if isinstance(exc, InferenceServerError):
            return exc
        return InternalError(
            f"Failed to process the request(s) for model '{self.name}', message: "
            f"{type(exc).__name__}: {exc}"
        )

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
