"""What the front ends of a generative model exchange with its engine.

A front end (REST generate / generate_stream, OIP infer with ``text_input``, gRPC
ModelStreamInfer) turns its wire form into a ``GenerationRequest`` and reads the answer
as ``GenerationChunk`` values::

    served = generative(repository.get(name, version))
    async with served.generate(request) as chunks:
        async for chunk in chunks:
            ...  # one chunk per sample per engine step that produced text

Leaving the ``async with`` block before the last chunk (a client disconnect, a
cancellation) aborts the request: the engine frees its KV blocks at once and counts it
as finished with reason ``abort``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from .._errors import InvalidArgumentError, UnsupportedError
from .._load_facts import KVCacheState
from .._repository import ServedModel
from ..tracing import Trace

FinishReason = Literal["stop", "length", "abort"]
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs may list (OpenAI's limit)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample (vLLM's names and defaults). ``temperature == 0`` is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    # Each output token's log-probability and this many of the most likely ones beside
    # it (None: none; the OpenAI front end sets it).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidArgumentError("max_tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgumentError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise InvalidArgumentError("top_k must be -1 (all tokens) or >= 0")
        if self.n < 1:
            raise InvalidArgumentError("n must be at least 1")
        if any(not s for s in self.stop):
            raise InvalidArgumentError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgumentError(f"logprobs must be in [0, {MAX_LOGPROBS}]")

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any]) -> SamplingParams:
        """Read the sampling keys of a request's ``parameters``; other keys are ignored."""
        settings: dict[str, Any] = {}
        for key, kind in _PARAMETER_KINDS.items():
            if key not in parameters:
                continue
            value = parameters[key]
            if key == "stop" and isinstance(value, str):
                value = [value]
            if key == "seed" and value is None:
                continue
            settings[key] = _checked(key, value, kind)
        return cls(**settings)


_PARAMETER_KINDS: dict[str, str] = {
    "max_tokens": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "seed": "int",
    "stop": "strings",
    "ignore_eos": "bool",
    "n": "int",
}


def _checked(key: str, value: Any, kind: str) -> Any:
    if kind == "int" and type(value) is int:
        return value
    if kind == "float" and type(value) in (int, float):
        return float(value)
    if kind == "bool" and type(value) is bool:
        return value
    if kind == "strings" and isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    expected = {"int": "an integer", "float": "a number", "bool": "a boolean"}.get(
        kind, "a string or a list of strings"
    )
    raise InvalidArgumentError(f"parameter '{key}' must be {expected}")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt: str
    sampling: SamplingParams
    arrival_time: float  # trio.current_time() when the front end received the request
    priority: int = 0  # lower values are scheduled first (vLLM's convention)
    # The prompt already tokenized (a front end that counts or takes token ids): the
    # engine then uses these instead of encoding ``prompt``.
    prompt_token_ids: tuple[int, ...] | None = None
    trace: Trace | None = field(default=None, repr=False, compare=False)  # ended by the engine


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """An output token's natural-log probability under the model's logits as they are
    (before temperature, top-k and top-p, as vLLM reports them), and the most likely
    tokens at its place, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob)


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    """New output of one sample since its previous chunk."""

    index: int  # which of the request's ``n`` samples
    text: str  # the newly decoded text (may be "" while a multi-byte character is pending)
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None  # set on the sample's last chunk only
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when asked for


@runtime_checkable
class GenerativeServed(ServedModel, Protocol):
    """A served model version backed by the continuous-batching engine."""

    def generate(
        self, request: GenerationRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[GenerationChunk]]: ...

    def kv_cache_state(self) -> KVCacheState: ...


def generative(served: ServedModel) -> GenerativeServed:
    """``served`` as a generative model, or the error a generate call on it answers."""
    if not isinstance(served, GenerativeServed):
        raise UnsupportedError(f"model '{served.model.name}' is not a generative model")
    return served
