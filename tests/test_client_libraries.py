"""Clients people already use, unmodified: the KServe SDK's REST and gRPC clients,
litellm's Triton provider (the bodies it sends, as its source builds them), and the
``openai`` client's model lookup."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

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


def _simple_request(model_name: str = "simple") -> tuple[InferRequest, np.ndarray]:
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = InferInput(name=name, shape=[1, 16], datatype="INT32")
        tensor.set_data_from_numpy(x, binary_data=False)
        inputs.append(tensor)
    return InferRequest(model_name=model_name, infer_inputs=inputs), x


def test_kserve_rest_client(server: Server) -> None:
    base = f"http://127.0.0.1:{server.http_port}"

    async def session() -> tuple[Any, ...]:
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=30))
        try:
            request, x = _simple_request()
            response = await client.infer(base, request, model_name="simple")
            outputs = {o.name: o.as_numpy() for o in response.outputs}
            np.testing.assert_array_equal(outputs["OUTPUT0"], x + x)
            np.testing.assert_array_equal(outputs["OUTPUT1"], x - x)
            return (
                await client.is_server_live(base),
                await client.is_server_ready(base),
                await client.is_model_ready(base, "simple"),
                await client.is_model_ready(base, "no_such_model"),
            )
        finally:
            await client.close()

    assert asyncio.run(session()) == (True, True, True, False)


def test_kserve_grpc_client(server: Server) -> None:
    async def session() -> tuple[Any, ...]:
        client = InferenceGRPCClient(f"127.0.0.1:{server.grpc_port}", timeout=30)
        try:
            request, x = _simple_request()
            response = await client.infer(request)
            outputs = {o.name: o.as_numpy() for o in response.outputs}
            np.testing.assert_array_equal(outputs["OUTPUT0"].reshape(1, 16), x + x)
            return (
                await client.is_server_live(),
                await client.is_server_ready(),
                await client.is_model_ready("simple"),
            )
        finally:
            await client.close()

    assert asyncio.run(session()) == (True, True, True)


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
