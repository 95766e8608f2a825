"""``logprobs`` on /v1/completions and /v1/chat/completions, parsed by the official client
and checked against a log-softmax of tiny_lm's own logits computed here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import trio

from trioserve._generative import StepSequence
from trioserve.models import TinyLM
from trioserve.rest._chat_template import render_chat

TIMEOUT = 30


@pytest.fixture
def client(tiny_server: Any) -> Iterator[openai.OpenAI]:
    base = f"http://127.0.0.1:{tiny_server.http_port}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def reference_lm() -> Iterator[TinyLM]:
    """The served tiny_lm's twin (same seed, same weights), stepped densely here."""
    lm = TinyLM(num_kv_blocks=64)
    lm.load()
    yield lm
    lm.unload()


def log_softmax_after(lm: TinyLM, ids: list[int]) -> np.ndarray[Any, Any]:
    """The next token's log-probabilities after ``ids``, in float64."""
    blocks = list(range(len(ids) // lm.block_size + 1))
    logits = np.asarray(lm.step([StepSequence(ids, 0, blocks)]))[0].astype(np.float64)
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())  # type: ignore[no-any-return]


def greedy_reference(lm: TinyLM, prompt: list[int], tokens: int) -> list[np.ndarray[Any, Any]]:
    """The log-probabilities at each place of a greedy continuation of ``prompt``."""
    ids, rows = list(prompt), []
    for _ in range(tokens):
        row = log_softmax_after(lm, ids)
        rows.append(row)
        ids.append(int(row.argmax()))
    return rows


def top(row: np.ndarray[Any, Any], count: int) -> list[int]:
    return [int(t) for t in np.argsort(-row, kind="stable")[:count]]


def piece(lm: TinyLM, token: int) -> str:
    return lm.decode([token])


async def call(method: Any, **arguments: Any) -> Any:
    def run() -> Any:
        answer = method(**arguments)
        return list(answer) if arguments.get("stream") else answer

    with trio.fail_after(TIMEOUT):
        return await trio.to_thread.run_sync(run)


async def test_completion_logprobs(client: openai.OpenAI, reference_lm: TinyLM) -> None:
    prompt = [72, 105, 33, 32]  # "Hi! "
    completion = await call(
        client.completions.create,
        model="tiny_lm",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = completion.choices[0].logprobs
    rows = greedy_reference(reference_lm, prompt, 6)
    chosen = [int(row.argmax()) for row in rows]
    assert logprobs.tokens == [piece(reference_lm, t) for t in chosen]
    assert logprobs.token_logprobs == pytest.approx([row.max() for row in rows], abs=1e-4)
    for row, alternatives in zip(rows, logprobs.top_logprobs, strict=True):
        expected = {piece(reference_lm, t): row[t] for t in top(row, 3)}
        assert alternatives == pytest.approx(expected, abs=1e-4)
    offsets = np.cumsum([0] + [len(t) for t in logprobs.tokens[:-1]]).tolist()
    assert logprobs.text_offset == offsets
    assert "".join(logprobs.tokens) == completion.choices[0].text


async def test_streamed_chat_logprobs_with_two_choices(
    client: openai.OpenAI, reference_lm: TinyLM, tiny_server: Any
) -> None:
    served = tiny_server.repository.get("tiny_lm").model
    messages = [{"role": "user", "content": "Say hi"}]
    chunks = await call(
        client.chat.completions.create,
        model="tiny_lm",
        messages=messages,
        max_tokens=5,
        temperature=0,
        n=2,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    entries: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            entries[choice.index] += choice.logprobs.content
    assert chunks[-1].usage.completion_tokens == 10
    text = render_chat(messages, served.chat_template, served.special_tokens)
    rows = greedy_reference(reference_lm, served.encode_chat(text), 5)
    for content in entries.values():
        assert len(content) == 5
        for entry, row in zip(content, rows, strict=True):
            best = int(row.argmax())
            assert entry.token == piece(reference_lm, best)
            assert entry.bytes == list(entry.token.encode())
            assert entry.logprob == pytest.approx(row[best], abs=1e-4)
            assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
                (piece(reference_lm, t), pytest.approx(row[t], abs=1e-4)) for t in top(row, 2)
            ]


async def test_sampled_tokens_get_their_own_logprob(
    client: openai.OpenAI, reference_lm: TinyLM
) -> None:
    prompt = [65, 66, 67]
    completion = await call(
        client.completions.create,
        model="tiny_lm",
        prompt=prompt,
        max_tokens=8,
        temperature=1.5,
        seed=11,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    logprobs = completion.choices[0].logprobs
    ids, drawn = list(prompt), []
    for token, value in zip(logprobs.tokens, logprobs.token_logprobs, strict=True):
        row = log_softmax_after(reference_lm, ids)
        # The one token of this text whose log-probability the answer gives.
        matching = [t for t in range(len(row)) if piece(reference_lm, t) == token]
        chosen = min(matching, key=lambda t: abs(row[t] - value))
        assert value == pytest.approx(row[chosen], abs=1e-4)
        drawn.append(chosen != row.argmax())
        ids.append(chosen)
    assert any(drawn)  # sampled, not greedy: some tokens are not the most likely


@pytest.mark.parametrize(
    ("endpoint", "settings", "param"),
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
        ("completions", {"logprobs": 1, "echo": True}, "logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": 1}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ],
)
async def test_bad_logprobs_settings_are_refused(
    client: openai.OpenAI, endpoint: str, settings: dict[str, Any], param: str
) -> None:
    if endpoint == "chat":
        method = client.chat.completions.create
        arguments: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]}
    else:
        method, arguments = client.completions.create, {"prompt": "x"}
    with pytest.raises(openai.BadRequestError) as refused:
        await call(method, model="tiny_lm", max_tokens=1, extra_body=settings, **arguments)
    assert refused.value.body["param"] == param  # type: ignore[index]
