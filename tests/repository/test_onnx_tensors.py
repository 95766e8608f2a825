"""Tensors of every rank through the ONNX Runtime backend, over HTTP and gRPC, compared
with ONNX Runtime run directly: rank-0 inputs and outputs, auto-complete's reshape of a
batching model's 1-D tensors, reshapes written by hand, strings, a model without
inputs, and merged batches of mixed request sizes split back for every output rank."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import ServerConfig
from trioserve.testing import batch_size_counts, server_in_thread

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

F32, I64, STR = TensorProto.FLOAT, TensorProto.INT64, TensorProto.STRING
MERGE_DELAY_US = 30_000_000  # a merged batch goes when it reaches its preferred size


def _build(root: Path, write_onnx) -> None:
    def write(name: str, *args: Any, **kwargs: Any) -> None:
        write_onnx(root / name / "1" / "model.onnx", *args, **kwargs)

    # rank-0 outputs of a model that does not batch: Size and MatMul of two vectors
    write(
        "vectors",
        [helper.make_node("Size", ["A"], ["N"]), helper.make_node("MatMul", ["A", "B"], ["D"])],
        [("A", F32, [3]), ("B", F32, [3])],
        [("N", I64, []), ("D", F32, [])],
    )
    # rank-0 inputs: Range, and Einsum of a vector and a scalar
    write(
        "range",
        [
            helper.make_node("Range", ["start", "limit", "delta"], ["R"]),
            helper.make_node("Einsum", ["R", "delta"], ["E"], equation="i,->i"),
        ],
        [("start", F32, []), ("limit", F32, []), ("delta", F32, [])],
        [("R", F32, ["K"]), ("E", F32, ["K"])],
    )
    # a batching model of 1-D tensors: auto-complete's dims [1] with reshape []
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    write(
        "vector_batch",
        [helper.make_node("Mul", ["X", "two"], ["Y"])],
        [("X", F32, ["N"])],
        [("Y", F32, ["N"])],
        [two],
    )
    # reshapes written by hand, fixed and variable sizes, both ways
    write(
        "reshaped",
        [helper.make_node("Neg", ["X"], ["Y"]), helper.make_node("Identity", ["V"], ["W"])],
        [("X", F32, ["N", 6]), ("V", F32, ["N", "K", 4])],
        [("Y", F32, ["N", 6]), ("W", F32, ["N", "K", 4])],
    )
    (root / "reshaped" / "config.pbtxt").write_text(
        "max_batch_size: 4\n"
        'input { name: "X" data_type: TYPE_FP32 dims: [2, 3] reshape { shape: [6] } }\n'
        'input { name: "V" data_type: TYPE_FP32 dims: [-1, 2, 2] reshape { shape: [-1, 4] } }\n'
        'output { name: "Y" data_type: TYPE_FP32 dims: [3, 2] reshape { shape: [6] } }\n'
        'output { name: "W" data_type: TYPE_FP32 dims: [-1, 2, 2] reshape { shape: [-1, 4] } }\n'
    )
    write(
        "strings",
        [helper.make_node("Identity", ["S"], ["T"])],
        [("S", STR, ["N"])],
        [("T", STR, ["N"])],
    )
    # no inputs: the output comes from the graph alone
    value = numpy_helper.from_array(np.array([1.5, -2.0], np.float32), "value")
    write("constant", [helper.make_node("Constant", [], ["C"], value=value)], [], [("C", F32, [2])])
    # a string output that is not UTF-8
    text = helper.make_tensor("text", STR, [2], [b"ok", b"\xff\xfe"])
    write("latin", [helper.make_node("Constant", [], ["L"], value=text)], [], [("L", STR, [2])])
    # a sequence model: the sequence batcher feeds its START control and its state
    int32 = (TensorProto.INT32, [1])
    write(
        "sequence",
        [
            helper.make_node("Add", ["INPUT", "START"], ["STARTED"]),
            helper.make_node("Add", ["STARTED", "STATE_IN"], ["OUT"]),
            helper.make_node("Identity", ["OUT"], ["STATE_OUT"]),
        ],
        [("INPUT", *int32), ("START", *int32), ("STATE_IN", *int32)],
        [("OUT", *int32), ("STATE_OUT", *int32)],
    )
    (root / "sequence" / "config.pbtxt").write_text(
        'sequence_batching { control_input [{ name: "START" control [{ kind: '
        "CONTROL_SEQUENCE_START int32_false_true: [0, 1] }] }]\n"
        'state [{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 '
        "dims: [1] }] }\n"
        'input { name: "INPUT" data_type: TYPE_INT32 dims: [1] }\n'
        'output { name: "OUT" data_type: TYPE_INT32 dims: [1] }\n'
    )
    # outputs of rank 1 (reshaped), 2 and 3, merged by the dynamic batcher
    axes1 = numpy_helper.from_array(np.array([1], np.int64), "axes1")
    axes2 = numpy_helper.from_array(np.array([2], np.int64), "axes2")
    write(
        "merged",
        [
            helper.make_node("ReduceSum", ["X", "axes1"], ["R"], keepdims=0),
            helper.make_node("Mul", ["X", "two"], ["D"]),
            helper.make_node("Unsqueeze", ["X", "axes2"], ["U"]),
        ],
        [("X", F32, ["N", 2])],
        [("R", F32, ["N"]), ("D", F32, ["N", 2]), ("U", F32, ["N", 2, 1])],
        [axes1, axes2, two],
    )
    (root / "merged" / "config.pbtxt").write_text(
        "max_batch_size: 8\ninstance_group { count: 2 }\n"
        "dynamic_batching { preferred_batch_size: [6] "
        f"max_queue_delay_microseconds: {MERGE_DELAY_US} }}\n"
    )


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, write_onnx) -> Path:
    root = tmp_path_factory.mktemp("onnx_tensors")
    _build(root, write_onnx)
    return root


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Any]:
    config = ServerConfig(model_repositories=[repository], http_port=0, grpc_port=0)
    with server_in_thread(config) as running:
        yield running


class Client:
    """tritonclient over one protocol, inputs and outputs as numpy arrays."""

    def __init__(self, protocol: str, server: Any) -> None:
        self.module: Any = httpclient if protocol == "http" else grpcclient
        port = server.http_port if protocol == "http" else server.grpc_port
        self.client = self.module.InferenceServerClient(f"127.0.0.1:{port}")

    def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict:
        tensors = []
        for name, array in inputs.items():
            datatype = "BYTES" if array.dtype == np.object_ else _datatype(array.dtype)
            tensor = self.module.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        result = self.client.infer(model, tensors)
        return {name: result.as_numpy(name) for name in outputs}


def _datatype(dtype: np.dtype) -> str:
    return {"float32": "FP32", "int64": "INT64"}[dtype.name]


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, server: Any) -> Iterator[Client]:
    opened = Client(request.param, server)
    yield opened
    opened.client.close()


def direct(repository: Path, model: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model's outputs from ONNX Runtime itself."""
    path = str(repository / model / "1" / "model.onnx")
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_rank_zero_outputs_answer_with_the_config_dims(
    client: Client, server: Any, repository: Path
) -> None:
    described = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    config = described.get_model_config("vectors")
    assert [(t["name"], t["dims"], "reshape" in t) for t in config["output"]] == [
        ("N", [1], False),
        ("D", [1], False),
    ]
    described.close()
    a, b = np.array([1, 2, 3], np.float32), np.array([4, 5, 6], np.float32)
    got = client.infer("vectors", {"A": a, "B": b}, ["N", "D"])
    size, dot = direct(repository, "vectors", {"A": a, "B": b})
    assert size.shape == dot.shape == ()
    assert got["N"].shape == got["D"].shape == (1,)
    assert got["N"].tolist() == [size.item()] == [3]
    assert got["D"].tolist() == [dot.item()] == [32.0]


def test_rank_zero_inputs_reach_the_graph_as_scalars(client: Client, repository: Path) -> None:
    feeds = {
        n: np.array([v], np.float32) for n, v in (("start", 0), ("limit", 2.5), ("delta", 0.5))
    }
    got = client.infer("range", feeds, ["R", "E"])
    r, e = direct(repository, "range", {n: a.reshape(()) for n, a in feeds.items()})
    assert got["R"].tolist() == r.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert got["E"].tolist() == e.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_batching_vectors_are_reshaped_as_auto_complete_writes(
    client: Client, server: Any, repository: Path
) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    config = http.get_model_config("vector_batch")
    http.close()
    assert config["max_batch_size"] == 4
    for tensor in (*config["input"], *config["output"]):
        assert (tensor["dims"], tensor["reshape"]) == ([1], {"shape": []})
    x = np.array([[1.0], [2.5], [-3.0]], np.float32)
    got = client.infer("vector_batch", {"X": x}, ["Y"])["Y"]
    (expected,) = direct(repository, "vector_batch", {"X": x.reshape(3)})
    assert got.shape == (3, 1)
    assert got.reshape(3).tolist() == expected.tolist() == [2.0, 5.0, -6.0]
    with pytest.raises(InferenceServerException, match=r"Expected \[-1, ?1\], got \[3\]"):
        client.infer("vector_batch", {"X": x.reshape(3)}, ["Y"])


def test_hand_written_reshapes_apply_both_ways(client: Client, repository: Path) -> None:
    x = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    v = np.arange(40, dtype=np.float32).reshape(2, 5, 2, 2)
    got = client.infer("reshaped", {"X": x, "V": v}, ["Y", "W"])
    y, w = direct(repository, "reshaped", {"X": x.reshape(2, 6), "V": v.reshape(2, 5, 4)})
    assert got["Y"].shape == (2, 3, 2)
    assert got["Y"].tolist() == y.reshape(2, 3, 2).tolist()
    assert got["W"].shape == (2, 5, 2, 2)
    assert got["W"].tolist() == w.reshape(2, 5, 2, 2).tolist() == v.tolist()


@pytest.mark.parametrize(
    ("dims", "reshape", "reason"),
    [("[2, 3]", "[5]", "does not hold the elements"), ("[-1, 3]", "[6]", "variable sizes")],
)
def test_a_reshape_that_cannot_hold_the_dims_fails_the_load(
    tmp_path: Path, write_onnx, dims: str, reshape: str, reason: str
) -> None:
    write_onnx(
        tmp_path / "bad" / "1" / "model.onnx",
        [helper.make_node("Neg", ["X"], ["Y"])],
        [("X", F32, ["N", 6])],
        [("Y", F32, ["N", 6])],
    )
    (tmp_path / "bad" / "config.pbtxt").write_text(
        "max_batch_size: 4\n"
        f'input {{ name: "X" data_type: TYPE_FP32 dims: {dims} reshape {{ shape: {reshape} }} }}\n'
        'output { name: "Y" data_type: TYPE_FP32 dims: [6] }\n'
    )
    config = ServerConfig(model_repositories=[tmp_path], http_port=0, grpc_port=None)
    with server_in_thread(config) as running:
        http = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        (entry,) = http.get_model_repository_index()
        http.close()
    assert entry["state"] == "UNAVAILABLE"
    assert "field 'reshape' of 'X'" in entry["reason"]
    assert reason in entry["reason"]


def test_strings_reach_the_graph_as_the_client_sent_them(client: Client, repository: Path) -> None:
    texts = ["héllo wörld", "", "a\x00b", "日本"]
    s = np.array([[t.encode()] for t in texts], dtype=object)
    got = client.infer("strings", {"S": s}, ["T"])["T"]
    (expected,) = direct(repository, "strings", {"S": np.array(texts, dtype=object)})
    assert got.shape == (4, 1)
    assert got.reshape(-1).tolist() == [t.encode() for t in expected.tolist()]
    assert got.reshape(-1).tolist() == [t.encode() for t in texts]


def test_a_string_that_is_not_utf8_fails_its_request_alone(client: Client) -> None:
    bad = np.array([[b"ok"], [b"\xff\xfe"]], dtype=object)
    with pytest.raises(InferenceServerException, match="element 1 is not UTF-8") as failed:
        client.infer("strings", {"S": bad}, ["T"])
    assert failed.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    good = np.array([[b"still served"]], dtype=object)
    assert client.infer("strings", {"S": good}, ["T"])["T"].tolist() == [[b"still served"]]


def test_a_string_output_that_is_not_utf8_is_refused_clearly(client: Client) -> None:
    with pytest.raises(InferenceServerException, match="string output is not UTF-8") as failed:
        client.infer("latin", {}, ["L"])
    assert failed.value.status() in ("501", "StatusCode.UNIMPLEMENTED")


def test_sequence_controls_and_states_reach_the_graph(server: Any) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("INPUT", [1], "INT32")
    tensor.set_data_from_numpy(np.array([10], np.int32))
    answers = [
        client.infer("sequence", [tensor], sequence_id=7, sequence_start=start, sequence_end=end)
        .as_numpy("OUT")
        .tolist()
        for start, end in ((True, False), (False, True))
    ]
    client.close()
    assert answers == [[11], [21]]  # 10 + START, then 10 + the state


def test_a_model_without_inputs_is_served_alike(client: Client, repository: Path) -> None:
    got = client.infer("constant", {}, ["C"])["C"]
    (expected,) = direct(repository, "constant", {})
    assert got.tolist() == expected.tolist() == [1.5, -2.0]


def test_http_still_needs_an_inputs_list(server: Any) -> None:
    import httpx

    url = f"http://127.0.0.1:{server.http_port}/v2/models/constant/infer"
    response = httpx.post(url, json={"outputs": [{"name": "C"}]})
    assert response.status_code == 400
    assert "'inputs' list" in response.json()["error"]
    assert httpx.post(url, json={"inputs": []}).json()["outputs"][0]["data"] == [1.5, -2.0]


def test_merged_batches_of_mixed_sizes_split_back_for_every_output_rank(
    server: Any, repository: Path
) -> None:
    """Three requests of 1, 2 and 3 elements, over both protocols, run as one batch of 6
    (the preferred size; the queue delay is far longer than the test)."""
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    config = http.get_model_config("merged")
    http.close()
    assert [(t["name"], t["dims"], t.get("reshape")) for t in config["output"]] == [
        ("R", [1], {"shape": []}),
        ("D", [2], None),
        ("U", [2, 1], None),
    ]
    sizes = {"http-1": 1, "grpc-2": 2, "http-3": 3}
    arrays = {
        key: np.arange(size * 2, dtype=np.float32).reshape(size, 2) + 10 * size
        for key, size in sizes.items()
    }
    answers: dict[str, dict] = {}

    def send(key: str) -> None:
        client = Client(key.split("-")[0], server)
        try:
            answers[key] = client.infer("merged", {"X": arrays[key]}, ["R", "D", "U"])
        finally:
            client.client.close()

    before = batch_size_counts(server, "merged")
    threads = [threading.Thread(target=send, args=(key,)) for key in sizes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(answers) == set(sizes)
    executed = batch_size_counts(server, "merged")
    assert {b: executed[b] - before.get(b, 0) for b in executed} == {6: 1}
    for key, size in sizes.items():
        r, d, u = direct(repository, "merged", {"X": arrays[key]})
        assert answers[key]["R"].shape == (size, 1)
        assert answers[key]["R"].reshape(size).tolist() == r.tolist()
        assert answers[key]["D"].tolist() == d.tolist()
        assert answers[key]["U"].shape == (size, 2, 1)
        assert answers[key]["U"].tolist() == u.tolist()
