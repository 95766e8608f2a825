"""OpenAI-compatible endpoints for the generative models: the ones LLM clients speak.

    GET  /v1/models             every generative model (its name is the OpenAI model id)
    GET  /v1/models/{id}        one of them
    POST /v1/completions        a prompt (text or token ids) -> ``text_completion``
    POST /v1/chat/completions   messages, through the model's chat template -> ``chat.completion``

Requests go down the same path as Triton's generate: one ``GenerationRequest`` to the
model's engine, so the statistics extension, the vLLM and TRT-LLM families and ORCA
count them alike (the ORCA header comes on non-streamed answers and on a stream's
first response). What the bodies may carry is ``_openai_request``'s business.

Non-streamed answers carry every choice (``n`` of them, in index order) and ``usage``
(prompt, completion and total tokens; the completion tokens are every sample's).
Streamed answers are server-sent events, one ``data: <chunk>`` per piece of new text of
one choice, the last chunk of a choice carrying its ``finish_reason``; with
``stream_options.include_usage`` every chunk has ``"usage": null`` and one last chunk
has no choices and the usage. The stream ends with ``data: [DONE]``. A chat stream's
first chunk of each choice has ``delta.role``. Asked for, each choice (or chunk) carries
the ``logprobs`` of its tokens (``_openai_logprobs``).

Errors are OpenAI's object, ``{"error": {"message", "type", "param", "code"}}``: 400 for
a bad request, 404 (code ``model_not_found``) for a model that is not served or not
generative, 5xx for the server's failures. An error before the first chunk gets its own
status; a later one is a ``data: {"error": ...}`` event under the 200 already sent. A
client that goes away aborts the generation.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from .._context import ServerContext
from .._errors import ErrorKind, InferenceServerError, InvalidArgumentError, NotFoundError
from .._generative import GenerativeModel
from ..scheduler import (
    GenerationChunk,
    GenerationRequest,
    GenerativeServed,
    RequestParameters,
    Tokenizer,
    TokenLogprob,
    call_tokenizer,
)
from ._app import Request, Response
from ._chat_template import render_chat
from ._errors import error_status
from ._generate import collect_samples
from ._generate_events import (
    json_answer,
    send_event,
    stream_end,
    stream_start,
    unless_client_leaves,
)
from ._json_body import COMPACT, json_object
from ._openai_logprobs import ChoiceLogprobs, requested_logprobs
from ._openai_request import (
    OpenAIRequest,
    chat_messages,
    completion_prompt,
    prompt_ids_in_vocabulary,
    read_request,
    requested_model,
)

logger = logging.getLogger("trioserve.rest")

_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class _Call:
    """One OpenAI request made ready: the model, the engine's request, the answer's parts."""

    served: GenerativeServed
    generation: GenerationRequest
    options: OpenAIRequest
    chat: bool
    echo: str  # the text every choice starts with
    head: dict[str, Any]  # id, object, created, model: what every answer and chunk starts with
    prompt_tokens: int
    decode: Callable[[Sequence[int]], str]  # the model's, for the logprobs' token texts

    def logprobs(self) -> ChoiceLogprobs | None:
        """A new choice's logprobs builder, when the request asked for logprobs."""
        if self.generation.sampling.logprobs is None:
            return None
        return ChoiceLogprobs(self.decode, chat=self.chat, offset=len(self.echo))


class OpenAIEndpoints:
    def __init__(self, context: ServerContext) -> None:
        self.repository = context.repository
        self.pipeline = context.pipeline  # builds the engine's requests and runs them
        self.load = context.load  # the answers' load reports
        self._created = int(time.time())  # the models' "created": when the server started

    async def models(self, request: Request) -> Response:
        listed = [
            self._model_object(name)
            for name in self.repository.names()
            if _generative(self.repository.get(name)) is not None
        ]
        return Response(200, COMPACT.encode({"object": "list", "data": listed}).encode())

    async def model(self, request: Request) -> Response:
        """One generative model's object, as the list has it; 404 for any other name."""
        name = request.params["model"]
        try:
            self._model(name)
        except NotFoundError as exc:
            status, error = error_object(exc)
            return Response(status, COMPACT.encode({"error": error}).encode())
        return Response(200, COMPACT.encode(self._model_object(name)).encode())

    def _model_object(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "trioserve"}

    async def completions(self, request: Request) -> Response | None:
        return await self._answer(request, self._completion_call)

    async def chat_completions(self, request: Request) -> Response | None:
        return await self._answer(request, self._chat_call)

    async def _answer(
        self,
        request: Request,
        prepare: Callable[[dict[str, Any], dict[bytes, bytes]], Awaitable[_Call]],
    ) -> Response | None:
        try:
            call = await prepare(json_object(request.body), request.headers)
            if call.options.stream:
                await self._stream(request, call)
                return None  # answered as it went, or the client went away
            return await self._complete(request, call)
        except InferenceServerError as exc:
            status, error = error_object(exc)
            return Response(status, COMPACT.encode({"error": error}).encode())

    def _read(
        self, document: dict[str, Any], *, chat: bool
    ) -> tuple[GenerativeServed, GenerativeModel, OpenAIRequest]:
        """The model asked for, and the request read with its limits; logprobs settled."""
        served, model = self._model(requested_model(document))
        options = read_request(document, chat=chat, max_num_seqs=model.max_num_seqs)
        sampling = options.parameters.sampling
        logprobs = requested_logprobs(document, sampling.logprobs, chat=chat)
        if logprobs != sampling.logprobs:
            parameters = options.parameters._replace(sampling=replace(sampling, logprobs=logprobs))
            options = replace(options, parameters=parameters)
        return served, model, options

    async def _completion_call(
        self, document: dict[str, Any], headers: dict[bytes, bytes]
    ) -> _Call:
        served, model, options = self._read(document, chat=False)
        prompt = completion_prompt(document)
        if prompt.token_ids is not None:
            prompt_ids_in_vocabulary(prompt.token_ids, model.vocab_size)
            ids = list(prompt.token_ids)
            text = model.decode(ids)
        else:
            assert prompt.text is not None
            text = prompt.text
            ids = await _tokenized(model.encode, text, model.name)
        echo = text if options.echo else ""
        parameters = options.parameters
        return self._call(served, options, parameters, text, ids, headers, chat=False, echo=echo)

    async def _chat_call(self, document: dict[str, Any], headers: dict[bytes, bytes]) -> _Call:
        served, model, options = self._read(document, chat=True)
        messages = chat_messages(document)
        add_generation_prompt = document.get("add_generation_prompt", True)
        if type(add_generation_prompt) is not bool:
            raise InvalidArgumentError("'add_generation_prompt' must be a boolean")
        text = render_chat(
            messages,
            model.chat_template,
            model.special_tokens,
            add_generation_prompt=add_generation_prompt,
        )
        ids = await _tokenized(model.encode_chat, text, model.name)
        parameters = options.parameters
        if not options.max_tokens_given:  # as many as the model's length leaves room for
            room = max(1, model.max_model_len - len(ids))
            parameters = parameters._replace(sampling=replace(parameters.sampling, max_tokens=room))
        last = messages[-1]
        echo = last["content"] if options.echo and last["role"] == "assistant" else ""
        return self._call(served, options, parameters, text, ids, headers, chat=True, echo=echo)

    def _call(
        self,
        served: GenerativeServed,
        options: OpenAIRequest,
        parameters: RequestParameters,
        text: str,
        ids: list[int],
        headers: dict[bytes, bytes],
        *,
        chat: bool,
        echo: str,
    ) -> _Call:
        generation = self.pipeline.generation_request(
            "openai", served, text, parameters, headers, prompt_token_ids=tuple(ids)
        )
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "",  # set per answer
            "created": int(time.time()),
            "model": options.model,
        }
        model = served.model
        assert isinstance(model, GenerativeModel)
        return _Call(served, generation, options, chat, echo, head, len(ids), model.decode)

    def _model(self, name: str) -> tuple[GenerativeServed, GenerativeModel]:
        try:
            found = _generative(self.repository.get(name))
        except NotFoundError:
            found = None
        if found is None:
            raise NotFoundError(f"The model '{name}' does not exist")
        return found

    async def _complete(self, request: Request, call: _Call) -> Response | None:
        work = partial(collect_samples, self.pipeline, call.served, call.generation)
        answered, samples = await unless_client_leaves(request.cancel_with, work)
        if not answered or samples is None:
            return None
        choices = []
        for index, (text, reason, entries) in enumerate(
            zip(samples.texts, samples.finish_reasons, samples.logprobs, strict=True)
        ):
            body = call.echo + text
            choice: dict[str, Any] = {"index": index}
            if call.chat:
                choice["message"] = {"role": "assistant", "content": body}
            else:
                choice["text"] = body
            builder = call.logprobs()
            choice["logprobs"] = None if builder is None else builder.document(entries)
            choices.append({**choice, "finish_reason": reason})
        document = {
            **call.head,
            "object": "chat.completion" if call.chat else "text_completion",
            "choices": choices,
            "usage": _usage(call.prompt_tokens, samples.generated_tokens),
        }
        return json_answer(self.load, call.served, request, document)

    async def _stream(self, request: Request, call: _Call) -> None:
        events = _StreamEvents(call)
        send = request.send

        async def start() -> None:
            await send(stream_start(self.load, call.served, request))

        async def stream() -> None:
            started = False
            async with self.pipeline.generate(call.served, call.generation) as chunks:
                try:
                    async for chunk in chunks:
                        events.generated_tokens += len(chunk.token_ids)
                        event = events.chunk(chunk)
                        if event is None:
                            continue  # a multi-byte character is not complete yet
                        if not started:  # a refused request still gets its error status
                            await start()
                            started = True
                        await send_event(send, event)
                except Exception as exc:
                    if not started:
                        raise
                    if not isinstance(exc, InferenceServerError):
                        logger.exception("generation %s failed", call.generation.request_id)
                    await send_event(send, {"error": error_object(exc)[1]})
                    await _send_bytes(send, _DONE)
                    return
            if not started:
                await start()
            if call.options.include_usage:
                await send_event(send, events.usage())
            await _send_bytes(send, _DONE)

        answered, _ = await unless_client_leaves(request.cancel_with, stream)
        if answered:
            await send(stream_end())


class _StreamEvents:
    """The chunks of one streamed answer."""

    def __init__(self, call: _Call) -> None:
        self.call = call
        self.head = {
            **call.head,
            "object": "chat.completion.chunk" if call.chat else "text_completion",
        }
        self.begun: set[int] = set()  # choices that have had their first chunk
        self.generated_tokens = 0
        self.logprobs: dict[int, ChoiceLogprobs | None] = {}  # by choice
        self.pending: dict[int, list[TokenLogprob]] = {}  # tokens of chunks not sent yet

    def chunk(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        """The event of ``chunk``; None while it has no text to show (its tokens' logprobs
        then go with the next event of its choice)."""
        if chunk.logprobs is not None:
            self.pending.setdefault(chunk.index, []).extend(chunk.logprobs)
        if not (chunk.text or chunk.finish_reason):
            return None
        text = chunk.text
        first = chunk.index not in self.begun
        if first:
            self.begun.add(chunk.index)
            text = self.call.echo + text
        choice: dict[str, Any] = {"index": chunk.index}
        if self.call.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": self._logprobs(chunk.index), "finish_reason": chunk.finish_reason}
        event = {**self.head, "choices": [choice]}
        if self.call.options.include_usage:
            event["usage"] = None
        return event

    def _logprobs(self, index: int) -> dict[str, Any] | None:
        if index not in self.logprobs:
            self.logprobs[index] = self.call.logprobs()
        builder = self.logprobs[index]
        return None if builder is None else builder.document(self.pending.pop(index, []))

    def usage(self) -> dict[str, Any]:
        usage = _usage(self.call.prompt_tokens, self.generated_tokens)
        return {**self.head, "choices": [], "usage": usage}


def error_object(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI's error object for ``exc``."""
    if not isinstance(exc, InferenceServerError):
        return 500, _error("generation failed unexpectedly", "server_error", None, None)
    status = 400 if exc.kind is ErrorKind.UNSUPPORTED else error_status(exc)
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = "model_not_found" if exc.kind is ErrorKind.NOT_FOUND else None
    return status, _error(exc.message, kind, getattr(exc, "param", None), code)


def _error(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"message": message, "type": kind, "param": param, "code": code}


def _generative(served: Any) -> tuple[GenerativeServed, GenerativeModel] | None:
    if isinstance(served, GenerativeServed) and isinstance(served.model, GenerativeModel):
        return served, served.model
    return None


async def _tokenized(encode: Tokenizer, text: str, model: str) -> list[int]:
    try:
        return await call_tokenizer(encode, text, model)
    except Exception as exc:
        raise InvalidArgumentError(f"cannot tokenize the prompt: {exc}") from exc


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _send_bytes(send: Callable[[Any], Awaitable[None]], data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})
