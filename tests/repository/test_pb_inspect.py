"""In process mode the server never imports a Python model's model.py: a process of the
model's own (its interpreter, its environment) imports it, checks its class and runs its
``auto_complete_config`` on the config's JSON form; the server takes the completed
config back. Failures read as in thread mode. Over REST with tritonclient's repository
API, both instance modes where the behaviour is shared."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import ServerConfig
from trioserve.testing import server_in_thread

from .._model_repository import write_model

# Refuses to be imported by the server; its auto_complete_config says where it ran.
COMPLETED = """
import os
import sys
import numpy as np
import triton_python_backend_utils as pb_utils

if os.getpid() == {server_pid} and {refuse_server}:
    raise RuntimeError("imported in the server's process")
print("a model that prints at import")  # must not garble what the server is told

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        with open({where!r}, "w") as out:
            out.write(str(os.getpid()))
        config.set_max_batch_size(8)
        config.set_dynamic_batching()
        config.add_input({{"name": "X", "data_type": "TYPE_FP32", "dims": [2]}})
        config.add_output({{"name": "Y", "data_type": "TYPE_FP32", "dims": [2]}})
        assert config.as_dict()["input"][0]["name"] == "X"
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
"""
BARE_CONFIG = 'backend: "python"\n'

FAILURES = {
    "no_class": ("x = 1\n", "defines no class 'TritonPythonModel'"),
    "no_execute": ("class TritonPythonModel:\n    pass\n", "TritonPythonModel has no 'execute'"),
    "name_error": ("undefined_name\n", "failed to import: NameError: name 'undefined_name'"),
    "exits": ("import sys\nsys.exit(3)\n", "model 'exits' called sys.exit(3) at import"),
    "bad_hook": (
        "class TritonPythonModel:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(config):\n"
        "        config.set_max_batch_size(4)\n"
        "        config.add_input({'name': 'X', 'data_type': 'TYPE_FP32', 'dims': [3]})\n"
        "        return config\n"
        "    def execute(self, requests):\n"
        "        return []\n",
        "auto_complete_config failed: auto_complete_config: input 'X' has dims [2] in "
        "the model configuration, not [3]",
    ),
    "exits_in_hook": (
        "class TritonPythonModel:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(config):\n"
        "        raise SystemExit('no config')\n"
        "    def execute(self, requests):\n"
        "        return []\n",
        "called sys.exit('no config') in auto_complete_config",
    ),
}
DECLARED_X = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'


@pytest.fixture(params=["thread", "process"])
def mode(request: pytest.FixtureRequest) -> str:
    mode: str = request.param
    return mode


@pytest.fixture
def http(tmp_path: Path, mode: str) -> Iterator[httpclient.InferenceServerClient]:
    root = tmp_path / "models"
    write_model(root, "completed", BARE_CONFIG, COMPLETED.format(
        server_pid=os.getpid(), refuse_server=mode == "process", where=str(tmp_path / "hook")
    ))  # fmt: skip
    for name, (code, _words) in FAILURES.items():
        write_model(root, name, DECLARED_X if name == "bad_hook" else BARE_CONFIG, code)
    config = ServerConfig(
        model_repositories=[root],
        model_control_mode="explicit",
        python_instance_mode=mode,
        http_port=0,
        grpc_port=None,
    )
    with server_in_thread(config) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        yield client
        client.close()


def test_the_config_is_completed_where_the_model_runs(
    http: httpclient.InferenceServerClient, mode: str, tmp_path: Path
) -> None:
    http.load_model("completed")
    config = http.get_model_config("completed")
    assert (config["max_batch_size"], config["dynamic_batching"]["preferred_batch_size"]) == (
        8,
        [8],
    )
    assert [(t["name"], t["dims"]) for t in (*config["input"], *config["output"])] == [
        ("X", [2]),
        ("Y", [2]),
    ]
    x = httpclient.InferInput("X", [1, 2], "FP32")
    x.set_data_from_numpy(np.array([[1.5, 2.0]], np.float32))
    y = http.infer("completed", [x]).as_numpy("Y")
    assert y.tolist() == [[3.0, 4.0]]
    hook_pid = int((tmp_path / "hook").read_text())
    assert (hook_pid == os.getpid()) == (mode == "thread")


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_a_model_file_that_cannot_serve_fails_its_load_alike_in_both_modes(
    http: httpclient.InferenceServerClient, name: str
) -> None:
    with pytest.raises(InferenceServerException) as failed:
        http.load_model(name)
    assert failed.value.status() == "400"
    assert FAILURES[name][1] in failed.value.message()
    (entry,) = [e for e in http.get_model_repository_index() if e["name"] == name]
    assert entry["state"] == "UNAVAILABLE" and FAILURES[name][1] in entry["reason"]


def test_a_process_that_dies_while_importing_fails_the_load(tmp_path: Path) -> None:
    write_model(tmp_path, "dies", BARE_CONFIG, "import os\nos._exit(4)\n")
    config = ServerConfig(
        model_repositories=[tmp_path], model_control_mode="explicit",
        python_instance_mode="process", http_port=0, grpc_port=None,
    )  # fmt: skip
    with server_in_thread(config) as server:
        http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        with pytest.raises(InferenceServerException) as failed:
            http.load_model("dies")
        http.close()
    assert "model 'dies': its process exited with status 4 while it imported model.py" in (
        failed.value.message()
    )
