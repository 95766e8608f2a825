"""A generative served model for load-report tests: the engine is not under test here."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio

import trioserve
from trioserve import InferenceRequest, InferenceResponse, TensorSpec
from trioserve._load_facts import LoadFacts
from trioserve._stats import ModelStatistics
from trioserve.scheduler._generation import (
    GenerationChunk,
    GenerationRequest,
    GenerativeServed,
    KVCacheState,
)
from trioserve.scheduler._runner import ModelRunner
from trioserve.scheduler._ticket import Ticket


class KVEngineDouble:
    """A ``GenerativeServed`` whose KV cache is what the test sets.

    ``infer`` goes through a real ``ModelRunner`` of an echo model (what OIP infer on a
    generative model looks like from a front end); ``kv`` may be set to an exception,
    which ``kv_cache_state`` raises, or to anything else, which it returns.
    """

    def __init__(self, name: str, kv: Any) -> None:
        @trioserve.model(
            name=name,
            inputs=[TensorSpec("text_input", "BYTES", [1])],
            outputs=[TensorSpec("text_output", "BYTES", [1])],
        )
        async def echo(text_input: np.ndarray[Any, Any]) -> dict[str, Any]:
            return {"text_output": text_input}

        self._runner = ModelRunner(echo, "1")
        self.model = echo
        self.version = "1"
        self.kv = kv
        self.max_num_seqs = 1

    @property
    def ready(self) -> bool:
        return self._runner.ready

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self._runner.run(task_status=task_status)

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        return await self._runner.infer(request)

    def admit(self) -> None:
        self._runner.admit()

    def submit(self, request: InferenceRequest) -> Ticket:
        return self._runner.submit(request)

    def inference_statistics(self) -> ModelStatistics:
        return self._runner.inference_statistics()

    @asynccontextmanager
    async def generate(
        self, request: GenerationRequest
    ) -> AsyncIterator[AsyncIterator[GenerationChunk]]:
        async def chunks() -> AsyncIterator[GenerationChunk]:
            yield GenerationChunk(0, request.prompt, (), "stop")

        yield chunks()

    def load_facts(self) -> LoadFacts:
        return LoadFacts(kv_cache=self.kv_cache_state)

    def kv_cache_state(self) -> KVCacheState:
        if isinstance(self.kv, BaseException):
            raise self.kv
        return self.kv  # type: ignore[no-any-return]


@pytest.fixture
def kv_engine() -> Callable[..., KVEngineDouble]:
    def make(kv: Any, name: str = "llm") -> KVEngineDouble:
        engine = KVEngineDouble(name, kv)
        assert isinstance(engine, GenerativeServed)
        return engine

    return make
