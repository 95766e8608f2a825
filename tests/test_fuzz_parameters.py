"""Fuzzing request parameters on every front end of a generative model (OIP over REST
and gRPC, generate, OpenAI) and on tensor and sequence models: each answered with a
success or a client error in the protocol's format, the server alive after each, nothing
logged as a failure. ``tools/fuzz.py`` runs these with many random examples too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

import trioserve
from trioserve import Server, ServerConfig
from trioserve.models import TinyLM, reference_zoo
from trioserve.scheduler import PARAMETERS
from trioserve.testing import server_in_thread

from ._fuzzing import (
    ErrorRecords,
    check_grpc,
    fuzz_settings,
    json_values,
)

# --- request parameters of a generative model and of sequence models, every front end ---

# Values at and beyond every range of the parameter table, of every JSON type.
parameter_edges = st.sampled_from([
    -1, 0, 1, 2, 4, 5, 20, 21, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**400, -(2**63) - 1,
    -2.5, -2.0, -0.0, 1e-6, 0.5, 1.0, 1.5, 2.0, 1e300, float("nan"), float("inf"),
    float("-inf"), "", "x", "\n", "\ud800", [], [""], ["a", "\ud800"], {}, {"a": 1},
])  # fmt: skip
LLM_PARAMETERS = sorted(
    {name for row in PARAMETERS for dialect in ("vllm", "completions", "chat")
     for name in row.wire_names(dialect)}
    | {"stream", "echo", "logprobs", "top_logprobs", "best_of", "stream_options", "user",
       "sequence_id", "timeout"}
)  # fmt: skip
llm_parameters = st.dictionaries(
    st.sampled_from(LLM_PARAMETERS) | st.text(max_size=6),
    parameter_edges | json_values,
    max_size=6,
)
# Generation stays short whatever max_tokens and n say: 24 tokens at most, 4 samples.
FUZZ_LM = {"max_model_len": 24, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def llm_server(error_records: ErrorRecords) -> Iterator[Server]:
    """tiny_lm (kept short) beside the zoo and the Triton example repository (its
    sequence models), on the built-in servers."""
    config = ServerConfig(
        models=[*reference_zoo(), TinyLM(**FUZZ_LM)],
        model_repositories=[Path(trioserve.__file__).parent / "models" / "triton"],
        http_port=0,
        grpc_port=0,
    )
    with server_in_thread(config) as server:
        yield server


def check_answer(response: httpx.Response, client: httpx.Client, *, timed: bool = False) -> None:
    """An answer or a client error in the protocol's JSON shape (503 too for a request
    with a queue ``timeout``, which may expire); the server goes on."""
    allowed = (200, 400, 503) if timed else (200, 400)
    assert response.status_code in allowed, (response.status_code, response.text[:300])
    if response.status_code != 200:
        error = response.json()["error"]
        if response.request.url.path.startswith("/v1/"):
            assert error.keys() == {"message", "type", "param", "code"}, error
        else:
            assert isinstance(error, str)
    assert client.get("/v2/health/ready").status_code == 200


def test_live_generate_parameters(llm_server: Server, error_records: ErrorRecords) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{llm_server.http_port}", timeout=30) as client:

        @fuzz_settings(60)
        @given(st.sampled_from(["generate", "generate_stream"]), llm_parameters, llm_parameters)
        def prop(endpoint: str, parameters: dict[str, Any], top: dict[str, Any]) -> None:
            document = {"text_input": "hi", "parameters": parameters, **top}
            content = json.dumps(document)
            check_answer(client.post(f"/v2/models/tiny_lm/{endpoint}", content=content), client)
            assert error_records.take() == []

        prop()


def test_live_openai_parameters(llm_server: Server, error_records: ErrorRecords) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{llm_server.http_port}", timeout=30) as client:

        @fuzz_settings(60)
        @given(st.booleans(), llm_parameters)
        def prop(chat: bool, parameters: dict[str, Any]) -> None:
            asked: dict[str, Any] = {"model": "tiny_lm"}
            if chat:
                asked["messages"] = [{"role": "user", "content": "hi"}]
            else:
                asked["prompt"] = "hi"
            content = json.dumps({**parameters, **asked})
            path = "/v1/chat/completions" if chat else "/v1/completions"
            check_answer(client.post(path, content=content), client)
            assert error_records.take() == []

        prop()


def test_live_oip_llm_parameters(llm_server: Server, error_records: ErrorRecords) -> None:
    """OIP inference on tiny_lm: parameters in the request and in a ``sampling_parameters``
    input, of every type; then the same over gRPC, typed as the wire types them."""
    with httpx.Client(base_url=f"http://127.0.0.1:{llm_server.http_port}", timeout=30) as client:

        @fuzz_settings(60)
        @given(llm_parameters, st.none() | llm_parameters)
        def prop(parameters: dict[str, Any], in_input: dict[str, Any] | None) -> None:
            inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]
            if in_input is not None:
                data = [json.dumps(in_input)]
                inputs.append({"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": data})  # fmt: skip
            content = json.dumps({"inputs": inputs, "parameters": parameters})
            check_answer(client.post("/v2/models/tiny_lm/infer", content=content), client)
            assert error_records.take() == []

        prop()

    @fuzz_settings(60)
    @given(st.data())
    def grpc_prop(data: st.DataObject) -> None:
        message = pb.ModelInferRequest(model_name="tiny_lm")
        prompt = message.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        prompt.contents.bytes_contents.append(b"hi")
        typed_parameters(data.draw, message.parameters, llm_parameters)
        if data.draw(st.booleans(), label="streamed"):
            check_grpc_stream(llm_server, message.SerializeToString(), error_records)
        else:
            check_grpc(llm_server, message.SerializeToString(), error_records)

    grpc_prop()


def check_grpc_stream(server: Server, payload: bytes, error_records: ErrorRecords) -> None:
    """One ModelStreamInfer message: its replies end, none is a server fault."""
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call: Callable[..., Any] = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer"
        )
        replies = [pb.ModelStreamInferResponse.FromString(r) for r in call(iter([payload]), timeout=10)]  # fmt: skip
    assert replies, "no answer"
    for reply in replies:
        assert "unexpectedly" not in reply.error_message, reply.error_message
    assert error_records.take() == []


def typed_parameters(draw: Any, target: Any, drawn: st.SearchStrategy[dict[str, Any]]) -> None:
    """``drawn``'s parameters as gRPC carries them: each value as the type it reads as
    (numbers to 64 bits; anything else as its JSON text)."""
    for key, value in draw(drawn).items():
        if type(value) is bool:
            target[key].bool_param = value
        elif type(value) is int and -(2**63) <= value < 2**63:
            target[key].int64_param = value
        elif type(value) is int and 0 <= value < 2**64:
            target[key].uint64_param = value
        elif type(value) is float:
            target[key].double_param = value
        elif isinstance(value, str) and value.isascii():
            target[key].string_param = value
        else:  # protobuf strings are UTF-8: a lone surrogate travels escaped
            target[key].string_param = json.dumps(value)


SEQUENCE_MODELS = ["simple_dyna_sequence", "simple_string_dyna_sequence", "simple_sequence"]
tensor_parameters = st.dictionaries(
    st.sampled_from(["priority", "timeout", "sequence_id", "sequence_start", "sequence_end",
                     "binary_data_output"]) | st.text(max_size=6),
    parameter_edges | json_values,
    max_size=4,
)  # fmt: skip


def test_live_tensor_parameters(llm_server: Server, error_records: ErrorRecords) -> None:
    """Scheduling parameters of every type, to a dynamic batcher and to sequence batchers
    (string and integer correlation ids), over REST and gRPC."""
    with httpx.Client(base_url=f"http://127.0.0.1:{llm_server.http_port}", timeout=30) as client:

        @fuzz_settings(60)
        @given(st.sampled_from(["simple", *SEQUENCE_MODELS]), tensor_parameters)
        def prop(model: str, parameters: dict[str, Any]) -> None:
            if model == "simple":
                data = list(range(16))
                inputs = [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": data}
                          for n in ("INPUT0", "INPUT1")]  # fmt: skip
            else:
                inputs = [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}]
            content = json.dumps({"inputs": inputs, "parameters": parameters})
            response = client.post(f"/v2/models/{model}/infer", content=content)
            check_answer(response, client, timed="timeout" in parameters)
            assert error_records.take() == []

        prop()

    @fuzz_settings(60)
    @given(st.sampled_from(SEQUENCE_MODELS), st.data())
    def grpc_prop(model: str, data: st.DataObject) -> None:
        message = pb.ModelInferRequest(model_name=model)
        message.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
        message.raw_input_contents.append((1).to_bytes(4, "little"))
        typed_parameters(data.draw, message.parameters, tensor_parameters)
        check_grpc(llm_server, message.SerializeToString(), error_records)

    grpc_prop()
