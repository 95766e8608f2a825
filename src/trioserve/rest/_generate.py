"""Triton's generate extension: ``generate`` (one JSON answer) and ``generate_stream`` (SSE),
on a generative model (the engine's); any other model takes its own tensors
(``_generate_tensors``).

Request (both endpoints)::

    {"id"?: str, "text_input": str, "parameters"?: {...}, <sampling key>?: value, ...}

Sampling keys (vLLM's names, as the sampling-parameter table lists them for the
``vllm`` dialect: max_tokens, temperature, top_p, top_k, seed, stop, ..., and priority)
are read from ``parameters`` and checked by that table. As in Triton, where any other
top-level key is passed to the model as a parameter (or an input of that name), the
top-level keys besides ``id``, ``text_input`` and ``parameters`` join ``parameters`` (a
key given in both places is an error). Keys the table does not know are ignored: clients
send e.g. ``stream`` (litellm, at the top level), ``bad_words`` and ``stop_words``
(TensorRT-LLM's inputs); which endpoint was called decides streaming.

``generate`` answers ``{"id"?, "model_name", "model_version", "text_output",
"finish_reason"}``. With ``n > 1`` both are arrays in sample order, the shape Triton's
vLLM backend gives an output with one element per sample.

``generate_stream`` answers ``text/event-stream; charset=utf-8``, one ``data: <json>``
event per piece of new text: ``{"id"?, "model_name", "model_version", "text_output":
<new text>}``, with ``"index"`` (which sample) when ``n > 1`` and ``"finish_reason"`` on
a sample's last event. The stream simply ends after the last event (no ``[DONE]``). An
error before the first piece of text is an ordinary JSON error response; a later one is
a ``data: {"error": ...}`` event under the 200 already sent.

A client that goes away aborts its request: the generation's cancel scope is registered
with the request's ``cancel_with`` (the HTTP server's hangup watch, or a ``receive()``
watcher where it has none), and the ``generate()`` block then exits early.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from .._context import ServerContext
from .._errors import InferenceServerError, InvalidArgumentError
from .._pipeline import InferencePipeline
from .._served import ServedModel
from ..scheduler import (
    TEXT_INPUT,
    GenerationChunk,
    GenerationRequest,
    GenerativeServed,
    TokenLogprob,
    read_parameters,
)
from ._app import Request, Response
from ._generate_events import (
    json_answer,
    send_event,
    stream_end,
    stream_start,
    unless_client_leaves,
)
from ._generate_tensors import TensorGenerate
from ._json_body import json_object

logger = logging.getLogger("trioserve.rest")

# The request's own keys; every other top-level key is a parameter.
_REQUEST_KEYS = frozenset({"id", TEXT_INPUT, "parameters"})


class GenerateEndpoints:
    def __init__(self, context: ServerContext) -> None:
        self.repository = context.repository
        self.pipeline = context.pipeline  # builds the engine's requests and runs them
        self.load = context.load  # the answers' load reports
        self._tensors = TensorGenerate(context)  # for the models that are not generative

    async def generate(self, request: Request) -> Response | None:
        served = self._served(request)
        if not isinstance(served, GenerativeServed):
            return await self._tensors.generate(request, served)
        generation, head = self._prepare(request, served)

        async def collect() -> dict[str, Any]:
            samples = await collect_samples(self.pipeline, served, generation)
            if generation.sampling.n == 1:
                return {
                    **head,
                    "text_output": samples.texts[0],
                    "finish_reason": samples.finish_reasons[0],
                }
            return {**head, "text_output": samples.texts, "finish_reason": samples.finish_reasons}

        answered, document = await unless_client_leaves(request.cancel_with, collect)
        return json_answer(self.load, served, request, document) if answered else None

    async def generate_stream(self, request: Request) -> Response | None:
        served = self._served(request)
        if not isinstance(served, GenerativeServed):
            return await self._tensors.generate_stream(request, served)
        generation, head = self._prepare(request, served)
        with_index = generation.sampling.n > 1
        send = request.send

        async def stream() -> None:
            async with self.pipeline.generate(served, generation) as chunks:
                pieces = aiter(chunks)
                # Wait for the first piece before answering, so that a request the engine
                # refuses gets an ordinary error response with its status.
                piece = await next_piece(pieces)
                await send(stream_start(self.load, served, request))
                try:
                    while piece is not None:
                        await send_event(send, _event(head, piece, with_index))
                        piece = await next_piece(pieces)
                except InferenceServerError as exc:
                    await send_event(send, {"error": exc.message})
                except Exception:
                    logger.exception("generation %s failed", generation.request_id)
                    await send_event(send, {"error": "generation failed unexpectedly"})

        answered, _ = await unless_client_leaves(request.cancel_with, stream)
        if answered:
            await send(stream_end())
        return None

    def _served(self, request: Request) -> ServedModel:
        return self.repository.get(request.params["model"], request.params.get("version", ""))

    def _prepare(
        self, request: Request, served: GenerativeServed
    ) -> tuple[GenerationRequest, dict[str, Any]]:
        """The engine's request, and the keys every answer starts with."""
        document = _parse(request.body)
        parameters = read_parameters(
            _parameters(document), "vllm", max_num_seqs=served.max_num_seqs
        )
        generation = self.pipeline.generation_request(
            "http", served, document.get(TEXT_INPUT), parameters, request.headers
        )
        head: dict[str, Any] = {}
        if "id" in document:
            if not isinstance(document["id"], str):
                raise InvalidArgumentError("request 'id' must be a string")
            head["id"] = document["id"]
        head["model_name"] = served.model.name
        head["model_version"] = served.version
        return generation, head


@dataclass(frozen=True, slots=True)
class CollectedSamples:
    """A whole generation: each sample's text and finish reason, and the tokens made."""

    texts: list[str]
    finish_reasons: list[str | None]
    generated_tokens: int
    logprobs: list[list[TokenLogprob]]  # each sample's, when the request asked for them


async def collect_samples(
    pipeline: InferencePipeline, served: GenerativeServed, generation: GenerationRequest
) -> CollectedSamples:
    n = generation.sampling.n
    texts: list[list[str]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    tokens = 0
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    async with pipeline.generate(served, generation) as chunks:
        async for chunk in chunks:
            texts[chunk.index].append(chunk.text)
            tokens += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                reasons[chunk.index] = chunk.finish_reason
            if chunk.logprobs is not None:
                logprobs[chunk.index].extend(chunk.logprobs)
    return CollectedSamples(["".join(parts) for parts in texts], reasons, tokens, logprobs)


def _parse(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    document = json_object(body)
    if TEXT_INPUT not in document:
        raise InvalidArgumentError(f"the request must carry '{TEXT_INPUT}'")
    return document


def _parameters(document: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` with the other keys given at the top level added."""
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgumentError("request 'parameters' must be a JSON object")
    top_level = {key: document[key] for key in document.keys() - _REQUEST_KEYS}
    both = top_level.keys() & parameters.keys()
    if both:
        raise InvalidArgumentError(
            f"{sorted(both)} given both at the top level and in 'parameters'"
        )
    return {**parameters, **top_level}


async def next_piece(chunks: AsyncIterator[GenerationChunk]) -> GenerationChunk | None:
    """The next chunk worth an event (new text, or a sample's end), None after the last.
    An empty chunk only means that a multi-byte character is not complete yet."""
    async for chunk in chunks:
        if chunk.text or chunk.finish_reason is not None:
            return chunk
    return None


def _event(head: dict[str, Any], chunk: GenerationChunk, with_index: bool) -> dict[str, Any]:
    event = {**head, "text_output": chunk.text}
    if with_index:
        event["index"] = chunk.index
    if chunk.finish_reason is not None:
        event["finish_reason"] = chunk.finish_reason
    return event
