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

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from .._errors import UnsupportedError
from .._load_facts import KVCacheState
from .._served import ServedModel
from ..tracing import Trace
from ._sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


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

    @property
    def max_num_seqs(self) -> int:
        """The most sequences the engine runs at once: a request's ``n`` at most."""
        ...


def generative(served: ServedModel) -> GenerativeServed:
    """``served`` as a generative model, or the error a generate call on it answers."""
    if not isinstance(served, GenerativeServed):
        raise UnsupportedError(f"model '{served.model.name}' is not a generative model")
    return served
