"""The OpenAI-compatible endpoints against a real server, driven by the official client.

The client is the synchronous one, run in a worker thread: the async client works under
trio, but its streams leave async generators for the garbage collector to finish.

``tiny_lm`` serves (beside the zoo, whose tensor models must not be listed). The answers
are checked against what the same engine gives through Triton's generate endpoint, so a
test fails if the OpenAI path samples, counts or renders otherwise.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import trio
import trio.testing

from trioserve.rest._chat_template import DEFAULT_CHAT_TEMPLATE, render_chat

TIMEOUT = 30
GREEDY_ENDLESS = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def client(tiny_server: Any) -> Iterator[openai.OpenAI]:
    base = f"http://127.0.0.1:{tiny_server.http_port}/v1"
    with openai.OpenAI(
        base_url=base, api_key="unused", max_retries=0, timeout=TIMEOUT
    ) as openai_client:
        yield openai_client


async def ask(method: Callable[..., Any], **arguments: Any) -> Any:
    """``method(**arguments)`` in a worker thread; a stream comes back as its chunks."""

    def call() -> Any:
        answer = method(**arguments)
        return list(answer) if arguments.get("stream") else answer

    return await trio.to_thread.run_sync(call)


@pytest.fixture
async def http(tiny_server: Any) -> AsyncIterator[httpx.AsyncClient]:
    base = f"http://127.0.0.1:{tiny_server.http_port}"
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as http_client:
        yield http_client


async def generated(http: httpx.AsyncClient, prompt: str, **parameters: Any) -> Any:
    """What Triton's generate endpoint answers for ``prompt`` on the same engine."""
    answer = await http.post(
        "/v2/models/tiny_lm/generate", json={"text_input": prompt, "parameters": parameters}
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_models_lists_the_generative_models_only(client: openai.OpenAI) -> None:
    models = await ask(client.models.list)
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [
        ("tiny_lm", "model", "trioserve")
    ]


async def test_completion_matches_generate(client: openai.OpenAI, http: httpx.AsyncClient) -> None:
    with trio.fail_after(TIMEOUT):
        completion = await ask(
            client.completions.create,
            model="tiny_lm",
            prompt="Hello",
            max_tokens=7,
            **GREEDY_ENDLESS,
        )
        reference = await generated(http, "Hello", max_tokens=7, temperature=0, ignore_eos=True)
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.model == "tiny_lm"
    [choice] = completion.choices
    assert (choice.index, choice.text, choice.finish_reason) == (
        0,
        reference["text_output"],
        "length",
    )
    assert completion.usage is not None
    # tiny_lm's tokens are UTF-8 bytes: the prompt is 5 tokens, the answer the 7 asked for.
    assert completion.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
    }


async def test_completion_n_streamed_equals_not_streamed(client: openai.OpenAI) -> None:
    settings: dict[str, Any] = {
        "model": "tiny_lm",
        "prompt": "Once",
        "max_tokens": 6,
        "n": 3,
        "seed": 11,
        "extra_body": {"ignore_eos": True},
    }
    with trio.fail_after(TIMEOUT):
        whole = await ask(client.completions.create, **settings)
        chunks = await ask(
            client.completions.create,
            **settings,
            stream=True,
            stream_options={"include_usage": True},
        )
    texts = ["", "", ""]
    reasons: list[str | None] = [None] * 3
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            reasons[choice.index] = choice.finish_reason
    assert texts == [c.text for c in whole.choices]
    assert reasons == ["length"] * 3
    assert len({c.text for c in whole.choices}) > 1  # three samples, not one thrice
    assert chunks[-1].choices == []
    assert chunks[-1].usage == whole.usage
    assert whole.usage is not None and whole.usage.completion_tokens == 18


async def test_completion_stop_echo_and_token_prompt(
    client: openai.OpenAI, http: httpx.AsyncClient
) -> None:
    with trio.fail_after(TIMEOUT):
        reference = await generated(http, "abc", max_tokens=8, temperature=0, ignore_eos=True)
        text = reference["text_output"]
        stop = text[3:5]
        stopped = await ask(
            client.completions.create,
            model="tiny_lm",
            prompt="abc",
            max_tokens=8,
            stop=[stop],
            **GREEDY_ENDLESS,
        )
        echoed = await ask(
            client.completions.create,
            model="tiny_lm",
            prompt="abc",
            max_tokens=8,
            echo=True,
            **GREEDY_ENDLESS,
        )
        from_ids = await ask(
            client.completions.create,
            model="tiny_lm",
            prompt=list(b"abc"),
            max_tokens=8,
            **GREEDY_ENDLESS,
        )
    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert echoed.choices[0].text == "abc" + text
    assert from_ids.choices[0].text == text
    assert from_ids.usage is not None and from_ids.usage.prompt_tokens == 3


async def test_chat_plain_and_streamed(client: openai.OpenAI, http: httpx.AsyncClient) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]  # fmt: skip
    prompt = "system: Be brief.\nuser: Hi there\nassistant:"  # the default template
    with trio.fail_after(TIMEOUT):
        reference = await generated(http, prompt, max_tokens=5, temperature=0, ignore_eos=True)
        chat = await ask(
            client.chat.completions.create,
            model="tiny_lm",
            messages=messages,
            max_completion_tokens=5,
            **GREEDY_ENDLESS,
        )
        chunks = await ask(
            client.chat.completions.create,
            model="tiny_lm",
            messages=messages,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY_ENDLESS,
        )
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    [choice] = chat.choices
    assert choice.message.role == "assistant"
    assert (choice.message.content, choice.finish_reason) == (reference["text_output"], "length")
    assert chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(prompt), 5)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == reference["text_output"]
    assert chunks[-1].usage == chat.usage


async def test_chat_uses_the_model_chat_template(client: openai.OpenAI, tiny_server: Any) -> None:
    model = tiny_server.repository.get("tiny_lm").model
    model.chat_template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    model.special_tokens = {"bos_token": "[B]"}
    with trio.fail_after(TIMEOUT):
        chat = await ask(
            client.chat.completions.create,
            model="tiny_lm",
            messages=[{"role": "user", "content": " hey "}],
            max_tokens=2,
        )
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len("[B]<user>hey<assistant>")


async def test_chat_n_and_default_length(client: openai.OpenAI, tiny_server: Any) -> None:
    """Without a limit, chat may write up to the model's length: vLLM's default, counted in
    vllm:request_params_max_tokens as max_model_len minus the prompt."""
    with trio.fail_after(TIMEOUT):
        chat = await ask(
            client.chat.completions.create,
            model="tiny_lm",
            messages=[{"role": "user", "content": "x"}],
            n=2,
            seed=3,
        )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage is not None
    written = sum(len(c.message.content or "") for c in chat.choices)
    assert chat.usage.completion_tokens >= 2 and written > 0


def test_render_chat_default_and_template_errors() -> None:
    messages = [{"role": "user", "content": "a"}]
    assert render_chat(messages, None, {}) == "user: a\nassistant:"
    assert render_chat(messages, DEFAULT_CHAT_TEMPLATE, {}, add_generation_prompt=False) == (
        "user: a\n"
    )
    strict = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    with pytest.raises(Exception, match="system first") as refused:
        render_chat(messages, strict, {})
    assert type(refused.value).__name__ == "InvalidArgumentError"
    # The sandbox: a template cannot reach Python's internals.
    with pytest.raises(Exception, match="chat template"):
        render_chat(messages, "{{ messages.__class__.__mro__[1].__subclasses__() }}", {})


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("completions", {"model": "missing", "prompt": "x"}, 404, None),
        ("completions", {"model": "simple", "prompt": "x"}, 404, None),  # not generative
        ("completions", {"model": "tiny_lm", "prompt": "x", "logprobs": 99}, 400, "logprobs"),
        ("completions", {"model": "tiny_lm", "prompt": [1, 999]}, 400, "prompt"),
        ("completions", {"model": "tiny_lm", "prompt": ["a", "b"]}, 400, "prompt"),
        ("completions", {"model": "tiny_lm", "prompt": "x", "temperature": -1}, 400, "temperature"),
        (
            "completions",
            {
                "model": "tiny_lm",
                "prompt": "x",
                "stream": False,
                "stream_options": {"include_usage": True},
            },
            400,
            "stream_options",
        ),
        ("completions", {"prompt": "x"}, 400, "model"),
        ("completions", {"model": "tiny_lm", "prompt": "x" * 2000}, 400, None),
        ("chat/completions", {"model": "tiny_lm", "messages": []}, 400, "messages"),
        (
            "chat/completions",
            {"model": "tiny_lm", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        (
            "chat/completions",
            {
                "model": "tiny_lm",
                "messages": [{"role": "user", "content": [{"type": "image_url"}]}],
            },
            400,
            "messages[0].content",
        ),
    ],
)
async def test_errors_in_openai_shape(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    for stream in (False, True):
        with trio.fail_after(TIMEOUT):
            answer = await http.post(f"/v1/{path}", json={"stream": stream, **body})
        assert answer.status_code == status, answer.text
        assert answer.headers["content-type"] == "application/json"
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["param"] == param
        assert error["code"] == ("model_not_found" if status == 404 else None)


async def test_client_raises_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="'missing' does not exist"):
        await ask(
            client.chat.completions.create,
            model="missing",
            messages=[{"role": "user", "content": "x"}],
        )
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        await ask(client.completions.create, model="tiny_lm", prompt="x", logprobs=99)


async def test_stream_wire_ends_with_done(http: httpx.AsyncClient) -> None:
    body = {"model": "tiny_lm", "prompt": "x", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with trio.fail_after(TIMEOUT):
        answer = await http.post("/v1/completions", json=body)
    assert answer.headers["content-type"] == "text/event-stream; charset=utf-8"
    frames = answer.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    assert all(f.startswith("data: {") for f in frames[:-2])


async def test_disconnect_aborts_the_generation(tiny_server: Any, generate_exits: Any) -> None:
    runner = tiny_server.repository.get("tiny_lm")
    exits = generate_exits(runner)
    body = json.dumps(
        {
            "model": "tiny_lm",
            "prompt": "x" * 50,
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    with trio.fail_after(TIMEOUT):
        stream = await trio.open_tcp_stream("127.0.0.1", tiny_server.http_port)
        await stream.send_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        received = b""
        while b"\n\n" not in received:  # the first event: prefill done, decoding
            received += await stream.receive_some()
        assert runner.kv_cache_state().used_blocks > 0
        await stream.aclose()
        await exits.wait_for(1)
    assert runner.kv_cache_state().used_blocks == 0
    assert not runner.engine.policy.has_work


async def test_counted_like_generate(client: openai.OpenAI, http: httpx.AsyncClient) -> None:
    """Statistics, vLLM families and the ORCA header see OpenAI requests."""
    with trio.fail_after(TIMEOUT):
        raw = await ask(
            client.completions.with_raw_response.create,
            model="tiny_lm",
            prompt="x",
            max_tokens=4,
            n=2,
            extra_body={"ignore_eos": True},
            extra_headers={"endpoint-load-metrics-format": "text"},
        )
        await ask(
            client.chat.completions.create,
            model="tiny_lm",
            messages=[{"role": "user", "content": "y"}],
            max_tokens=3,
            stream=True,
        )
        await trio.testing.wait_all_tasks_blocked()
        scraped = (await http.get("/metrics")).text
        stats = (await http.get("/v2/models/tiny_lm/stats")).json()["model_stats"][0]
    assert raw.headers["endpoint-load-metrics"].startswith(
        "TEXT named_metrics.kv_cache_utilization="
    )
    assert stats["inference_count"] == 2
    assert 'vllm:request_params_n_count{model_name="tiny_lm"} 2.0' in scraped
    assert 'vllm:request_params_n_bucket{le="2.0",model_name="tiny_lm"} 2.0' in scraped
    assert 'vllm:generation_tokens_total{model_name="tiny_lm"}' in scraped


@pytest.mark.parametrize("tiny_server", ["hypercorn"], indirect=True)
async def test_under_hypercorn(client: openai.OpenAI) -> None:
    with trio.fail_after(TIMEOUT):
        chunks = await ask(
            client.completions.create,
            model="tiny_lm",
            prompt="x",
            max_tokens=3,
            stream=True,
            **GREEDY_ENDLESS,
        )
        texts = [chunk.choices[0].text for chunk in chunks]
    assert len(texts) >= 1
