"""generate and generate_stream on models that are not generative, as Triton serves them:
the request's keys name the model's inputs (the others are parameters), and the answers
carry its outputs by name. Python-backend models as a Triton user writes them (one
answering once, one decoupled), and the built-in ``simple``, over real HTTP."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from trioserve import ServerConfig
from trioserve.models import reference_zoo
from trioserve.testing import server_in_thread

from .._model_repository import write_model

TIMEOUT = 20  # seconds; fails a hung test

ECHO = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
            upper = pb_utils.get_input_tensor_by_name(request, "upper")  # optional
            suffix = json.loads(request.parameters()).get("suffix", "")
            answer = text.decode() + suffix
            if upper is not None and upper.as_numpy()[0]:
                answer = answer.upper()
            answer = np.array([answer], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", answer)]))
        return responses
"""

# Decoupled: one response per word of text_input ("!" an error response, "~" bytes that
# are not UTF-8), the final flag alone after them; "" no response at all; blanks alone
# an error, final.
WORDS = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
            sender = request.get_response_sender()
            words = text.decode().split()
            if text and not words:
                error = pb_utils.TritonError("nothing to say", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            for word in words:
                if word == "!":
                    error = pb_utils.TritonError("a bad word")
                    sender.send(pb_utils.InferenceResponse(error=error))
                    continue
                data = b"\\xff" if word == "~" else word
                out = pb_utils.Tensor("text_output", np.array([data], dtype=object))
                sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Decoupled: "go" answers "tick", then a thread waits for the client to leave (the
# backend's API is a poll); "ask" answers whether it saw that within 10 s.
TICKER = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

SEEN = threading.Event()


def answer(sender, text, flags=0):
    out = pb_utils.Tensor("text_output", np.array([text], dtype=object))
    sender.send(pb_utils.InferenceResponse([out]), flags=flags)


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0] == b"ask":
                seen = SEEN.wait(10)
                answer(sender, "left" if seen else "stayed",
                       pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            answer(sender, "tick")
            threading.Thread(target=self.watch, args=(request, sender)).start()
        return None

    def watch(self, request, sender):
        while not request.is_cancelled():
            threading.Event().wait(0.001)
        SEEN.set()
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

TEXT_CONFIG = """
backend: "python"
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "upper" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    root = tmp_path_factory.mktemp("models")
    for name, code, extra in (
        ("echo", ECHO, ""),
        ("words", WORDS, "model_transaction_policy { decoupled: true }\n"),
        ("ticker", TICKER, "model_transaction_policy { decoupled: true }\n"),
    ):
        write_model(root, name, TEXT_CONFIG + extra, code)
    simple = next(model for model in reference_zoo() if model.name == "simple")
    config = ServerConfig(
        models=[simple], model_repositories=[Path(root)], http_port=0, grpc_port=None
    )
    with (
        server_in_thread(config) as server,
        httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=TIMEOUT) as client,
    ):
        yield client


def events(response: httpx.Response) -> list[Any]:
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    return [json.loads(line[6:]) for line in response.text.split("\n") if line]


def test_keys_that_name_inputs_are_inputs_and_the_others_parameters(http: httpx.Client) -> None:
    top_level = http.post("/v2/models/echo/generate", json={"text_input": "hi", "suffix": "!"})
    nested = http.post(
        "/v2/models/echo/generate",
        json={"id": "7", "text_input": "hi", "parameters": {"suffix": "?"}},
    )
    assert top_level.status_code == 200
    assert top_level.json() == {"model_name": "echo", "model_version": "1", "text_output": "hi!"}
    assert nested.json() == {
        "id": "7", "model_name": "echo", "model_version": "1", "text_output": "hi?"
    }  # fmt: skip


def test_an_entry_of_parameters_that_names_an_input_is_that_input(http: httpx.Client) -> None:
    """As Triton's vLLM backend reads ``{"parameters": {"stream": false}}``: an input."""
    response = http.post(
        "/v2/models/echo/generate",
        json={"text_input": "hi", "parameters": {"upper": True, "suffix": "!"}},
    )
    assert response.json()["text_output"] == "HI!"


def test_a_model_that_answers_once_streams_one_event(http: httpx.Client) -> None:
    response = http.post("/v2/models/echo/generate_stream", json={"text_input": "hi"})
    assert response.status_code == 200
    assert events(response) == [{"model_name": "echo", "model_version": "1", "text_output": "hi"}]


def test_a_decoupled_model_streams_each_response(http: httpx.Client) -> None:
    response = http.post("/v2/models/words/generate_stream", json={"text_input": "a b c"})
    assert response.status_code == 200
    assert [event["text_output"] for event in events(response)] == ["a", "b", "c"]


def test_a_later_error_is_an_event_and_no_response_an_empty_stream(http: httpx.Client) -> None:
    later = http.post("/v2/models/words/generate_stream", json={"text_input": "a ! ~ b"})
    none = http.post("/v2/models/words/generate_stream", json={"text_input": ""})
    assert later.status_code == 200
    assert [event.get("text_output", event.get("error")) for event in events(later)] == [
        "a", "a bad word",
        "output 'text_output': BYTES output is not UTF-8 text; request it as binary_data",
        "b",
    ]  # fmt: skip
    assert none.status_code == 200
    assert events(none) == []


def test_a_client_that_leaves_cancels_its_request_in_the_model(http: httpx.Client) -> None:
    body = json.dumps({"text_input": "go"}).encode()
    head = "POST /v2/models/ticker/generate_stream HTTP/1.1\r\nHost: t\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    port = http.base_url.port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as client:
        client.sendall(head.encode() + body)
        received = b""
        while b"tick" not in received:
            chunk = client.recv(4096)
            assert chunk, "the stream ended before its first event"
            received += chunk
    asked = http.post("/v2/models/ticker/generate", json={"text_input": "ask"})
    assert asked.json()["text_output"] == "left"


def test_generate_answers_a_decoupled_models_one_response_and_refuses_more(
    http: httpx.Client,
) -> None:
    one = http.post("/v2/models/words/generate", json={"text_input": "one"})
    two = http.post("/v2/models/words/generate", json={"text_input": "one two"})
    none = http.post("/v2/models/words/generate", json={"text_input": ""})
    assert one.json() == {"model_name": "words", "model_version": "1", "text_output": "one"}
    assert two.status_code == none.status_code == 501
    assert two.json() == {
        "error": "model 'words' sent 2 responses; generate answers with one "
        "(generate_stream streams them)"
    }
    assert none.json()["error"].startswith("model 'words' sent 0 responses")


def test_an_error_before_the_first_event_is_an_ordinary_error(http: httpx.Client) -> None:
    for endpoint in ("generate", "generate_stream"):
        response = http.post(f"/v2/models/words/{endpoint}", json={"text_input": " "})
        assert response.status_code == 400
        assert response.headers["content-type"] == "application/json"
        assert response.json() == {"error": "nothing to say"}


def test_numbers_in_and_out_with_a_batch_dimension(http: httpx.Client) -> None:
    """``simple`` batches (max_batch_size 8): a list of 16 is a tensor of [1, 16]."""
    a, b = list(range(16)), [2] * 16
    response = http.post("/v2/models/simple/generate", json={"INPUT0": a, "INPUT1": b})
    assert response.status_code == 200
    document = response.json()
    assert document["OUTPUT0"] == (np.array(a) + 2).tolist()
    assert document["OUTPUT1"] == (np.array(a) - 2).tolist()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"INPUT0": ["x"] * 16, "INPUT1": [1] * 16}, "input 'INPUT0': data must be"),
        ({"INPUT0": [[1, 2], [3]], "INPUT1": [1] * 16}, "not a rectangular array"),
        ({"INPUT0": [1] * 16, "INPUT1": [1] * 16, "tags": [1]}, "parameter 'tags' must be"),
        ({"INPUT0": [1] * 16, "INPUT1": [1] * 16, "k": 1, "parameters": {"k": 2}}, "['k']"),
        ({"INPUT0": [1] * 16, "INPUT1": [1] * 16, "parameters": [1]}, "must be a JSON object"),
        ({"INPUT0": [1] * 16, "INPUT1": [1] * 16, "id": 5}, "'id' must be a string"),
        ({"INPUT0": [1] * 16}, "INPUT1"),  # an input missing: the model's check
    ],
)
def test_bad_requests_are_refused_in_the_protocols_format(
    http: httpx.Client, body: dict[str, Any], message: str
) -> None:
    for endpoint in ("generate", "generate_stream"):
        response = http.post(f"/v2/models/simple/{endpoint}", json=body)
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]
