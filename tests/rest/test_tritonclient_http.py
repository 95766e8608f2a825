"""Triton's own HTTP client, unmodified, against every model of the reference zoo."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


@pytest.fixture
def client(http_url):
    c = httpclient.InferenceServerClient(http_url)
    yield c
    c.close()


def _input(name, array, datatype, binary=True):
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def test_health_and_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("simple")
    assert client.is_model_ready("simple", "1")
    assert not client.is_model_ready("simple", "2")
    assert not client.is_model_ready("no_such_model")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "trioserve"
    assert "binary_tensor_data" in metadata["extensions"]
    model = client.get_model_metadata("simple")
    assert model["versions"] == ["1"]
    assert [i["shape"] for i in model["inputs"]] == [[-1, 16], [-1, 16]]
    assert client.get_model_metadata("identity_fp32")["inputs"][0]["shape"] == [-1]


def test_model_config(client):
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 8
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    assert config["input"][0]["data_type"] == "TYPE_INT32"
    assert "dynamic_batching" in config
    assert "dynamic_batching" not in client.get_model_config("identity_fp32")
    assert (
        client.get_model_config("delay")["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    )
    assert client.get_model_config("identity_bytes")["input"][0]["data_type"] == "TYPE_STRING"


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("rows", [1, 8])
def test_simple(client, binary, rows):
    rng = np.random.default_rng(rows)
    x = rng.integers(-1000, 1000, (rows, 16), dtype=np.int32)
    y = rng.integers(-1000, 1000, (rows, 16), dtype=np.int32)
    outputs = [
        httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")
    ]
    result = client.infer(
        "simple",
        [_input("INPUT0", x, "INT32", binary), _input("INPUT1", y, "INT32", binary)],
        outputs=outputs,
        request_id="req-7",
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + y)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x - y)
    assert result.get_response()["id"] == "req-7"


def test_simple_output_subset(client):
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = client.infer(
        "simple",
        [_input("INPUT0", x, "INT32"), _input("INPUT1", x, "INT32")],
        outputs=[httpclient.InferRequestedOutput("OUTPUT1")],
    )
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((1, 16), np.int32))


@pytest.mark.parametrize("binary", [True, False])
def test_simple_string(client, binary):
    a = np.array([[str(i).encode() for i in range(16)]], dtype=object)
    b = np.array([[b"7"] * 16], dtype=object)
    outputs = [
        httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")
    ]
    result = client.infer(
        "simple_string",
        [_input("INPUT0", a, "BYTES", binary), _input("INPUT1", b, "BYTES", binary)],
        outputs=outputs,
    )

    def text(array):  # JSON outputs come back as str, binary ones as bytes
        return [x.decode() if isinstance(x, bytes) else x for x in array.reshape(-1)]

    assert text(result.as_numpy("OUTPUT0")) == [str(i + 7) for i in range(16)]
    assert text(result.as_numpy("OUTPUT1"))[0] == "-7"


@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_identity_fp32_large_and_compressed(client, compression):
    x = np.random.default_rng(0).standard_normal(4 * 2**20 // 4).astype(np.float32)
    result = client.infer(
        "identity_fp32",
        [_input("INPUT0", x, "FP32")],
        request_compression_algorithm=compression,
        response_compression_algorithm=compression,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)


def test_identity_bytes_edge_cases(client):
    items = [b"", b"\x00", b"a\x00b", b"\xff\xfe\xfd", "π".encode()]
    x = np.array(items, dtype=object)
    result = client.infer("identity_bytes", [_input("INPUT0", x, "BYTES")])
    assert result.as_numpy("OUTPUT0").tolist() == items
    empty = np.array([], dtype=object)
    result = client.infer("identity_bytes", [_input("INPUT0", empty, "BYTES")])
    assert result.as_numpy("OUTPUT0").shape == (0,)


def test_delay(client):
    x = np.array([[1.5]], dtype=np.float32)
    result = client.infer("delay", [_input("INPUT0", x, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)


def test_fail_reaches_the_client_as_an_error(client):
    with pytest.raises(InferenceServerException, match="always fails") as info:
        client.infer("fail", [_input("INPUT0", np.array([1], np.int32), "INT32")])
    assert info.value.status() == "500"


def test_unknown_model_error(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", [_input("INPUT0", np.array([1], np.int32), "INT32")])
    assert info.value.message() == "Request for unknown model: 'nope' is not found"
    assert info.value.status() == "404"


def test_bad_inputs_are_refused_with_400(client):
    x = np.zeros((1, 16), np.float32)
    with pytest.raises(InferenceServerException, match="data-type") as info:
        client.infer("simple", [_input("INPUT0", x, "FP32"), _input("INPUT1", x, "FP32")])
    assert info.value.status() == "400"
    with pytest.raises(InferenceServerException, match="missing: INPUT1"):
        client.infer("simple", [_input("INPUT0", x.astype(np.int32), "INT32")])
    with pytest.raises(InferenceServerException, match="unexpected shape"):
        y = np.zeros((1, 15), np.int32)
        client.infer("simple", [_input("INPUT0", y, "INT32"), _input("INPUT1", y, "INT32")])
    with pytest.raises(InferenceServerException, match="unexpected inference output"):
        y = np.zeros((1, 16), np.int32)
        client.infer(
            "simple",
            [_input("INPUT0", y, "INT32"), _input("INPUT1", y, "INT32")],
            outputs=[httpclient.InferRequestedOutput("OUTPUT9")],
        )


def test_async_infer_many_requests_batch(client):
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [_input("INPUT0", x, "INT32"), _input("INPUT1", x, "INT32")]
    handles = [client.async_infer("simple", inputs) for _ in range(16)]
    for handle in handles:
        np.testing.assert_array_equal(handle.get_result().as_numpy("OUTPUT0"), 2 * x)
