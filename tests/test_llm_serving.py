"""tiny_lm on a real server: OIP inference with Triton's own clients, config, errors."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import ServerConfig, open_server
from trioserve.models import TinyLM, reference_zoo
from trioserve.repository import load_repository
from trioserve.scheduler import GenerationRequest, SamplingParams, generative
from trioserve.testing import server_in_thread


@pytest.fixture(scope="module")
def server():
    models = [*reference_zoo(), TinyLM(num_kv_blocks=256)]
    config = ServerConfig(models=models, http_port=0, grpc_port=0)
    with server_in_thread(config) as running:
        yield running


def _prompt(module, text):
    tensor = module.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return tensor


def test_http_infer_generates_text(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        parameters = {"max_tokens": 12, "temperature": 0, "n": 2}
        result = client.infer("tiny_lm", [_prompt(httpclient, "Hello")], parameters=parameters)
        texts = result.as_numpy("text_output")
        assert texts.shape == (2,) and texts[0] == texts[1]  # greedy: both samples agree
        assert 1 <= len(texts[0].decode()) <= 12
        again = client.infer("tiny_lm", [_prompt(httpclient, "Hello")], parameters=parameters)
        assert again.as_numpy("text_output").tolist() == texts.tolist()
        with pytest.raises(InferenceServerException, match="'temperature' must be"):
            client.infer("tiny_lm", [_prompt(httpclient, "x")], parameters={"temperature": -1})
        config = client.get_model_config("tiny_lm")
        assert config["model_transaction_policy"] == {"decoupled": True}
        assert [i["data_type"] for i in config["input"]] == ["TYPE_STRING"]
        assert client.get_model_config("simple")["model_transaction_policy"] == {"decoupled": False}
    finally:
        client.close()


def test_grpc_infer_generates_text(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        result = client.infer(
            "tiny_lm",
            [_prompt(grpcclient, "Hello")],
            parameters={"max_tokens": 12, "temperature": 0},
        )
        assert result.as_numpy("text_output").shape == (1,)
        config = client.get_model_config("tiny_lm").config
        assert config.model_transaction_policy.decoupled
    finally:
        client.close()


async def test_a_repository_generative_model_is_served_by_the_engine(tmp_path):
    (tmp_path / "llm" / "2").mkdir(parents=True)
    (tmp_path / "llm" / "2" / "model.py").write_text(
        "from trioserve.models import TinyLM\nmodel = TinyLM(num_kv_blocks=64, max_model_len=128)\n"
    )
    config = ServerConfig(models=load_repository(tmp_path), http_port=None, grpc_port=None)
    async with open_server(config) as running:
        served = generative(running.repository.get("llm"))
        assert served.version == "2" and served.kv_cache_state().total_blocks == 64
        request = GenerationRequest("r", "Hi", SamplingParams(max_tokens=5), trio.current_time())
        async with served.generate(request) as chunks:
            received = [chunk async for chunk in chunks]
        assert sum(len(c.token_ids) for c in received) == 5
        assert received[-1].finish_reason == "length"
