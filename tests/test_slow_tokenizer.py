"""A user tokenizer runs off the event loop: while one blocks on a prompt, the server
goes on answering health checks and other requests, on every path that tokenizes."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import trio.testing

from trioserve import ServerConfig, serve
from trioserve._stats import FailureReason
from trioserve.models import TinyLM

TIMEOUT = 20  # seconds; generous for a loaded machine, still fails a hung test


class SlowTokenizerLM(TinyLM):
    """Its tokenizer blocks on ``release`` for any prompt holding "slow"."""

    def __init__(self) -> None:
        super().__init__("slow_tokenizer", num_kv_blocks=64)
        self.release = threading.Event()
        self.blocked = trio.Event()

    def encode(self, text: str) -> list[int]:
        if "slow" in text:
            trio.from_thread.run_sync(self.blocked.set)  # a worker thread of trio's
            self.release.wait(TIMEOUT)
        return super().encode(text)


@pytest.fixture
async def slow(nursery: trio.Nursery) -> AsyncIterator[tuple[SlowTokenizerLM, httpx.AsyncClient]]:
    model = SlowTokenizerLM()
    server = await nursery.start(serve, ServerConfig(models=[model], http_port=0))
    url = f"http://127.0.0.1:{server.http_port}"
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
        yield model, http
    model.release.set()  # no thread left blocked past the test


GENERATE = "/v2/models/slow_tokenizer/generate"
INFER = "/v2/models/slow_tokenizer/infer"
COMPLETIONS = "/v1/completions"


def _body(path: str, prompt: str) -> dict[str, Any]:
    if path == INFER:
        return {
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]}],
            "parameters": {"max_tokens": 2},
        }
    if path == COMPLETIONS:
        return {"model": "slow_tokenizer", "prompt": prompt, "max_tokens": 2}
    return {"text_input": prompt, "parameters": {"max_tokens": 2}}


async def _blocked(model: SlowTokenizerLM) -> None:
    with trio.fail_after(TIMEOUT):
        await model.blocked.wait()


@pytest.mark.parametrize("path", [GENERATE, INFER, COMPLETIONS])
async def test_a_blocked_tokenizer_stalls_only_its_own_request(slow: Any, path: str) -> None:
    model, http = slow
    answers: list[httpx.Response] = []
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def slow_request() -> None:
                answers.append(await http.post(path, json=_body(path, "a slow prompt")))

            nursery.start_soon(slow_request)
            await _blocked(model)
            assert (await http.get("/v2/health/ready")).status_code == 200
            other = await http.post(path, json=_body(path, "a quick prompt"))
            assert other.status_code == 200, other.text
            assert answers == []  # still tokenizing
            model.release.set()
    assert answers[0].status_code == 200, answers[0].text


@pytest.mark.parametrize("kind", ["infer", "generate"])
async def test_a_request_cancelled_while_tokenizing_counts_as_canceled(
    nursery: trio.Nursery, kind: str
) -> None:
    model = SlowTokenizerLM()
    server = await nursery.start(serve, ServerConfig(models=[model]))
    with trio.fail_after(TIMEOUT):
        with trio.CancelScope() as scope:
            nursery.start_soon(_cancel_when_blocked, model, scope)
            if kind == "infer":
                inputs = {"text_input": np.array([b"slow"], dtype=object)}
                await server.infer("slow_tokenizer", inputs)
            else:
                async for _ in server.generate("slow_tokenizer", "slow", max_tokens=2):
                    pass
        assert scope.cancelled_caught
        model.release.set()
        await trio.testing.wait_all_tasks_blocked()  # the runner's admission task ends
        stats = server.repository.get("slow_tokenizer").inference_statistics()
    assert stats.failures[FailureReason.CANCELED] == 1
    assert stats.fail.count == 1


async def _cancel_when_blocked(model: SlowTokenizerLM, scope: trio.CancelScope) -> None:
    await _blocked(model)
    scope.cancel()


async def test_a_request_the_shutdown_ends_while_tokenizing_counts_as_other(
    nursery: trio.Nursery,
) -> None:
    model = SlowTokenizerLM()
    server = await nursery.start(serve, ServerConfig(models=[model], exit_timeout_s=0.05))
    runner = server.repository.get("slow_tokenizer")
    errors: list[Exception] = []

    async def infer() -> None:
        try:
            await server.infer("slow_tokenizer", {"text_input": np.array([b"slow"], dtype=object)})
        except Exception as exc:  # what the shutdown ends it with
            errors.append(exc)

    with trio.fail_after(TIMEOUT):
        nursery.start_soon(infer)
        await _blocked(model)
        await server.shutdown()  # the tokenizer is still blocked: shutdown does not wait for it
        await server.wait_stopped()
        await trio.testing.wait_all_tasks_blocked()  # the cancelled tasks end
    model.release.set()
    stats = runner.inference_statistics()
    assert stats.failures[FailureReason.OTHER] == 1
    assert stats.fail.count == 1
    assert [str(e) for e in errors] == ["server is shutting down"]
