"""In-process inference: ``Server.infer``, ``Server.generate`` and ``Server.rest_app`` on
a server with no listeners take the front ends' path (validation, batching, statistics,
metrics, load reports) without a socket, so they run exactly under the mock clock."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import trio.testing

import trioserve
from trioserve import (
    InvalidArgumentError,
    NotFoundError,
    Server,
    ServerConfig,
    UnsupportedError,
)
from trioserve.models import TinyLM, reference_zoo
from trioserve.scheduler import LLMEngine


@pytest.fixture
async def server(nursery: trio.Nursery) -> Server:
    config = ServerConfig(
        models=[*reference_zoo(), TinyLM(num_kv_blocks=64, max_model_len=64)],
        http_port=None,
        grpc_port=None,
    )
    started: Server = await nursery.start(trioserve.serve, config)
    return started


def asgi_client(server: Server) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=server.rest_app)
    return httpx.AsyncClient(transport=transport, base_url="http://trioserve")


def simple_inputs(batch: int = 1) -> dict[str, np.ndarray[Any, Any]]:
    x = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    return {"INPUT0": x, "INPUT1": np.ones((batch, 16), np.int32)}


async def test_infer_without_listeners(server: Server, autojump_clock: Any) -> None:
    assert server.http_port is None and server.grpc_port is None
    response = await server.infer("simple", simple_inputs(batch=2))
    assert (response.model_name, response.model_version) == ("simple", "1")
    x = simple_inputs(batch=2)["INPUT0"]
    np.testing.assert_array_equal(response.as_numpy("OUTPUT0"), x + 1)
    np.testing.assert_array_equal(response.as_numpy("OUTPUT1"), x - 1)
    with pytest.raises(KeyError, match="no output 'OUTPUT9'"):
        response.as_numpy("OUTPUT9")
    only = await server.infer(
        "simple", simple_inputs(), version=1, outputs=["OUTPUT1"], request_id="r1"
    )
    assert [t.name for t in only.outputs] == ["OUTPUT1"] and only.id == "r1"
    # The statistics and the metrics counted both, as they count the front ends' requests.
    [stats] = server.repository.statistics("simple")
    assert (stats.inference_count, stats.execution_count, stats.success.count) == (3, 2, 2)
    assert server.registry is not None
    labels = {"model": "simple", "version": "1"}
    assert server.registry.get_sample_value("nv_inference_request_success", labels) == 2


async def test_infer_counts_toward_the_load_report(server: Server, autojump_clock: Any) -> None:
    for _ in range(3):
        await server.infer("simple", simple_inputs())
    body = {
        "inputs": [
            {"name": name, "datatype": "INT32", "shape": [1, 16], "data": array.ravel().tolist()}
            for name, array in simple_inputs().items()
        ]
    }
    async with asgi_client(server) as client:
        answer = await client.post(
            "/v2/models/simple/infer",
            json=body,
            headers={"endpoint-load-metrics-format": "json"},
        )
    assert answer.status_code == 200
    report = json.loads(answer.headers["endpoint-load-metrics"].removeprefix("JSON "))
    assert report["rps_fractional"] == 4.0  # three in-process requests and this one


async def test_bytes_inputs_arrive_as_on_the_wire(server: Server, autojump_clock: Any) -> None:
    for value in (np.array(["héllo", "x"]), np.array([b"h\xc3\xa9llo", b"x"], dtype=object)):
        response = await server.infer("identity_bytes", {"INPUT0": value})
        assert response.as_numpy("OUTPUT0").tolist() == ["héllo".encode(), b"x"]
    with pytest.raises(InvalidArgumentError, match="str or bytes, not int"):
        await server.infer("identity_bytes", {"INPUT0": np.array([1, "a"], dtype=object)})


@pytest.mark.parametrize(
    ("model", "inputs", "settings", "error", "message"),
    [
        ("nope", {}, {}, NotFoundError, "unknown model"),
        ("simple", {}, {"version": 7}, NotFoundError, "version 7 is not found"),
        (
            "simple",
            {"INPUT0": np.zeros((1, 16)), "INPUT1": np.zeros((1, 16))},
            {},
            InvalidArgumentError,
            "data-type is 'FP64', but model 'simple' expects 'INT32'",
        ),
        ("simple", {"INPUT0": np.zeros((1, 16), np.int32)}, {}, InvalidArgumentError, "missing"),
        ("simple", simple_inputs(), {"outputs": ["Z"]}, InvalidArgumentError, "output 'Z'"),
        (
            "simple",
            simple_inputs(),
            {"parameters": {"priority": -1}},
            InvalidArgumentError,
            "'priority'",
        ),
        ("fail", {"INPUT0": np.zeros(1, np.int32)}, {}, trioserve.InternalError, "fail"),
    ],
)
async def test_infer_errors_are_the_front_ends(
    server: Server, model: str, inputs: Any, settings: Any, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        await server.infer(model, inputs, **settings)
    # The server goes on serving.
    assert (await server.infer("simple", simple_inputs())).model_name == "simple"


async def test_generate_streams_what_the_generate_endpoint_answers(
    server: Server, autojump_clock: Any
) -> None:
    pieces = [p async for p in server.generate("tiny_lm", "hello", max_tokens=6, temperature=0)]
    assert len(pieces) == 6 and all(pieces)
    async with asgi_client(server) as client:
        answer = await client.post(
            "/v2/models/tiny_lm/generate",
            json={"text_input": "hello", "max_tokens": 6, "temperature": 0},
        )
    assert answer.json()["text_output"] == "".join(pieces)
    assert server.registry is not None
    # The engine's iteration stats reach the metrics through a task of their own.
    await trio.testing.wait_all_tasks_blocked()
    tokens = server.registry.get_sample_value(
        "vllm:generation_tokens_total", {"model_name": "tiny_lm"}
    )
    assert tokens == 12


async def test_engine_ids_are_the_servers_never_the_clients(
    server: Server, autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OIP inference of a generative model and a generation draw their engine ids
    from the server's one counter; two requests that share a client id stay apart."""
    seen: list[str] = []
    add = LLMEngine.add

    async def recording(engine: LLMEngine, request: Any, sink: Any) -> Any:
        seen.append(request.request_id)
        return await add(engine, request, sink)

    monkeypatch.setattr(LLMEngine, "add", recording)
    prompt = {"text_input": np.array([b"hello"], dtype=object)}
    for _ in range(2):
        answer = await server.infer(
            "tiny_lm", prompt, request_id="same", parameters={"max_tokens": 2}
        )
        assert answer.id == "same"  # the client's id stays in its answer
    # Greedy: a sampled pair of tokens may end the text before any of it shows.
    assert [p async for p in server.generate("tiny_lm", "hello", max_tokens=2, temperature=0)]
    assert seen == ["infer-1", "infer-2", "inprocess-3"]


async def test_leaving_a_generation_early_frees_its_cache(
    server: Server, autojump_clock: Any
) -> None:
    engine: Any = server.repository.get("tiny_lm")
    async with aclosing(server.generate("tiny_lm", "hello", max_tokens=50)) as pieces:
        async for _ in pieces:
            assert engine.kv_cache_state().used_blocks > 0
            break
    assert engine.kv_cache_state().used_blocks == 0


async def _drain(pieces: AsyncIterator[str]) -> list[str]:
    return [p async for p in pieces]


@pytest.mark.parametrize(
    ("model", "sampling", "error", "message"),
    [
        ("simple", {}, UnsupportedError, "not a generative model"),
        ("nope", {}, NotFoundError, "unknown model"),
        ("tiny_lm", {"n": 2}, InvalidArgumentError, "n must be 1"),
        ("tiny_lm", {"max_tokens": 0}, InvalidArgumentError, "max_tokens"),
        ("tiny_lm", {"top_p": "high"}, InvalidArgumentError, "'top_p' must be a finite number"),
    ],
)
async def test_generate_errors(
    server: Server, model: str, sampling: Any, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        await _drain(server.generate(model, "hello", **sampling))


async def test_rest_app_beside_a_listener_is_the_one_it_serves(nursery: trio.Nursery) -> None:
    config = ServerConfig(models=reference_zoo(), http_port=0, grpc_port=None)
    server: Server = await nursery.start(trioserve.serve, config)
    body = {
        "inputs": [
            {"name": name, "datatype": "INT32", "shape": [1, 16], "data": array.ravel().tolist()}
            for name, array in simple_inputs().items()
        ]
    }
    async with asgi_client(server) as in_process, httpx.AsyncClient() as remote:
        via_app = await in_process.post("/v2/models/simple/infer", json=body)
        url = f"http://127.0.0.1:{server.http_port}/v2/models/simple/infer"
        via_socket = await remote.post(url, json=body)
        assert via_app.json() == via_socket.json()
        stats = await in_process.get("/v2/models/simple/stats")
    assert stats.json()["model_stats"][0]["inference_count"] == 2
