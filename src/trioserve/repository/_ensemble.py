"""Ensembles (``platform: "ensemble"``): a pipeline of served models run as one model.

``ensemble_scheduling`` lists steps; each names a model (and version, -1 for the
latest), maps the ensemble's tensors to the model's inputs (``input_map``: model input
-> ensemble tensor) and its outputs back to ensemble tensors (``output_map``: model
output -> ensemble tensor). A request runs the steps as a graph: each starts, in trio,
as soon as the tensors it reads exist, and goes through its model's own runner (queued
and batched with that model's other requests, counted in its statistics). Tensors pass
from step to step as the same arrays, without copies.

A step that fails fails the request: ``in ensemble 'E', step 'M': <its error>``; the
steps still running are cancelled, as they are when the request's client gives up.
The ensemble's own statistics count its requests; each execution is one request's
whole graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from .._errors import InferenceServerError, InternalError
from .._model import Model, Result
from .._served import ModelRepository
from .._types import InferenceRequest, InputTensor, RequestedOutput
from ..tracing import infer_child
from ._config import CONFIG_FILE, ConfigError
from ._generated.model_config_pb2 import ModelConfig

PLATFORM = "ensemble"
_DEFAULT_INFLIGHT = 256  # requests an ensemble runs at once when the config says 0


@dataclass(frozen=True)
class EnsembleStep:
    model_name: str
    model_version: str  # "" for the latest
    input_map: dict[str, str]  # model input -> ensemble tensor
    output_map: dict[str, str]  # model output -> ensemble tensor


def ensemble_steps(config: ModelConfig, folder: Path) -> list[EnsembleStep]:
    """The config's steps, checked to form a graph from the ensemble's inputs to its
    outputs; ConfigError says where it does not."""
    where = folder / CONFIG_FILE
    steps = [
        EnsembleStep(
            step.model_name,
            "" if step.model_version <= 0 else str(step.model_version),  # -1 (or unset): latest
            dict(step.input_map),
            dict(step.output_map),
        )
        for step in config.ensemble_scheduling.step
    ]
    if not steps:
        raise ConfigError(f"{where}: field 'ensemble_scheduling.step': an ensemble needs steps")
    available = {tensor.name for tensor in config.input}
    remaining = list(steps)
    while remaining:  # the steps in an order that runs: each reads what exists
        runnable = [s for s in remaining if set(s.input_map.values()) <= available]
        if not runnable:
            missing = sorted(set().union(*(s.input_map.values() for s in remaining)) - available)
            raise ConfigError(
                f"{where}: ensemble tensors {missing} are read by a step but produced by none"
            )
        for step in runnable:
            available |= set(step.output_map.values())
            remaining.remove(step)
    unproduced = sorted({t.name for t in config.output} - available)
    if unproduced:
        raise ConfigError(f"{where}: ensemble outputs {unproduced} are produced by no step")
    return steps


class EnsembleModel(Model):
    """One version of an ensemble."""

    withdraw_cancels_execution = True

    def __init__(
        self,
        steps: Sequence[EnsembleStep],
        config: ModelConfig,
        version: int,
        repository: ModelRepository,
        document: dict[str, Any],
        **settings: Any,
    ) -> None:
        inflight = config.ensemble_scheduling.max_inflight_requests or _DEFAULT_INFLIGHT
        settings["instance_count"] = inflight  # each request is one execution of the graph
        super().__init__(versions=(str(version),), **settings)
        self.steps = tuple(steps)
        self._repository = repository
        self._document = document

    def described_config(self) -> dict[str, Any]:
        return self._document

    async def execute(self, requests: Sequence[InferenceRequest]) -> list[Result]:
        # Not batched at the ensemble: its steps' models batch.
        return [await self._run(request) for request in requests]

    async def _run(self, request: InferenceRequest) -> Result:
        tensors: dict[str, InputTensor] = dict(request.inputs)
        started: set[int] = set()
        failures: list[InferenceServerError] = []

        async with trio.open_nursery() as nursery:

            def launch() -> None:
                for index, step in enumerate(self.steps):
                    if index not in started and set(step.input_map.values()) <= set(tensors):
                        started.add(index)
                        nursery.start_soon(run_step, step)

            async def run_step(step: EnsembleStep) -> None:
                try:
                    await self._step(step, request, tensors)
                except InferenceServerError as exc:
                    failures.append(
                        type(exc)(f"in ensemble '{self.name}', step '{step.model_name}': {exc}")
                    )
                    nursery.cancel_scope.cancel()
                    return
                launch()

            launch()
        if failures:
            return failures[0]
        missing = [name for name in self.output_specs if name not in tensors]
        if missing:
            return InternalError(f"in ensemble '{self.name}', outputs {missing} were not produced")
        return {name: tensors[name].data for name in self.output_specs}

    async def _step(
        self, step: EnsembleStep, request: InferenceRequest, tensors: dict[str, InputTensor]
    ) -> None:
        inputs = {}
        for model_input, source in step.input_map.items():
            tensor = tensors[source]
            inputs[model_input] = InputTensor(
                model_input, tensor.datatype, tensor.shape, tensor.data
            )
        step_request = InferenceRequest(
            step.model_name,
            step.model_version,
            inputs,
            [RequestedOutput(name) for name in step.output_map],
            id=request.id,
            parameters=request.parameters,  # a sequence's id and flags go on, for one
        )
        served = self._repository.get(step.model_name, step.model_version)
        # A traced ensemble's steps are traced under it, as Triton's are.
        response = await infer_child(served, step_request, request.trace)
        for output in response.outputs:
            target = step.output_map[output.name]
            tensors[target] = InputTensor(target, output.datatype, output.shape, output.data)
