"""Bad request parameters on every front end of a generative model: refused where they
enter, naming the parameter, and the server goes on answering.

Regressions: a negative ``seed`` on an OIP inference stopped the whole server; a huge
``n`` built a list per sample before anything checked it; a refused long prompt's
tokens stayed in memory until a full garbage collection.
"""

from __future__ import annotations

import gc
import json
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import trioserve
from trioserve import Server, ServerConfig
from trioserve.models import TinyLM, reference_zoo
from trioserve.testing import server_in_thread

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    config = ServerConfig(models=[*reference_zoo(), TinyLM()], http_port=0, grpc_port=0)
    with server_in_thread(config) as running:
        yield running


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    url = f"http://127.0.0.1:{server.http_port}"
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture
def grpc(server: Server) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        yield client
    finally:
        client.close()


def oip_body(prompt: str, parameters: dict[str, Any]) -> dict[str, Any]:
    text = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]}
    return {"inputs": [text], "parameters": parameters}


def rest_request(endpoint: str, prompt: str, parameters: dict[str, Any]) -> tuple[str, Any]:
    """(path, JSON body) of a request to tiny_lm with these sampling parameters."""
    if endpoint == "infer":
        return "/v2/models/tiny_lm/infer", oip_body(prompt, parameters)
    if endpoint == "generate":
        return "/v2/models/tiny_lm/generate", {"text_input": prompt, "parameters": parameters}
    if endpoint == "completions":
        return "/v1/completions", {"model": "tiny_lm", "prompt": prompt, **parameters}
    messages = [{"role": "user", "content": prompt}]
    return "/v1/chat/completions", {"model": "tiny_lm", "messages": messages, **parameters}


REST_ENDPOINTS = ["infer", "generate", "completions", "chat"]


def refusal_names(response: httpx.Response, param: str) -> None:
    """A 400 whose body names ``param`` (OpenAI's error object on /v1/*)."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if response.request.url.path.startswith("/v1/"):
        assert error["param"] == param
        assert error["type"] == "invalid_request_error"
        error = error["message"]
    assert f"'{param}'" in error or f"{param}=" in error, error


def still_answers(http: httpx.Client) -> None:
    assert http.get("/v2/health/ready").status_code == 200
    path, body = rest_request("generate", "hi", {"max_tokens": 2, "temperature": 0})
    assert http.post(path, json=body).status_code == 200


@pytest.mark.parametrize("endpoint", REST_ENDPOINTS)
def test_a_negative_seed_is_refused_over_rest(http: httpx.Client, endpoint: str) -> None:
    path, body = rest_request(endpoint, "hello", {"max_tokens": 2, "seed": -1})
    refusal_names(http.post(path, json=body), "seed")
    still_answers(http)


ODD_VALUES = [
    ("temperature", 10**400),  # an integer past any float
    ("repetition_penalty", 10**400),
    ("top_p", float("nan")),
    ("presence_penalty", float("inf")),
    ("max_tokens", True),  # a boolean is no integer
    ("top_k", 1.0),
    ("stop", [""]),
    ("n", 0),
]


@pytest.mark.parametrize(("key", "value"), ODD_VALUES)
@pytest.mark.parametrize("endpoint", REST_ENDPOINTS)
def test_odd_values_are_refused_naming_the_parameter(
    http: httpx.Client, endpoint: str, key: str, value: Any
) -> None:
    path, body = rest_request(endpoint, "hello", {key: value})
    refusal_names(http.post(path, content=json.dumps(body)), key)


def grpc_prompt(text: str) -> grpcclient.InferInput:
    prompt = grpcclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return prompt


def test_a_negative_seed_is_refused_over_grpc(
    http: httpx.Client, grpc: grpcclient.InferenceServerClient
) -> None:
    with pytest.raises(InferenceServerException) as info:
        grpc.infer("tiny_lm", [grpc_prompt("hello")], parameters={"max_tokens": 2, "seed": -1})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "'seed'" in str(info.value.message())
    still_answers(http)


def test_a_negative_seed_is_refused_on_a_stream(
    http: httpx.Client, grpc: grpcclient.InferenceServerClient
) -> None:
    answers: list[Any] = []
    grpc.start_stream(lambda result, error: answers.append(error or result))
    try:
        grpc.async_stream_infer(
            "tiny_lm", [grpc_prompt("hello")], parameters={"max_tokens": 2, "seed": -1}
        )
    finally:
        grpc.stop_stream()  # waits for the answers in flight
    (error,) = answers
    assert isinstance(error, InferenceServerException)
    assert "'seed'" in str(error.message())
    still_answers(http)


def test_the_largest_seeds_sample(http: httpx.Client) -> None:
    for seed in (0, 2**63, 2**64 - 1):
        path, body = rest_request("generate", "hi", {"max_tokens": 2, "seed": seed})
        assert http.post(path, json=body).status_code == 200
    path, body = rest_request("generate", "hi", {"max_tokens": 2, "seed": 2**64})
    refusal_names(http.post(path, json=body), "seed")


@pytest.mark.parametrize("endpoint", REST_ENDPOINTS)
def test_a_huge_n_is_refused_before_anything_is_allocated(
    http: httpx.Client, endpoint: str
) -> None:
    path, body = rest_request(endpoint, "hello", {"max_tokens": 2, "n": 10**9})
    content = json.dumps(body).encode()
    tracemalloc.start()
    try:
        response = http.post(path, content=content)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    refusal_names(response, "n")
    assert "max_num_seqs=128" in response.text
    # A list per sample would be 56 bytes each: a thousandth of them is 56 MB.
    assert peak < 8_000_000
    still_answers(http)


def _held_by_trioserve(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> int:
    """Bytes allocated by trioserve's code between the snapshots and still alive."""
    source = tracemalloc.Filter(True, str(Path(trioserve.__file__).parent / "*"))
    grown = after.filter_traces([source]).compare_to(before.filter_traces([source]), "filename")
    return sum(stat.size_diff for stat in grown if stat.size_diff > 0)


LONG_PROMPT = "a" * 2_000_000  # tiny_lm takes 1024 tokens: its 2M tokens take 16 MB


def _long_prompt_calls(
    http: httpx.Client, grpc: grpcclient.InferenceServerClient
) -> dict[str, Callable[[], None]]:
    def rest(endpoint: str) -> Callable[[], None]:
        def call() -> None:
            path, body = rest_request(endpoint, LONG_PROMPT, {"max_tokens": 2})
            assert http.post(path, json=body).status_code == 400

        return call

    def grpc_infer() -> None:
        with pytest.raises(InferenceServerException, match="the prompt is 2000000 tokens"):
            grpc.infer("tiny_lm", [grpc_prompt(LONG_PROMPT)], parameters={"max_tokens": 2})

    return {**{e: rest(e) for e in REST_ENDPOINTS}, "grpc": grpc_infer}


@pytest.mark.parametrize("endpoint", [*REST_ENDPOINTS, "grpc"])
def test_a_refused_long_prompt_is_freed_at_once(
    http: httpx.Client, grpc: grpcclient.InferenceServerClient, endpoint: str
) -> None:
    call = _long_prompt_calls(http, grpc)[endpoint]
    call()  # warm: whatever the first request of a kind sets up once
    gc.collect()
    gc.disable()  # only reference counting frees anything now
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        call()
        # One more round trip on each connection: the refused request's handler is done.
        assert http.get("/v2/health/ready").status_code == 200
        assert grpc.is_server_ready()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
        gc.enable()
    assert _held_by_trioserve(before, after) < 2_000_000


def simple_body(parameters: dict[str, Any]) -> dict[str, Any]:
    data = list(range(16))
    tensors = [
        {"name": name, "datatype": "INT32", "shape": [1, 16], "data": data}
        for name in ("INPUT0", "INPUT1")
    ]
    return {"inputs": tensors, "parameters": parameters}


@pytest.mark.parametrize("key", ["timeout", "priority"])
def test_tensor_scheduling_parameters_stay_in_uint64(http: httpx.Client, key: str) -> None:
    """A queue deadline past what a float holds stopped the batcher that waited on it."""
    ok = http.post("/v2/models/simple/infer", json=simple_body({key: 2**64 - 1}))
    assert ok.status_code == 200, ok.text
    for bad in (2**64, 10**400, -1, True, 1.0, "1"):
        content = json.dumps(simple_body({key: bad}))
        refusal_names(http.post("/v2/models/simple/infer", content=content), key)
    still_answers(http)
