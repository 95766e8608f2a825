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
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from google.protobuf import json_format

from .._errors import InferenceServerError, InternalError
from .._model import MODEL_INSTANCE, Model, ResponseOutputs, Result
from .._model_code import model_failure, raise_failure
from .._served import ModelRepository
from .._types import InferenceRequest
from . import _pb_utils as pb_utils
from ._config import ConfigError, config_document, config_json
from ._generated.model_config_pb2 import ModelConfig, ModelInstanceGroup
from ._pb_execution import (
    call_hook,
    checked_responses,
    failure_texts,
    run_execute,
)
from ._pb_link import ServerLink
from ._pb_loop import InstanceLoop
from ._pb_metrics import serving_metrics
from ._pb_metrics_export import CustomMetrics
from ._pb_serving import Serving, serving

logger = logging.getLogger("trioserve.python_backend")


def model_module_name(model_name: str, version: int) -> str:
    return f"trioserve_python_models.{model_name}.v{version}"


def completed_config(config: ModelConfig, document: dict[str, Any], path: Path) -> None:
    """Take the config's JSON form as ``auto_complete_config`` completed it."""
    completed = ModelConfig()
    try:
        json_format.ParseDict(document, completed)
    except json_format.ParseError as exc:
        raise ConfigError(f"{path}: auto_complete_config made an invalid config: {exc}") from None
    config.CopyFrom(completed)


@dataclass(slots=True)
class _Instance:
    """One ``TritonPythonModel`` object, its name and its asyncio loop."""

    model: Any
    name: str
    loop: InstanceLoop


class PythonBackendModel(Model):
    """One version of a Python-backend model."""

    def __init__(
        self,
        model_class: type | None,  # None: the model's code runs in processes of its own
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
        self._model_file = model_file
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
                responses = run_execute(
                    instance.model,
                    instance.loop,
                    served,
                    self.decoupled,
                    lambda exc: self._failed_later(instance, exc, served),
                )
            except Exception as exc:
                raise self._failure(instance, exc) from exc
            outcomes = checked_responses(
                self.name, self.decoupled, self.iterative, served, responses
            )
        return self._outputs(requests, outcomes)

    def described_config(self) -> dict[str, Any]:
        return self._document

    @property
    def iterative(self) -> bool:
        """Whether the model's requests may be rescheduled (iterative sequences)."""
        return self.sequence_batching is not None and self.sequence_batching.iterative_sequence

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
                        assert self._class is not None
                        instance.model = self._class()
                        call_hook(instance.loop, getattr(instance.model, "initialize", None), args)
                    except BaseException as exc:
                        instance.loop.stop()
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
                    try:
                        call_hook(instance.loop, getattr(instance.model, "finalize", None))
                    except BaseException as exc:
                        raise_failure(exc, self.name, "in finalize")
                    finally:
                        instance.loop.stop()
        finally:
            self._release_metrics()

    def stopped_serving(self) -> None:
        """The repository stopped serving this version (its unload comes after): its
        custom metrics leave the server's ``/metrics`` now."""
        self._release_metrics()

    def _release_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.release(self)

    def _failed_later(
        self, instance: _Instance, exc: BaseException, served: list[pb_utils.InferenceRequest]
    ) -> None:
        """A decoupled model's ``async`` execute failed after the batch was handed back:
        the requests it had not answered get the error."""
        failure = self._failure(instance, model_failure(exc, self.name, "in execute"))
        for request in served:
            if request._sender is not None:
                with contextlib.suppress(InferenceServerError):
                    request._sender.send(failure, final=True)

    def _failure(self, instance: _Instance, exc: Exception) -> InferenceServerError:
        """What ``execute`` raised, as Triton words it, logged once for the batch."""
        if isinstance(exc, InferenceServerError):
            return exc
        logged, told = failure_texts(instance.name, exc, self._folder.parent)
        logger.error("model '%s' version %s: %s", self.name, self.versions[0], logged)
        return InternalError(told)

    def _outputs(
        self,
        requests: Sequence[InferenceRequest],
        outcomes: list[pb_utils.InferenceResponse | None],
    ) -> list[Result]:
        results: list[Result] = []
        # A decoupled model's outcomes are empty unless it rescheduled a request.
        for request, response in zip(requests, outcomes, strict=False):
            if response is None:  # rescheduled: it runs again, nothing to answer yet
                request.rescheduled = True
                results.append({})
                continue
            error = response.error()
            if error is not None:
                results.append(pb_utils.server_error(error))
            else:
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
                parameters = json.loads(response.parameters())
                results.append(ResponseOutputs(outputs, parameters) if parameters else outputs)
        return results
