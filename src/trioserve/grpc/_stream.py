"""ModelStreamInfer: many requests on one call, each answered on its own.

A stream carries any number of ``ModelInferRequest`` messages; each is answered on its
own, concurrently, in ``ModelStreamInferResponse`` messages (Triton's decoupled mode):

* A generative model answers one response per piece of new text: a one-element BYTES
  ``text_output`` with the new text and the parameter ``triton_final_response`` (false,
  and true on the request's last response). With ``n > 1`` each response also carries
  the sample's ``index``; a sample's last one carries its ``finish_reason``. A request
  with ``triton_enable_empty_final_response: true`` (tritonclient's
  ``enable_empty_final_response=True``) gets every text response with the flag false
  and then an empty response (no outputs) with it true.
* Any other model answers its one response, flagged final. The requests of a sequence
  model reach it in the order they came (each is queued before the next is read). Its inputs and outputs may
  be placed in shared memory as in ModelInfer; device copies (CUDA regions, a GPU
  model's outputs) run in a worker thread.
* A decoupled model's request is answered by each response the model sends, the
  last flagged final; a final flag sent alone becomes an empty final response only
  when the request set ``triton_enable_empty_final_response``.
* A request that fails is answered by ``error_message`` (the stream goes on), with the
  request's ``id`` so clients can tell which one failed.

Stream-level events: when the client closes its side, the requests in flight finish and
the call ends, with the load report of the model it last asked for in its trailers
(when its metadata asks for one). When the client cancels the call, or a send finds it
gone, every request of the stream is cancelled; a generation cancelled that way is
aborted by the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from .._errors import InferenceServerError
from .._served import Answer, ServedModel
from .._tensor import datatype
from .._types import InferenceRequest, InferenceResponse, OutputTensor
from ..scheduler import (
    GenerationChunk,
    GenerativeServed,
    prompt_and_parameters,
    read_parameters,
)
from ._codec import decode_request, response_head
from ._errors import ClientGone, parse_message
from ._generated import grpc_service_pb2 as pb
from ._infer_wire import WireReply, WireRequest, stream_reply
from ._orca import add_load_report

if TYPE_CHECKING:
    from .._context import ServerContext
    from ._call import Call, MessageStream

logger = logging.getLogger("trioserve.grpc")

# Requests of one ModelStreamInfer call being answered at once.
MAX_IN_FLIGHT = 128

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
TEXT_OUTPUT = "text_output"
_BYTES = datatype("BYTES")


class StreamInfer:
    """Serves ModelStreamInfer calls over a model repository."""

    def __init__(self, context: ServerContext) -> None:
        self._repository = context.repository
        self._pipeline = context.pipeline  # tensor requests and generations alike
        self._load = context.load  # the call's load report

    async def serve(self, io: MessageStream, call: Call) -> None:
        """Answer every request of one call; returns when all are answered or the client
        is gone. A request the transport could not read (one over the size limit) ends
        the call with its status, raised here rather than inside an exception group."""
        failure: Exception | None = None
        # Requests answered at once, per call. Past it the next message is left unread,
        # so the transport's flow control holds a client that sends faster than it reads.
        in_flight = trio.Semaphore(MAX_IN_FLIGHT)
        async with trio.open_nursery() as requests:
            replies = _Replies(io, requests.cancel_scope, call.metadata)
            while True:
                await in_flight.acquire()
                try:
                    wire: WireRequest | None = await io.recv()
                    if wire is None:
                        break  # the nursery waits for the requests in flight
                    # Only the head goes through protobuf: the tensors stay views of the
                    # received message (protobuf would copy them holding the GIL).
                    message = parse_message(pb.ModelInferRequest, wire.head)
                except ClientGone:
                    requests.cancel_scope.cancel()
                    break
                except Exception as exc:
                    failure = exc
                    requests.cancel_scope.cancel()
                    break
                answer = partial(self._answer_one, message, wire.raw, replies, in_flight)
                if self._in_sequence(message):  # its requests reach the model in order
                    await requests.start(answer)
                else:
                    requests.start_soon(answer)
        if failure is not None:
            try:
                raise failure
            finally:
                failure = None  # no cycle through this frame, which the traceback holds
        if replies.served is not None:
            add_load_report(call, self._load, replies.served)

    def _in_sequence(self, message: pb.ModelInferRequest) -> bool:
        try:
            served = self._repository.get(message.model_name, message.model_version)
        except InferenceServerError:
            return False
        return served.model.sequence_batching is not None

    async def _answer_one(
        self,
        message: pb.ModelInferRequest,
        raw: list[memoryview],
        replies: _Replies,
        in_flight: trio.Semaphore,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            await self._answer(message, raw, replies, task_status=task_status)
        finally:
            in_flight.release()

    async def _answer(
        self,
        message: pb.ModelInferRequest,
        raw: list[memoryview],
        replies: _Replies,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        submitted = _Once(task_status.started)
        try:
            served = self._repository.get(message.model_name, message.model_version)
            replies.served = served
            decode = partial(decode_request, message, raw=raw)
            if isinstance(served, GenerativeServed):
                await self._generate(served, decode(), replies)
            elif served.model.decoupled:
                await self._pipeline.infer_decoupled(
                    served, decode, _Answers(message, replies).deliver, headers=replies.metadata
                )
            else:
                _, response = await self._pipeline.infer(
                    served,
                    decode,
                    endpoint="ModelStreamInfer RPC",
                    submitted=submitted,
                    headers=replies.metadata,
                )
                await replies.send(_response(response, final=True))
        except InferenceServerError as exc:
            await replies.send(_error(message, exc.message))
        except Exception:
            logger.exception("ModelStreamInfer request for %r failed", message.model_name)
            await replies.send(_error(message, "the request failed unexpectedly"))
        finally:
            submitted()

    async def _generate(
        self, served: GenerativeServed, request: InferenceRequest, replies: _Replies
    ) -> None:
        prompt, given = prompt_and_parameters(request.inputs, request.parameters)
        parameters = read_parameters(given, "vllm", max_num_seqs=served.max_num_seqs)
        generation = self._pipeline.generation_request(
            "grpc", served, prompt, parameters, replies.metadata
        )
        empty_final = given.get(EMPTY_FINAL) is True
        n = generation.sampling.n
        unfinished = n
        async with self._pipeline.generate(served, generation) as chunks:
            async for chunk in chunks:
                if chunk.finish_reason is not None:
                    unfinished -= 1
                elif not chunk.text:
                    continue  # a multi-byte character still incomplete: nothing to say
                final = unfinished == 0 and not empty_final
                await replies.send(_chunk_response(served, request, chunk, n, final))
        if empty_final or unfinished:
            empty = InferenceResponse(served.model.name, served.version, [], request.id)
            await replies.send(_response(empty, final=True))


class _Answers:
    """Sends a decoupled model's answers to one request: each response as it comes, an
    error as ``error_message``; a final flag sent alone is an empty final response only
    when the request asked for one (``triton_enable_empty_final_response``)."""

    def __init__(self, message: pb.ModelInferRequest, replies: _Replies) -> None:
        self._message = message
        self._replies = replies
        parameter = message.parameters.get(EMPTY_FINAL)
        self._empty_final = parameter is not None and parameter.bool_param

    async def deliver(self, answer: Answer, final: bool) -> None:
        if isinstance(answer, InferenceServerError):
            await self._replies.send(_error(self._message, answer.message))
        elif answer is not None:
            await self._replies.send(_response(answer, final=final))
        elif final and self._empty_final:
            message = self._message
            empty = InferenceResponse(message.model_name, message.model_version, [], message.id)
            await self._replies.send(_response(empty, final=True))


class _Replies:
    """Sends of one call, one at a time (a front end's may not interleave); a send that
    finds the client gone cancels every request of the call."""

    def __init__(
        self, io: MessageStream, requests: trio.CancelScope, metadata: Mapping[str, str]
    ) -> None:
        self._io = io
        self._requests = requests
        self.metadata = metadata  # the call's: a client's trace context, if traced
        self._lock = trio.Lock()
        self.served: ServedModel | None = None  # the model the call last asked for

    async def send(self, response: pb.ModelStreamInferResponse | WireReply) -> None:
        async with self._lock:
            try:
                await self._io.send(response)
            except ClientGone:
                self._requests.cancel()
                await trio.lowlevel.checkpoint()  # raises Cancelled: unwind this request


def _chunk_response(
    served: GenerativeServed,
    request: InferenceRequest,
    chunk: GenerationChunk,
    n: int,
    final: bool,
) -> WireReply:
    text = np.array([chunk.text.encode()], dtype=object)
    parameters: dict[str, Any] = {}
    if n > 1:
        parameters["index"] = chunk.index
    if chunk.finish_reason is not None:
        parameters["finish_reason"] = chunk.finish_reason
    response = InferenceResponse(
        served.model.name,
        served.version,
        [OutputTensor(TEXT_OUTPUT, _BYTES, text)],
        request.id,
        parameters,
    )
    return _response(response, final=final)


def _response(response: InferenceResponse, *, final: bool) -> WireReply:
    head = response_head(response)
    head.parameters[FINAL].bool_param = final
    return stream_reply(head, response.outputs)


def _error(message: pb.ModelInferRequest, text: str) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(
        error_message=text,
        infer_response=pb.ModelInferResponse(
            model_name=message.model_name, model_version=message.model_version, id=message.id
        ),
    )


class _Once:
    """Calls ``function`` the first time it is called (a task's ``started``)."""

    def __init__(self, function: Callable[[], object]) -> None:
        self._function: Callable[[], object] | None = function

    def __call__(self) -> None:
        function, self._function = self._function, None
        if function is not None:
            function()
