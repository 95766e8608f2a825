"""ModelStreamInfer over real gRPC with tritonclient's streaming API.

Generative requests go to ``ScriptedLM`` (conftest), tensor requests to the zoo's
``simple``. tritonclient calls block, so each stream runs in a thread; the test waits on
what the callbacks saw, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json
import queue
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from trioserve import GrpcLimits, ServerConfig
from trioserve._context import server_context
from trioserve._served import ModelRepository
from trioserve.models import reference_zoo
from trioserve.scheduler._runner import ModelRunner

TIMEOUT = 20  # seconds; generous for a loaded machine, still fails a hung test


@pytest.fixture
async def url(
    nursery: trio.Nursery,
    scripted_lm: Any,
    grpc_server: str,
    start_grpc: Callable[[Any], Awaitable[int]],
) -> str:
    simple = next(m for m in reference_zoo() if m.name == "simple")
    repository = ModelRepository([scripted_lm, ModelRunner(simple, "1")])
    await nursery.start(repository.run)
    config = ServerConfig(
        http_port=None,
        grpc_port=0,
        grpc_limits=GrpcLimits(max_message_bytes=1 << 20),
        grpc_server=grpc_server,
    )
    return f"127.0.0.1:{await start_grpc(server_context(config, repository))}"


@dataclass
class Reply:
    """One stream response as tritonclient delivered it."""

    id: str = ""
    text: list[bytes] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    result: Any = field(default=None, compare=False, repr=False)  # tritonclient's InferResult

    @property
    def final(self) -> bool:
        return bool(self.parameters.get("triton_final_response"))


class Stream:
    """tritonclient's stream on a thread of its own; replies arrive in ``replies``."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.replies: queue.Queue[Reply] = queue.Queue()
        self.client.start_stream(callback=self._on_reply)

    def _on_reply(self, result: Any, error: Any) -> None:
        if error is not None:
            self.replies.put(Reply(error=error.message()))
            return
        response = result.get_response()
        parameters = {
            key: getattr(value, value.WhichOneof("parameter_choice"))
            for key, value in response.parameters.items()
        }
        text = result.as_numpy("text_output")
        texts = None if text is None else list(text.reshape(-1))
        self.replies.put(Reply(response.id, texts, parameters, result=result))

    def send(self, model: str, prompt: str, **kwargs: Any) -> None:
        self.client.async_stream_infer(model, [_text_input(prompt)], **kwargs)

    async def until(self, done: Callable[[list[Reply]], bool]) -> list[Reply]:
        """The replies received until ``done`` says enough."""
        received: list[Reply] = []
        while not done(received):
            reply = await trio.to_thread.run_sync(self.replies.get, abandon_on_cancel=True)
            received.append(reply)
        return received

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


@pytest.fixture
async def stream(url: str) -> AsyncIterator[Stream]:
    opened = await trio.to_thread.run_sync(Stream, url)
    yield opened
    await trio.to_thread.run_sync(opened.close, True)


def _text_input(prompt: str, name: str = "text_input") -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    return tensor


def finals(count: int) -> Callable[[list[Reply]], bool]:
    return lambda replies: sum(r.final or r.error is not None for r in replies) == count


async def test_one_response_per_token_the_last_flagged_final(stream: Stream) -> None:
    with trio.fail_after(TIMEOUT):
        stream.send("scripted_lm", "x", request_id="g1", parameters={"max_tokens": 3})
        replies = await stream.until(finals(1))
    assert replies == [
        Reply("g1", [b" w0"], {"triton_final_response": False}),
        Reply("g1", [b" w1"], {"triton_final_response": False}),
        Reply("g1", [b" w2"], {"triton_final_response": True, "finish_reason": "length"}),
    ]


async def test_empty_final_response_when_asked(stream: Stream) -> None:
    with trio.fail_after(TIMEOUT):
        stream.send(
            "scripted_lm",
            "x",
            request_id="g2",
            parameters={"max_tokens": 2},
            enable_empty_final_response=True,
        )
        replies = await stream.until(finals(1))
    assert replies == [
        Reply("g2", [b" w0"], {"triton_final_response": False}),
        Reply("g2", [b" w1"], {"triton_final_response": False, "finish_reason": "length"}),
        Reply("g2", None, {"triton_final_response": True}),
    ]


async def test_parallel_samples_carry_their_index(stream: Stream) -> None:
    with trio.fail_after(TIMEOUT):
        stream.send("scripted_lm", "x", parameters={"max_tokens": 2, "n": 2})
        replies = await stream.until(finals(1))
    assert [(r.text, r.parameters) for r in replies] == [
        ([b" s0w0"], {"triton_final_response": False, "index": 0}),
        ([b" s1w0"], {"triton_final_response": False, "index": 1}),
        ([b" s0w1"], {"triton_final_response": False, "index": 0, "finish_reason": "length"}),
        ([b" s1w1"], {"triton_final_response": True, "index": 1, "finish_reason": "length"}),
    ]


async def test_sampling_parameters_input_as_the_vllm_backend_takes_it(
    stream: Stream, scripted_lm: Any
) -> None:
    sampling = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps({"max_tokens": 1}).encode()], dtype=object))
    flag = grpcclient.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True]))
    with trio.fail_after(TIMEOUT):
        stream.client.async_stream_infer(
            "scripted_lm",
            [_text_input("x"), sampling, flag],
            priority=2,
            parameters={"temperature": 0.5},
        )
        replies = await stream.until(finals(1))
    assert [r.text for r in replies] == [[b" w0"]]
    (request,) = scripted_lm.requests
    assert (request.sampling.max_tokens, request.sampling.temperature) == (1, 0.5)
    assert request.priority == 2


async def test_failed_requests_answer_error_messages_and_the_stream_goes_on(
    stream: Stream,
) -> None:
    with trio.fail_after(TIMEOUT):
        stream.send("scripted_lm", "x", parameters={"max_tokens": 0})
        stream.send("scripted_lm", "x", parameters={"top_p": "high"})
        stream.send("nope", "x")
        stream.send("simple", "x")
        stream.client.async_stream_infer("scripted_lm", [_text_input("x", "prompt")])
        stream.send("scripted_lm", "fail")
        replies = await stream.until(finals(6))
    errors = sorted(r.error for r in replies if r.error is not None)
    assert errors == sorted(
        [
            "parameter 'max_tokens' must be an integer in [1, 2**63 - 1]",
            "parameter 'top_p' must be a finite number in (0, 1]",
            "Request for unknown model: 'nope' is not found",
            "unexpected inference input 'text_input' for model 'simple'",
            "unexpected inputs ['prompt']; a generative model takes 'text_input' and "
            "optionally 'sampling_parameters' and 'stream'",
            "the engine failed",
        ]
    )
    # "fail" streams two tokens before its error.
    assert [r.text for r in replies if r.text] == [[b" w0"], [b" w1"]]


async def test_tensor_models_answer_once_flagged_final(stream: Stream) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(a)
        inputs.append(tensor)
    with trio.fail_after(TIMEOUT):
        stream.client.async_stream_infer("simple", inputs, request_id="t1")
        (reply,) = await stream.until(finals(1))
    assert (reply.id, reply.parameters, reply.error) == (
        "t1",
        {"triton_final_response": True},
        None,
    )
    assert reply.result.as_numpy("OUTPUT0").tolist() == (2 * a).tolist()


async def test_requests_of_one_stream_run_concurrently(stream: Stream, scripted_lm: Any) -> None:
    scripted_lm.hold_after = 1
    with trio.fail_after(TIMEOUT):
        stream.send("scripted_lm", "x", request_id="held", parameters={"max_tokens": 3})
        (first,) = await stream.until(lambda replies: len(replies) == 1)  # then it waits
        stream.send("scripted_lm", "x", request_id="quick", parameters={"max_tokens": 1})
        (quick,) = await stream.until(lambda replies: len(replies) == 1)
        assert not scripted_lm.release.is_set()
        scripted_lm.release.set()
        rest = await stream.until(lambda replies: any(r.final for r in replies))
    assert (first.id, first.final) == ("held", False)
    assert (quick.id, quick.final) == ("quick", True)
    assert [r.id for r in rest] == ["held", "held"]


async def test_cancelling_the_stream_aborts_its_generations(url: str, scripted_lm: Any) -> None:
    scripted_lm.hold_after = 1
    opened = await trio.to_thread.run_sync(Stream, url)
    with trio.fail_after(TIMEOUT):
        opened.send("scripted_lm", "x", parameters={"max_tokens": 5})
        await opened.until(lambda replies: len(replies) == 1)
        await trio.to_thread.run_sync(opened.close, True)
        await scripted_lm.wait_until(lambda: scripted_lm.ended)
    assert list(scripted_lm.ended.values()) == ["abort"]


# --- end to end with tiny_lm -----------------------------------------------------------


@pytest.fixture
async def tiny_stream(tiny_server: Any) -> AsyncIterator[Stream]:
    opened = await trio.to_thread.run_sync(Stream, f"127.0.0.1:{tiny_server.grpc_port}")
    yield opened
    await trio.to_thread.run_sync(opened.close, True)


async def test_tiny_lm_streams_what_infer_answers(tiny_server: Any, tiny_stream: Stream) -> None:
    """Two greedy requests on one stream; each one's pieces add up to the text that unary
    ModelInfer answers for the same prompt."""
    parameters = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    with trio.fail_after(TIMEOUT):
        for prompt in ("one", "two"):
            tiny_stream.send("tiny_lm", prompt, request_id=prompt, parameters=parameters)
        replies = await tiny_stream.until(finals(2))
        for prompt in ("one", "two"):
            mine = [r for r in replies if r.id == prompt]
            assert [r.final for r in mine] == [False] * (len(mine) - 1) + [True]
            assert mine[-1].parameters["finish_reason"] == "length"
            streamed = b"".join(r.text[0] for r in mine if r.text)
            answer = await trio.to_thread.run_sync(
                partial(
                    tiny_stream.client.infer,
                    "tiny_lm",
                    [_text_input(prompt)],
                    parameters=parameters,
                )
            )
            assert streamed == answer.as_numpy("text_output")[0]


async def test_tiny_lm_bad_parameters_on_a_stream(tiny_stream: Stream) -> None:
    with trio.fail_after(TIMEOUT):
        tiny_stream.send("tiny_lm", "x", parameters={"top_k": -5})
        (reply,) = await tiny_stream.until(finals(1))
    assert reply.error == "parameter 'top_k' must be an integer in [-1, 2**63 - 1]"


async def test_tiny_lm_bad_parameters_on_model_infer(tiny_server: Any) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{tiny_server.grpc_port}")
    try:
        with trio.fail_after(TIMEOUT), pytest.raises(InferenceServerException) as info:
            await trio.to_thread.run_sync(
                partial(client.infer, "tiny_lm", [_text_input("x")], parameters={"n": 0})
            )
    finally:
        client.close()
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert info.value.message() == "parameter 'n' must be an integer in [1, 2**63 - 1]"


async def test_tiny_lm_cancelled_stream_frees_every_block(
    tiny_server: Any, generate_exits: Any
) -> None:
    runner = tiny_server.repository.get("tiny_lm")
    exits = generate_exits(runner)
    opened = await trio.to_thread.run_sync(Stream, f"127.0.0.1:{tiny_server.grpc_port}")
    with trio.fail_after(TIMEOUT):
        opened.send("tiny_lm", "x" * 100, parameters={"max_tokens": 900, "ignore_eos": True})
        await opened.until(lambda replies: len(replies) == 1)
        assert runner.kv_cache_state().used_blocks > 0
        await trio.to_thread.run_sync(opened.close, True)
        await exits.wait_for(1)
    assert runner.kv_cache_state().used_blocks == 0
    assert not runner.engine.policy.has_work


async def test_a_request_over_the_size_limit_ends_the_call(stream: Stream) -> None:
    with trio.fail_after(TIMEOUT):
        stream.send("scripted_lm", "x" * (2 << 20))  # the server takes 1 MiB messages
        (reply,) = await stream.until(lambda replies: len(replies) == 1)
    assert reply.error is not None
    assert reply.error.startswith("Received message larger than max")
