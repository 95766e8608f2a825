"""Clients people already use, unmodified: the KServe SDK's REST and gRPC clients,
litellm's Triton provider (the bodies it sends, as its source builds them), and the
``openai`` client's model lookup."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from trioserve import Server, ServerConfig
from trioserve.models import TinyLM, reference_zoo
from trioserve.testing import server_in_thread


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    config = ServerConfig(
        models=[*reference_zoo(), TinyLM(num_kv_blocks=64)], http_port=0, grpc_port=0
    )
    with server_in_thread(config) as running:
        yield running


# The KServe SDK registers its own copy of the protocol's messages ("inference.*") in
# protobuf's default pool, as tritonclient does: one process cannot import both, so the
# SDK's sessions run in an interpreter of their own (as a KServe user's program would),
# print what they found, and fail loudly on any error.
_KSERVE_SESSION = """
import asyncio, json, sys
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

http, grpc = sys.argv[1:]
x = np.arange(16, dtype=np.int32).reshape(1, 16)


def request():
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = InferInput(name=name, shape=[1, 16], datatype="INT32")
        tensor.set_data_from_numpy(x, binary_data=False)
        inputs.append(tensor)
    return InferRequest(model_name="simple", infer_inputs=inputs)


def sums(response):
    return {o.name: o.as_numpy().reshape(1, 16).tolist() for o in response.outputs}


async def rest():
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=30))
    try:
        return {
            "outputs": sums(await client.infer(http, request(), model_name="simple")),
            "live": await client.is_server_live(http),
            "ready": await client.is_server_ready(http),
            "model_ready": await client.is_model_ready(http, "simple"),
            "missing_ready": await client.is_model_ready(http, "no_such_model"),
        }
    finally:
        await client.close()


async def grpc_session():
    client = InferenceGRPCClient(grpc, timeout=30)
    try:
        return {
            "outputs": sums(await client.infer(request())),
            "live": await client.is_server_live(),
            "ready": await client.is_server_ready(),
            "model_ready": await client.is_model_ready("simple"),
        }
    finally:
        await client.close()


print(json.dumps({"rest": asyncio.run(rest()), "grpc": asyncio.run(grpc_session())}))
"""


def test_kserve_clients(server: Server) -> None:
    http, grpc = f"http://127.0.0.1:{server.http_port}", f"127.0.0.1:{server.grpc_port}"
    done = subprocess.run(
        [sys.executable, "-c", _KSERVE_SESSION, http, grpc],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    x = np.arange(16).reshape(1, 16)
    expected = {"OUTPUT0": (x + x).tolist(), "OUTPUT1": (x - x).tolist()}
    assert found["rest"] == {
        "outputs": expected, "live": True, "ready": True, "model_ready": True,
        "missing_ready": False,
    }  # fmt: skip
    assert found["grpc"] == {"outputs": expected, "live": True, "ready": True, "model_ready": True}


def test_infer_body_names_must_match_the_url(server: Server) -> None:
    url = f"http://127.0.0.1:{server.http_port}/v2/models/simple"
    tensor = {"datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
    body: dict[str, Any] = {
        "inputs": [{"name": "INPUT0", **tensor}, {"name": "INPUT1", **tensor}],
    }
    for names, where, status in [
        ({"model_name": "simple", "model_version": "1"}, "/versions/1", 200),
        ({"model_name": "simple", "model_version": "1"}, "", 200),  # the policy picks
        ({"model_name": None}, "", 200),
        ({"model_name": "simple_string"}, "", 400),
        ({"model_version": "2"}, "/versions/1", 400),
        ({"model_name": 5}, "", 400),
    ]:
        response = httpx.post(url.replace("/simple", f"/simple{where}") + "/infer",
                              json={**body, **names})  # fmt: skip
        assert response.status_code == status, (names, where, response.text)
        if status == 400:
            assert "model_" in response.json()["error"]


def test_health_answers_carry_kserve_bodies(server: Server) -> None:
    base = f"http://127.0.0.1:{server.http_port}/v2"
    assert httpx.get(f"{base}/health/live").json() == {"live": True}
    assert httpx.get(f"{base}/health/ready").json() == {"ready": True}
    assert httpx.get(f"{base}/models/simple/ready").json() == {"name": "simple", "ready": True}
    # Not ready stays what Triton's clients read: 400 with no body.
    missing = httpx.get(f"{base}/models/nothing/ready")
    assert (missing.status_code, missing.content) == (400, b"")


# What litellm's triton provider posts (TritonGenerateConfig.transform_request): the
# sampling settings in "parameters" with TensorRT-LLM's word lists, "stream" at the top
# level; streaming requests go to generate_stream.
def _litellm_body(stream: bool) -> dict[str, Any]:
    return {
        "text_input": "Hello",
        "parameters": {"max_tokens": 4, "bad_words": [""], "stop_words": [""]},
        "stream": stream,
    }


def test_litellm_triton_generate_bodies(server: Server) -> None:
    base = f"http://127.0.0.1:{server.http_port}/v2/models/tiny_lm"
    answer = httpx.post(f"{base}/generate", json=_litellm_body(False), timeout=30)
    assert answer.status_code == 200, answer.text
    assert isinstance(answer.json()["text_output"], str)
    with httpx.stream("POST", f"{base}/generate_stream", json=_litellm_body(True)) as events:
        assert events.status_code == 200
        data = [line for line in events.iter_lines() if line.startswith("data: ")]
    assert data and '"text_output"' in data[0]
    # Given twice, once at the top level and once in parameters, is still an error.
    twice = {**_litellm_body(False), "parameters": {"stream": False}}
    refused = httpx.post(f"{base}/generate", json=twice)
    assert refused.status_code == 400
    assert "['stream'] given both" in refused.json()["error"]


def test_openai_models_retrieve(server: Server) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="-")
    model = client.models.retrieve("tiny_lm")
    assert (model.id, model.object, model.owned_by) == ("tiny_lm", "model", "trioserve")
    assert model.created == client.models.list().data[0].created
    for name in ("simple", "no_such_model"):  # not generative, not served
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve(name)
        assert f"The model '{name}' does not exist" in str(missing.value)
    client.close()
