"""generate and generate_stream over real HTTP on both servers, against the scripted engine.

The engine here is ``ScriptedLM`` (conftest): deterministic text, and hooks to hold a
request mid-generation and to see whether it finished or was aborted.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import h2.connection
import h2.events
import httpx
import pytest
import trio

from trioserve import HttpLimits, ServerConfig
from trioserve._context import server_context
from trioserve._inprocess import InProcessFrontEnd
from trioserve._served import ModelRepository
from trioserve.models import reference_zoo
from trioserve.rest._endpoints import build_app
from trioserve.rest._http11 import serve_http11
from trioserve.rest._hypercorn import serve_hypercorn
from trioserve.scheduler._runner import ModelRunner

TIMEOUT = 20  # seconds; generous for a loaded machine, still fails a hung test
SERVERS = {"stdlib": serve_http11, "hypercorn": serve_hypercorn}
EVENT_STREAM = "text/event-stream; charset=utf-8"


@pytest.fixture(params=sorted(SERVERS))
async def port(request: pytest.FixtureRequest, nursery: trio.Nursery, scripted_lm: Any) -> int:
    simple = next(m for m in reference_zoo() if m.name == "simple")
    repository = ModelRepository([scripted_lm, ModelRunner(simple, "1")])
    await nursery.start(repository.run)
    app = build_app(server_context(ServerConfig(), repository))
    serve = partial(SERVERS[request.param], app, "127.0.0.1", 0, HttpLimits())
    addresses = await nursery.start(app.serve_with, serve)
    return int(addresses[0][1])


@pytest.fixture
async def http(port: int) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as client:
        yield client


async def events(response: httpx.Response) -> AsyncIterator[Any]:
    """The JSON of each SSE event, checking the framing on the way."""
    async for line in response.aiter_lines():
        if line:
            assert line.startswith("data: ")
            yield json.loads(line[len("data: ") :])


def head(**extra: Any) -> dict[str, Any]:
    return {"model_name": "scripted_lm", "model_version": "1", **extra}


async def test_front_ends_number_generations_with_one_counter(
    nursery: trio.Nursery, scripted_lm: Any
) -> None:
    """The engine's request ids come from the server's pipeline, whichever front end
    asked; a client's own ``id`` stays in its answer only."""
    repository = ModelRepository([scripted_lm])
    await nursery.start(repository.run)
    context = server_context(ServerConfig(), repository)
    app = build_app(context)
    serve = partial(serve_http11, app, "127.0.0.1", 0, HttpLimits())
    ((_, port),) = await nursery.start(app.serve_with, serve)
    body = {"id": "mine", "text_input": "a", "parameters": {"max_tokens": 1}}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as http:
        with trio.fail_after(TIMEOUT):
            assert (await http.post("/v2/models/scripted_lm/generate", json=body)).is_success
            async for _ in InProcessFrontEnd(context).generate("scripted_lm", "b", max_tokens=1):
                pass
            stream = await http.post("/v2/models/scripted_lm/generate_stream", json=body)
            assert stream.is_success
    ids = [request.request_id for request in scripted_lm.requests]
    assert ids == ["http-1", "inprocess-2", "http-3"]


# --- generate --------------------------------------------------------------------------


async def test_generate_answers_one_json_object(http: httpx.AsyncClient, scripted_lm: Any) -> None:
    with trio.fail_after(TIMEOUT):
        response = await http.post(
            "/v2/models/scripted_lm/generate",
            json={"id": "r1", "text_input": "hello", "parameters": {"max_tokens": 3, "seed": 7}},
        )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json() == head(id="r1", text_output=" w0 w1 w2", finish_reason="length")
    (request,) = scripted_lm.requests
    assert request.prompt == "hello"
    assert (request.sampling.max_tokens, request.sampling.seed) == (3, 7)
    assert scripted_lm.ended == {request.request_id: "finished"}


async def test_generate_with_n_answers_arrays_in_sample_order(http: httpx.AsyncClient) -> None:
    with trio.fail_after(TIMEOUT):
        response = await http.post(
            "/v2/models/scripted_lm/versions/1/generate",
            json={"text_input": "x", "parameters": {"max_tokens": 2, "n": 3}},
        )
    assert response.status_code == 200
    assert response.json() == head(
        text_output=[" s0w0 s0w1", " s1w0 s1w1", " s2w0 s2w1"],
        finish_reason=["length", "length", "length"],
    )


async def test_sampling_keys_at_the_top_level(http: httpx.AsyncClient, scripted_lm: Any) -> None:
    document = {
        "text_input": "x",
        "max_tokens": 2,
        "temperature": 0,
        "stop": "\n",
        "priority": 3,
        "parameters": {"stream": False, "top_k": 5},  # unknown parameters are ignored
    }
    with trio.fail_after(TIMEOUT):
        response = await http.post("/v2/models/scripted_lm/generate", json=document)
    assert response.json()["text_output"] == " w0 w1"
    (request,) = scripted_lm.requests
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.stop) == (2, 0.0, ("\n",))
    assert (sampling.top_k, request.priority) == (5, 3)


BAD_REQUESTS = [
    (b"{", "malformed JSON in the request"),
    (b"[1]", "the request must be a JSON object"),
    (b"{}", "the request must carry 'text_input'"),
    (b'{"text_input": 5}', "'text_input' must be a string"),
    (b'{"text_input": "x", "id": 5}', "request 'id' must be a string"),
    (b'{"text_input": "x", "parameters": []}', "request 'parameters' must be a JSON object"),
    (b'{"text_input": "x", "stream": 0, "parameters": {"stream": 1}}', "['stream'] given both"),
    (b'{"text_input": "x", "n": 2, "parameters": {"n": 2}}', "['n'] given both at the top"),
    (b'{"text_input": "x", "parameters": {"max_tokens": "9"}}', "'max_tokens' must be an integer"),
    (b'{"text_input": "x", "parameters": {"max_tokens": 0}}', "'max_tokens' must be an integer in"),
    (b'{"text_input": "x", "parameters": {"temperature": -1}}', "'temperature' must be a finite"),
    (b'{"text_input": "x", "parameters": {"top_p": 0}}', "'top_p' must be a finite number in (0"),
    (b'{"text_input": "x", "parameters": {"n": 0}}', "'n' must be an integer in [1, 2**63 - 1]"),
    (b'{"text_input": "x", "parameters": {"stop": [""]}}', "'stop' must be a non-empty string"),
    (b'{"text_input": "x", "parameters": {"priority": 1.5}}', "'priority' must be an integer"),
]


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
@pytest.mark.parametrize(("body", "message"), BAD_REQUESTS)
async def test_bad_requests_answer_400(
    http: httpx.AsyncClient, scripted_lm: Any, endpoint: str, body: bytes, message: str
) -> None:
    with trio.fail_after(TIMEOUT):
        response = await http.post(f"/v2/models/scripted_lm/{endpoint}", content=body)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert message in response.json()["error"]
    assert scripted_lm.requests == []


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
async def test_models_that_do_not_generate(http: httpx.AsyncClient, endpoint: str) -> None:
    """A model that is not generative takes its own inputs (``test_generate_tensors``):
    ``text_input`` is none of ``simple``'s, so it is a parameter and the inputs lack."""
    with trio.fail_after(TIMEOUT):
        simple = await http.post(f"/v2/models/simple/{endpoint}", json={"text_input": "x"})
        unknown = await http.post(f"/v2/models/nope/{endpoint}", json={"text_input": "x"})
    assert simple.status_code == 400
    assert simple.json() == {
        "error": "expected 2 inputs but got 0 inputs for model 'simple'; missing: INPUT0, INPUT1"
    }
    assert unknown.status_code == 404
    assert unknown.json() == {"error": "Request for unknown model: 'nope' is not found"}


async def test_engine_refusal_is_an_ordinary_error(http: httpx.AsyncClient) -> None:
    with trio.fail_after(TIMEOUT):
        response = await http.post("/v2/models/scripted_lm/generate", json={"text_input": "refuse"})
    assert response.status_code == 400
    assert response.json() == {"error": "the prompt is refused"}


async def test_generate_aborts_when_the_client_leaves(port: int, scripted_lm: Any) -> None:
    scripted_lm.hold_after = 1
    with trio.fail_after(TIMEOUT):
        client = await _post("generate", {"text_input": "x"}, port)
        await scripted_lm.wait_until(lambda: len(scripted_lm.requests) == 1)
        await client.aclose()
        await scripted_lm.wait_until(lambda: scripted_lm.ended)
    assert list(scripted_lm.ended.values()) == ["abort"]


# --- generate_stream -------------------------------------------------------------------


async def test_stream_frames_on_the_wire(port: int) -> None:
    """The exact bytes: SSE events in HTTP/1.1 chunks, no sentinel, a clean end."""
    with trio.fail_after(TIMEOUT):
        client = await _post(
            "generate_stream", {"id": "s", "text_input": "x", "max_tokens": 2}, port
        )
        received = await _read_until(client, b"0\r\n\r\n")
        await client.aclose()
    head_part, _, body = received.partition(b"\r\n\r\n")
    lines = head_part.lower().split(b"\r\n")
    assert lines[0].startswith(b"http/1.1 200")
    assert b"content-type: text/event-stream; charset=utf-8" in lines
    assert b"transfer-encoding: chunked" in lines
    assert _unchunk(body) == (
        b'data: {"id":"s","model_name":"scripted_lm","model_version":"1","text_output":" w0"}\n\n'
        b'data: {"id":"s","model_name":"scripted_lm","model_version":"1","text_output":" w1",'
        b'"finish_reason":"length"}\n\n'
    )


async def test_stream_is_incremental(http: httpx.AsyncClient, scripted_lm: Any) -> None:
    """The first events reach the client while the engine holds the rest back: a server
    that buffered the body would never show them, and the test would time out."""
    scripted_lm.hold_after = 2
    with trio.fail_after(TIMEOUT):
        async with http.stream(
            "POST",
            "/v2/models/scripted_lm/generate_stream",
            json={"text_input": "x", "max_tokens": 4},
        ) as response:
            assert response.headers["content-type"] == EVENT_STREAM
            received = events(response)
            assert await anext(received) == head(text_output=" w0")
            assert await anext(received) == head(text_output=" w1")
            assert not scripted_lm.release.is_set()
            scripted_lm.release.set()
            rest = [event async for event in received]
    assert rest == [head(text_output=" w2"), head(text_output=" w3", finish_reason="length")]


async def test_stream_with_n_tags_each_sample(http: httpx.AsyncClient) -> None:
    with trio.fail_after(TIMEOUT):
        async with http.stream(
            "POST",
            "/v2/models/scripted_lm/generate_stream",
            json={"text_input": "x", "parameters": {"max_tokens": 2, "n": 2}},
        ) as response:
            received = [event async for event in events(response)]
    assert received == [
        head(text_output=" s0w0", index=0),
        head(text_output=" s1w0", index=1),
        head(text_output=" s0w1", index=0, finish_reason="length"),
        head(text_output=" s1w1", index=1, finish_reason="length"),
    ]


async def test_stream_error_before_the_first_token(http: httpx.AsyncClient) -> None:
    with trio.fail_after(TIMEOUT):
        response = await http.post(
            "/v2/models/scripted_lm/generate_stream", json={"text_input": "refuse"}
        )
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": "the prompt is refused"}


async def test_stream_error_midway_is_an_event(http: httpx.AsyncClient) -> None:
    with trio.fail_after(TIMEOUT):
        async with http.stream(
            "POST", "/v2/models/scripted_lm/generate_stream", json={"text_input": "fail"}
        ) as response:
            assert response.status_code == 200
            received = [event async for event in events(response)]
    assert received == [
        head(text_output=" w0"),
        head(text_output=" w1"),
        {"error": "the engine failed"},
    ]


async def test_stream_aborts_when_the_client_leaves(
    port: int, scripted_lm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    scripted_lm.hold_after = 1
    with trio.fail_after(TIMEOUT):
        client = await _post("generate_stream", {"text_input": "x", "max_tokens": 5}, port)
        await _read_until(client, b'" w0"}\n\n')
        await client.aclose()
        await scripted_lm.wait_until(lambda: scripted_lm.ended)
        await _served_once_more(port)  # the server has finished with the abandoned one
    assert list(scripted_lm.ended.values()) == ["abort"]
    # A client leaving is no failure of the server's.
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


async def test_concurrent_streams(http: httpx.AsyncClient, scripted_lm: Any) -> None:
    results: dict[int, list[Any]] = {}

    async def one(i: int) -> None:
        document = {"id": str(i), "text_input": "x", "max_tokens": 3 + i}
        async with http.stream(
            "POST", "/v2/models/scripted_lm/generate_stream", json=document
        ) as response:
            results[i] = [event["text_output"] async for event in events(response)]

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
    assert results == {i: [f" w{k}" for k in range(3 + i)] for i in range(8)}
    assert sorted(scripted_lm.ended.values()) == ["finished"] * 8


# --- raw HTTP helpers ------------------------------------------------------------------


async def _post(endpoint: str, document: Any, port: int) -> trio.SocketStream:
    return await _post_to("scripted_lm", endpoint, document, port)


async def _post_to(model: str, endpoint: str, document: Any, port: int) -> trio.SocketStream:
    body = json.dumps(document).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(
        b"POST /v2/models/%s/%s HTTP/1.1\r\nhost: test\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (model.encode(), endpoint.encode(), len(body), body)
    )
    return stream


async def _served_once_more(port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        assert (await client.get("/v2/health/live")).status_code == 200


async def _read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        data = await stream.receive_some()
        assert data, f"connection closed before {marker!r}; got {received!r}"
        received += data
    return received


def _unchunk(body: bytes) -> bytes:
    data = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n"
            return data
        data += body[:size]
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


# --- end to end with tiny_lm -----------------------------------------------------------

tiny = pytest.mark.parametrize("tiny_server", sorted(SERVERS), indirect=True)


@pytest.fixture
async def tiny_http(tiny_server: Any) -> AsyncIterator[httpx.AsyncClient]:
    base = f"http://127.0.0.1:{tiny_server.http_port}"
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as client:
        yield client


@tiny
async def test_tiny_lm_concurrent_streams_match_generate(tiny_http: httpx.AsyncClient) -> None:
    """16 streams at once; greedy sampling, so each stream's text, pieced together, is what
    generate answers for the same prompt."""
    streamed: dict[int, list[Any]] = {}

    async def one(i: int) -> None:
        document = {"text_input": f"prompt {i}:", "max_tokens": 12, "temperature": 0}
        async with tiny_http.stream(
            "POST", "/v2/models/tiny_lm/generate_stream", json={**document, "ignore_eos": True}
        ) as response:
            assert response.status_code == 200
            streamed[i] = [event async for event in events(response)]

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, i)
        for i, received in streamed.items():
            assert received[-1]["finish_reason"] == "length"
            assert all("finish_reason" not in event for event in received[:-1])
            document = {"text_input": f"prompt {i}:", "parameters": {"max_tokens": 12}}
            document["parameters"] |= {"temperature": 0, "ignore_eos": True}
            answer = (await tiny_http.post("/v2/models/tiny_lm/generate", json=document)).json()
            assert "".join(event["text_output"] for event in received) == answer["text_output"]
            assert answer["finish_reason"] == "length"


@tiny
async def test_tiny_lm_generate_with_n(tiny_http: httpx.AsyncClient) -> None:
    document = {"text_input": "Hello", "parameters": {"max_tokens": 6, "n": 3, "seed": 1}}
    with trio.fail_after(TIMEOUT):
        response = await tiny_http.post("/v2/models/tiny_lm/generate", json=document)
        again = await tiny_http.post("/v2/models/tiny_lm/generate", json=document)
    assert response.status_code == 200
    answer = response.json()
    assert (answer["model_name"], answer["model_version"]) == ("tiny_lm", "1")
    assert len(answer["text_output"]) == 3 and all(answer["text_output"])
    assert len(answer["finish_reason"]) == 3
    assert set(answer["finish_reason"]) <= {"stop", "length"}
    assert again.json() == answer  # seeded: the same samples again


@tiny
async def test_tiny_lm_disconnect_frees_every_block(tiny_server: Any, generate_exits: Any) -> None:
    runner = tiny_server.repository.get("tiny_lm")
    exits = generate_exits(runner)
    document = {"text_input": "x" * 100, "max_tokens": 900, "ignore_eos": True}
    with trio.fail_after(TIMEOUT):
        client = await _post_to("tiny_lm", "generate_stream", document, tiny_server.http_port)
        await _read_until(client, b"\n\n")  # the first event: prefill done, decoding
        assert runner.kv_cache_state().used_blocks > 0
        await client.aclose()
        await exits.wait_for(1)
    assert runner.kv_cache_state().used_blocks == 0
    assert not runner.engine.policy.has_work


@tiny
async def test_tiny_lm_errors(tiny_http: httpx.AsyncClient) -> None:
    with trio.fail_after(TIMEOUT):
        bad = await tiny_http.post(
            "/v2/models/tiny_lm/generate_stream", json={"text_input": "x", "temperature": -1}
        )
        too_long = await tiny_http.post(
            "/v2/models/tiny_lm/generate_stream", json={"text_input": "x" * 2000}
        )
        not_generative = await tiny_http.post(
            "/v2/models/simple/generate", json={"text_input": "x"}
        )
    assert bad.status_code == 400
    assert bad.json() == {"error": "parameter 'temperature' must be a finite number >= 0"}
    # The engine refuses it before the first token: an ordinary JSON error, not an event.
    assert too_long.status_code == 400
    assert too_long.headers["content-type"] == "application/json"
    assert "takes at most 1024 tokens" in too_long.json()["error"]
    assert not_generative.status_code == 400
    assert "missing: INPUT0, INPUT1" in not_generative.json()["error"]


async def test_http2_streams_and_aborts_on_reset(nursery: trio.Nursery, scripted_lm: Any) -> None:
    """Hypercorn over h2c: the first event arrives while the engine holds the rest, and
    resetting the HTTP/2 stream aborts the generation."""
    app = build_app(server_context(ServerConfig(), ModelRepository([scripted_lm])))
    serve = partial(serve_hypercorn, app, "127.0.0.1", 0, HttpLimits())
    (address,) = await nursery.start(app.serve_with, serve)
    scripted_lm.hold_after = 1
    connection = h2.connection.H2Connection()
    body = b'{"text_input": "x"}'
    with trio.fail_after(TIMEOUT):
        sock = await trio.open_tcp_stream("127.0.0.1", address[1])
        connection.initiate_connection()
        connection.send_headers(
            1,
            [
                (":method", "POST"),
                (":path", "/v2/models/scripted_lm/generate_stream"),
                (":scheme", "http"),
                (":authority", "test"),
                ("content-length", str(len(body))),
            ],
        )
        connection.send_data(1, body, end_stream=True)
        await sock.send_all(connection.data_to_send())
        received = b""
        while b"\n\n" not in received:
            for event in connection.receive_data(await sock.receive_some()):
                if isinstance(event, h2.events.ResponseReceived):
                    assert (b":status", b"200") in event.headers
                    assert (b"content-type", EVENT_STREAM.encode()) in event.headers
                elif isinstance(event, h2.events.DataReceived):
                    received += event.data
                    connection.acknowledge_received_data(event.flow_controlled_length, 1)
            await sock.send_all(connection.data_to_send())
        assert json.loads(received.removeprefix(b"data: ")) == head(text_output=" w0")
        connection.reset_stream(1)
        await sock.send_all(connection.data_to_send())
        await scripted_lm.wait_until(lambda: scripted_lm.ended)
        await sock.aclose()
    assert list(scripted_lm.ended.values()) == ["abort"]
