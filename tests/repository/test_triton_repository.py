"""Triton model repositories served as they are: config.pbtxt, Python-backend models,
per-model errors, the repository API (REST and gRPC) and the model control modes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig
from trioserve.models import TRITON_EXAMPLES
from trioserve.testing import server_in_thread

from .._model_repository import write_files

SHARED_ZOO = Path(__file__).parents[3] / "shared" / "triton-reference" / "models"

ADD_SUB_CONFIG = """
name: "add_sub"
backend: "python"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 100 }
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 4 ] }
]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

ADD_SUB_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        config = json.loads(args["model_config"])
        out = pb_utils.get_output_config_by_name(config, "OUTPUT0")
        self.dtype = pb_utils.triton_string_to_numpy(out["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if (a < 0).any():
                error = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", (a + b).astype(self.dtype)),
                pb_utils.Tensor("OUTPUT1", (a - b).astype(self.dtype)),
            ]))
        return responses
"""

# Auto-complete from the model (no config.pbtxt), async execute, BLS to add_sub, args.
BLS_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "X", "data_type": "TYPE_INT32", "dims": [4]})
        config.add_output({"name": "Y", "data_type": "TYPE_INT32", "dims": [4]})
        config.add_output({"name": "WHO", "data_type": "TYPE_STRING", "dims": [1]})
        return config

    def initialize(self, args):
        self.who = f"{args['model_name']}/{args['model_version']}/{args['model_instance_kind']}"

    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            bls = pb_utils.InferenceRequest(
                model_name="add_sub",
                inputs=[pb_utils.Tensor("INPUT0", x.as_numpy()[None]),
                        pb_utils.Tensor("INPUT1", x.as_numpy()[None])],
                requested_output_names=["OUTPUT0"],
            )
            answer = await bls.async_exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            doubled = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()[0]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("Y", doubled),
                pb_utils.Tensor("WHO", np.array([self.who.encode()], dtype=object)),
            ]))
        return responses
"""


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    return write_files(
        tmp_path,
        {
            "add_sub/config.pbtxt": ADD_SUB_CONFIG,
            "add_sub/1/model.py": ADD_SUB_MODEL,
            "doubler/1/model.py": BLS_MODEL,
            "bad_config/config.pbtxt": 'name: "bad_config"\nmax_batch_size: "eight"\n',
            "bad_config/1/model.py": ADD_SUB_MODEL,
            "bad_import/config.pbtxt": ADD_SUB_CONFIG.replace("add_sub", "bad_import"),
            "bad_import/1/model.py": "import no_such_module_here\n",
            "misnamed/config.pbtxt": ADD_SUB_CONFIG.replace("add_sub", "other_name"),
            "misnamed/1/model.py": ADD_SUB_MODEL,
        },
    )


@pytest.fixture
def server(repository: Path) -> Iterator[Server]:
    config = ServerConfig(model_repositories=[repository], http_port=0, grpc_port=0)
    with server_in_thread(config) as running:
        yield running


def pair(a: list[int], b: list[int]) -> list[httpclient.InferInput]:
    inputs = []
    for name, values in (("INPUT0", a), ("INPUT1", b)):
        tensor = httpclient.InferInput(name, [1, 4], "INT32")
        tensor.set_data_from_numpy(np.array([values], np.int32))
        inputs.append(tensor)
    return inputs


def test_python_model_serves_and_broken_models_fail_alone(server: Server) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    result = client.infer("add_sub", pair([1, 2, 3, 4], [10, 10, 10, 10]))
    assert result.as_numpy("OUTPUT0").tolist() == [[11, 12, 13, 14]]
    assert result.as_numpy("OUTPUT1").tolist() == [[-9, -8, -7, -6]]
    with pytest.raises(InferenceServerException, match="negative input") as failed:
        client.infer("add_sub", pair([-1, 0, 0, 0], [0, 0, 0, 0]))
    assert failed.value.status() == "400"
    config = client.get_model_config("add_sub")
    assert config["backend"] == "python"
    assert config["instance_group"] == [
        {"name": "add_sub", "kind": "KIND_CPU", "count": 2, "gpus": [], "secondary_devices": [],
         "profile": [], "passive": False, "host_policy": ""}
    ]  # fmt: skip
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert config["model_transaction_policy"] == {"decoupled": False}
    index = {entry["name"]: entry for entry in client.get_model_repository_index()}
    assert index["add_sub"]["state"] == "READY"
    assert index["doubler"]["state"] == "READY"
    reasons = {name: index[name]["reason"] for name in ("bad_config", "bad_import", "misnamed")}
    assert all(index[name]["state"] == "UNAVAILABLE" for name in reasons)
    assert "bad_config/config.pbtxt" in reasons["bad_config"]
    assert "max_batch_size" in reasons["bad_config"]
    assert "bad_import/1/model.py: failed to import" in reasons["bad_import"]
    assert "no_such_module_here" in reasons["bad_import"]
    assert "field 'name'" in reasons["misnamed"]
    assert "other_name" in reasons["misnamed"]
    assert not client.is_model_ready("bad_config")
    assert client.is_server_live()
    client.close()


def test_auto_complete_async_execute_and_bls(server: Server) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    config = client.get_model_config("doubler")
    assert [i["name"] for i in config["input"]] == ["X"]
    assert [o["name"] for o in config["output"]] == ["Y", "WHO"]
    assert config["max_batch_size"] == 0
    x = httpclient.InferInput("X", [4], "INT32")
    x.set_data_from_numpy(np.array([1, 2, 3, 5], np.int32))
    result = client.infer("doubler", [x])
    assert result.as_numpy("Y").tolist() == [2, 4, 6, 10]
    assert result.as_numpy("WHO").tolist() == [b"doubler/1/CPU"]
    x.set_data_from_numpy(np.array([-1, 2, 3, 5], np.int32))
    with pytest.raises(InferenceServerException, match="negative input"):
        client.infer("doubler", [x])  # the BLS call's error, raised by the model
    client.close()


def test_explicit_mode_load_unload_and_override_over_http(repository: Path) -> None:
    config = ServerConfig(
        model_repositories=[repository],
        model_control_mode="explicit",
        http_port=0,
        grpc_port=None,
    )
    with server_in_thread(config) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        assert "model_repository" in client.get_server_metadata()["extensions"]
        assert not client.is_model_ready("add_sub")  # explicit: nothing loads by itself
        assert {e["name"] for e in client.get_model_repository_index()} >= {"add_sub", "doubler"}
        client.load_model("add_sub")
        assert client.is_model_ready("add_sub")
        assert client.get_model_repository_index(query_params=None)
        with pytest.raises(InferenceServerException, match="failed to load"):
            client.load_model("add_sub", config='"parameters": {{"max_batch_size": "16"}}')
        assert client.is_model_ready("add_sub")  # a failed reload leaves it serving
        override = json.loads(json.dumps(client.get_model_config("add_sub")))
        override["max_batch_size"] = "16"
        client.load_model("add_sub", config=json.dumps(override))
        assert client.get_model_config("add_sub")["max_batch_size"] == 16
        result = client.infer("add_sub", pair([1, 1, 1, 1], [1, 1, 1, 1]))
        assert result.as_numpy("OUTPUT0").tolist() == [[2, 2, 2, 2]]
        client.unload_model("add_sub")
        assert not client.is_model_ready("add_sub")
        entry = next(e for e in client.get_model_repository_index() if e["name"] == "add_sub")
        assert entry["state"] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException, match="failed to load"):
            client.load_model("wrong_model_name")
        client.close()


def test_explicit_mode_over_grpc_with_files(repository: Path) -> None:
    config = ServerConfig(
        model_repositories=[repository],
        model_control_mode="explicit",
        load_models=["*"],
        http_port=None,
        grpc_port=0,
    )
    with server_in_thread(config) as server:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        index = client.get_model_repository_index().models
        assert {m.name for m in index if m.state == "READY"} == {"add_sub", "doubler"}
        client.unload_model("doubler")
        assert not client.is_model_ready("doubler")
        client.load_model("doubler")
        assert client.is_model_ready("doubler")
        files = {
            "file:1/model.py": ADD_SUB_MODEL.encode(),
        }
        uploaded = ADD_SUB_CONFIG.replace("add_sub", "uploaded")
        as_json = (
            '{"backend": "python", "max_batch_size": 8, "input": ['
            '{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [4]},'
            '{"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [4]}], "output": ['
            '{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [4]},'
            '{"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [4]}]}'
        )
        assert "uploaded" in uploaded
        client.load_model("uploaded", config=as_json, files=files)
        assert client.get_model_config("uploaded").config.max_batch_size == 8
        with pytest.raises(InferenceServerException, match="Invalid file path"):
            client.load_model("add_sub", config="{}", files={"file:" + "A" * 256: b"a"})
        with pytest.raises(InferenceServerException, match="failed to load"):
            client.load_model("wrong_model_name")
        assert client.is_server_live()
        client.close()


def test_none_mode_refuses_the_load_api(server: Server) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    with pytest.raises(InferenceServerException, match="not allowed"):
        client.unload_model("add_sub")
    assert client.is_model_ready("add_sub")
    client.close()


def test_packaged_triton_examples() -> None:
    config = ServerConfig(model_repositories=[TRITON_EXAMPLES], http_port=0, grpc_port=None)
    with server_in_thread(config) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            tensor = httpclient.InferInput(name, [1, 16], "INT8")
            tensor.set_data_from_numpy(np.full((1, 16), 100, np.int8))
            inputs.append(tensor)
        result = client.infer("simple_int8", inputs)
        assert result.as_numpy("OUTPUT0").tolist() == [[-56] * 16]  # 200 wraps in int8
        text = httpclient.InferInput("INPUT0", [1, 3], "BYTES")
        text.set_data_from_numpy(np.array([[b"a", b"bc", b""]], dtype=object))
        assert client.infer("simple_identity", [text]).as_numpy("OUTPUT0").tolist() == [
            [b"a", b"bc", b""]
        ]
        client.close()


@pytest.mark.skipif(not SHARED_ZOO.is_dir(), reason="the shared Triton zoo is not here")
def test_the_triton_reference_zoo_unmodified() -> None:
    config = ServerConfig(model_repositories=[SHARED_ZOO], http_port=0, grpc_port=None)
    with server_in_thread(config) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        index = client.get_model_repository_index()
        assert {e["name"] for e in index if e["state"] == "READY"} == {
            "simple", "simple_string", "identity_fp32", "identity_bytes", "delay", "fail"
        }  # fmt: skip
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            tensor = httpclient.InferInput(name, [1, 16], "INT32")
            tensor.set_data_from_numpy(np.arange(16, dtype=np.int32)[None])
            inputs.append(tensor)
        assert client.infer("simple", inputs).as_numpy("OUTPUT0").tolist() == [
            list(range(0, 32, 2))
        ]
        failing = httpclient.InferInput("INPUT0", [1], "INT32")
        failing.set_data_from_numpy(np.ones(1, np.int32))
        with pytest.raises(InferenceServerException, match="intentional failure"):
            client.infer("fail", [failing])
        client.close()
