"""The REST protocol on the wire: binary tensor extension, compression and every error."""

from __future__ import annotations

import gzip
import json
import struct
import zlib

import httpx
import numpy as np
import pytest

from trioserve import HttpLimits, ServerConfig, TensorSpec, model
from trioserve._tensor import DATATYPES, array_to_raw
from trioserve.testing import server_in_thread


@pytest.fixture
def http(http_url):
    with httpx.Client(base_url=f"http://{http_url}", timeout=30) as client:
        yield client


def _binary_request(document: dict, *tensors: bytes) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(document).encode()
    return header + b"".join(tensors), {"Inference-Header-Content-Length": str(len(header))}


def _split(response: httpx.Response) -> tuple[dict, bytes]:
    length = int(response.headers["inference-header-content-length"])
    return json.loads(response.content[:length]), response.content[length:]


SIMPLE_X = np.arange(16, dtype=np.int32).reshape(1, 16)


def _simple_inputs(binary: bool) -> list[dict]:
    if binary:
        p = {"binary_data_size": 64}
        return [
            {"name": n, "shape": [1, 16], "datatype": "INT32", "parameters": p}
            for n in ("INPUT0", "INPUT1")
        ]
    data = SIMPLE_X.reshape(-1).tolist()
    return [
        {"name": n, "shape": [1, 16], "datatype": "INT32", "data": data}
        for n in ("INPUT0", "INPUT1")
    ]


def test_binary_inputs_and_per_output_choice(http):
    body, headers = _binary_request(
        {
            "inputs": _simple_inputs(binary=True),
            "outputs": [
                {"name": "OUTPUT0", "parameters": {"binary_data": True}},
                {"name": "OUTPUT1", "parameters": {"binary_data": False}},
            ],
        },
        SIMPLE_X.tobytes(),
        SIMPLE_X.tobytes(),
    )
    response = http.post("/v2/models/simple/infer", content=body, headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    document, raw = _split(response)
    out0, out1 = document["outputs"]
    assert out0["parameters"] == {"binary_data_size": 64} and "data" not in out0
    assert np.frombuffer(raw, np.int32).tolist() == (2 * SIMPLE_X).reshape(-1).tolist()
    assert out1["data"] == [0] * 16


def test_binary_data_output_makes_every_output_binary_unless_overridden(http):
    document = {
        "inputs": _simple_inputs(binary=False),
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT1", "parameters": {"binary_data": False}}],
    }
    document_out, raw = _split(http.post("/v2/models/simple/infer", json=document))
    assert len(raw) == 64
    assert document_out["outputs"][1]["data"] == [0] * 16


def test_json_only_response_is_application_json(http):
    response = http.post(
        "/v2/models/simple/infer", json={"inputs": _simple_inputs(False), "id": "a"}
    )
    assert response.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in response.headers
    assert response.json()["id"] == "a"
    assert response.json()["model_version"] == "1"


def test_versioned_route(http):
    response = http.post(
        "/v2/models/simple/versions/1/infer", json={"inputs": _simple_inputs(False)}
    )
    assert response.status_code == 200
    missing = http.post(
        "/v2/models/simple/versions/3/infer", json={"inputs": _simple_inputs(False)}
    )
    assert missing.status_code == 404


def test_header_length_zero_sends_the_single_input_raw(http):
    x = np.linspace(0, 1, 10, dtype=np.float32)
    response = http.post(
        "/v2/models/identity_fp32/infer",
        content=x.tobytes(),
        headers={"Inference-Header-Content-Length": "0"},
    )
    document, raw = _split(response)
    assert document["outputs"][0]["shape"] == [10]
    assert np.frombuffer(raw, np.float32).tolist() == x.tolist()
    strings = b"".join(struct.pack("<I", len(s)) + s for s in (b"ab", b"", b"\xff"))
    document, raw = _split(
        http.post(
            "/v2/models/identity_bytes/infer",
            content=strings,
            headers={"Inference-Header-Content-Length": "0"},
        )
    )
    assert document["outputs"][0]["shape"] == [3] and raw == strings


def test_raw_form_needs_a_single_input_model(http):
    response = http.post(
        "/v2/models/simple/infer",
        content=b"\x00" * 128,
        headers={"Inference-Header-Content-Length": "0"},
    )
    assert response.status_code == 400
    assert "one input" in response.json()["error"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_request_and_response(http, encoding):
    payload = json.dumps({"inputs": _simple_inputs(False)}).encode()
    packed = gzip.compress(payload) if encoding == "gzip" else zlib.compress(payload)
    response = http.post(
        "/v2/models/simple/infer",
        content=packed,
        headers={"Content-Encoding": encoding, "Accept-Encoding": encoding},
    )
    assert response.status_code == 200
    assert response.headers["content-encoding"] == encoding
    assert response.json()["outputs"][0]["data"] == (2 * SIMPLE_X).reshape(-1).tolist()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"inputs": 5}', "'inputs'"),
        (b'{"inputs": [], "extra": 1}', "unexpected keys"),
        (b'{"inputs": [{"name": "INPUT0"}]}', "invalid datatype"),
        (
            b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, -16], "data": [1]}]}',
            "non-negative",
        ),
        (
            b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": "x", "data": [1]}]}',
            "shape",
        ),
        (
            b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1]}]}',
            "needs 16",
        ),
        (
            b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1099511627776], "data": [1]}]}',
            "needs 1099511627776",
        ),
        (
            b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": {"a": 1}}]}',
            "integers",
        ),
        (
            b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": ["1"]}]}',
            "integers",
        ),
        (b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1]}]}', "no data"),
        (
            b'{"inputs": [{"name": "INPUT0", "datatype": "BF16", "shape": [1], "data": [1]}]}',
            "binary",
        ),
        (
            b'{"id": 5, "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [1]}]}',
            "'id'",
        ),
        (
            b'{"inputs": [{"name": "X", "datatype": "INT32", "shape": [1, 16], "data": [0]}]}',
            "needs 16",
        ),
        (
            b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]}, {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [0]}]}',
            "twice",
        ),
    ],
)
def test_malformed_requests_answer_400_with_an_error_body(http, body, message):
    response = http.post("/v2/models/simple/infer", content=body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    assert message in response.json()["error"]
    assert http.get("/v2/health/live").status_code == 200  # and the server lives on


def test_validation_against_the_model(http):
    def infer(inputs, outputs=None):
        document = {"inputs": inputs} | ({"outputs": outputs} if outputs else {})
        return http.post("/v2/models/simple/infer", json=document)

    good = _simple_inputs(False)
    extra = {"name": "INPUT9", "shape": [1], "datatype": "INT32", "data": [1]}
    assert "unexpected inference input" in infer([*good, extra]).json()["error"]
    assert "missing" in infer(good[:1]).json()["error"]
    assert "unexpected inference output" in infer(good, [{"name": "NOPE"}]).json()["error"]
    nine = [dict(i, shape=[9, 16], data=[0] * 144) for i in good]
    assert "batch size 9" in infer(nine).json()["error"]
    classification = infer(good, [{"name": "OUTPUT0", "parameters": {"classification": 2}}])
    assert classification.status_code == 501


def test_binary_sizes_must_account_for_the_body(http):
    document = {"inputs": _simple_inputs(binary=True)}
    body, headers = _binary_request(document, SIMPLE_X.tobytes())  # one tensor short
    response = http.post("/v2/models/simple/infer", content=body, headers=headers)
    assert response.status_code == 400 and "runs past" in response.json()["error"]
    body, headers = _binary_request(document, SIMPLE_X.tobytes(), SIMPLE_X.tobytes(), b"xx")
    response = http.post("/v2/models/simple/infer", content=body, headers=headers)
    assert response.status_code == 400 and "declare" in response.json()["error"]
    headers = {"Inference-Header-Content-Length": "99999"}
    response = http.post("/v2/models/simple/infer", content=b"{}", headers=headers)
    assert response.status_code == 400 and "exceeds" in response.json()["error"]
    both = [dict(i, data=[0] * 16) for i in _simple_inputs(binary=True)]
    body, headers = _binary_request({"inputs": both}, SIMPLE_X.tobytes(), SIMPLE_X.tobytes())
    response = http.post("/v2/models/simple/infer", content=body, headers=headers)
    assert response.status_code == 400 and "both" in response.json()["error"]


def test_bad_encodings(http):
    response = http.post(
        "/v2/models/simple/infer", content=b"xx", headers={"Content-Encoding": "br"}
    )
    assert response.status_code == 400 and "Content-Encoding" in response.json()["error"]
    truncated = gzip.compress(b'{"inputs": []}')[:-6]
    response = http.post(
        "/v2/models/simple/infer", content=truncated, headers={"Content-Encoding": "gzip"}
    )
    assert response.status_code == 400


def test_routes(http):
    missing = http.get("/v2/nothing/here")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = http.get("/v2/models/simple/infer")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert http.post("/v2/health/ready").status_code == 405
    assert http.get("/v2/models/nope/ready").status_code == 400  # false, not 404
    assert http.get("/v2/models/nope/ready").content == b""
    assert http.get("/v2/models/nope").json() == {
        "error": "Request for unknown model: 'nope' is not found"
    }
    assert http.get("/v2/models/simple/versions/1/config").json()["name"] == "simple"


# --- every datatype, both encodings, through a model that echoes its inputs -----------


def _echo_models():
    models = []
    for name in DATATYPES:

        def echo(X):
            return {"Y": X}

        models.append(
            model(
                name=f"echo_{name.lower()}",
                inputs=[TensorSpec("X", name, [-1, -1])],
                outputs=[TensorSpec("Y", name, [-1, -1])],
            )(echo)
        )
    return models


@pytest.fixture(scope="module")
def echo_url():
    config = ServerConfig(
        models=_echo_models(),
        http_port=0,
        grpc_port=None,
        http_limits=HttpLimits(max_body_bytes=4096),
    )
    with server_in_thread(config) as server:
        yield f"http://127.0.0.1:{server.http_port}"


def _sample(name: str) -> np.ndarray:
    dt = DATATYPES[name]
    if name == "BYTES":
        return np.array([[b"a", b""], [b"\x00z", b"\xff"]], dtype=object)
    if name == "BOOL":
        return np.array([[True, False], [False, True]])
    info = np.iinfo(dt.dtype) if dt.dtype.kind in "iu" else None
    if info is not None:
        return np.array([[info.min, info.max], [0, 1]], dtype=dt.dtype)
    return np.array([[0.5, -2.0], [1e3, 0.0]], dtype=dt.dtype)


@pytest.mark.parametrize("name", list(DATATYPES))
def test_every_datatype_round_trips_binary(echo_url, name):
    x = _sample(name)
    raw = bytes(array_to_raw(x, DATATYPES[name]))
    document = {
        "inputs": [
            {
                "name": "X",
                "shape": [2, 2],
                "datatype": name,
                "parameters": {"binary_data_size": len(raw)},
            }
        ],
        "parameters": {"binary_data_output": True},
    }
    body, headers = _binary_request(document, raw)
    response = httpx.post(
        f"{echo_url}/v2/models/echo_{name.lower()}/infer", content=body, headers=headers
    )
    document, returned = _split(response)
    assert document["outputs"][0]["datatype"] == name
    assert returned == raw


@pytest.mark.parametrize("name", [n for n, dt in DATATYPES.items() if dt.json_kinds])
def test_every_json_datatype_round_trips_json(echo_url, name):
    data = ["a", "", "z", "é"] if name == "BYTES" else _sample(name).reshape(-1).tolist()
    document = {"inputs": [{"name": "X", "shape": [2, 2], "datatype": name, "data": data}]}
    response = httpx.post(f"{echo_url}/v2/models/echo_{name.lower()}/infer", json=document)
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    assert output["data"] == data and output["shape"] == [2, 2]


def test_oversized_body_is_413(echo_url):
    response = httpx.post(f"{echo_url}/v2/models/echo_fp32/infer", content=b"x" * 5000)
    assert response.status_code == 413
    assert "error" in response.json()
    bomb = gzip.compress(b" " * 100_000)
    response = httpx.post(
        f"{echo_url}/v2/models/echo_fp32/infer", content=bomb, headers={"Content-Encoding": "gzip"}
    )
    assert response.status_code == 413
