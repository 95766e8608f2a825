"""What clients can name and what errors tell them.

- Model names in load requests name one folder: ``..``, slashes, NUL or an over-long
  name are refused before anything is written (an upload writes the model's files under
  its name).
- No error a client gets carries one of our tracebacks or a path of the server: load
  failures name model files from their repository folder, and an upload's files from
  the model. (A model's own exception text is the model author's and is passed on.)
- Shared-memory keys are POSIX shared-memory names: anything else is refused before
  any file is opened.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import InvalidArgumentError, Server, ServerConfig
from trioserve.shm import SharedMemoryRegistry
from trioserve.testing import server_in_thread

from ._model_repository import write_model

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""
ECHO = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""
ECHO_CONFIG = json.dumps({
    "backend": "python",
    "max_batch_size": 0,
    "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
    "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}],
})  # fmt: skip
# Fails at import with a SyntaxError, whose text names the file.
SYNTAX_ERROR = "def broken(:\n"
# Raises from initialize, naming its own file (as an author's exception may).
FAILS_TO_START = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("cannot read " + __file__)

    def execute(self, requests):
        return []
"""
# Its execute raises: the request fails, with the model's own message.
RAISES = """
class TritonPythonModel:
    def execute(self, requests):
        raise ValueError("the model refuses")
"""


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    for name, code in (
        ("echo", ECHO),
        ("raises", RAISES),
        ("syntax_error", SYNTAX_ERROR),
        ("fails_to_start", FAILS_TO_START),
    ):
        write_model(root, name, CONFIG.format(name=name), code)
    write_model(root, "bad_config", 'name: "bad_config"\nmax_batch_size: "eight"\n', ECHO)
    return root


@pytest.fixture
def server(repository: Path) -> Iterator[Server]:
    config = ServerConfig(
        model_repositories=[repository],
        model_control_mode="explicit",
        load_models=["echo", "raises"],
        http_port=0,
        grpc_port=0,
    )
    with server_in_thread(config) as running:
        yield running


def assert_no_server_detail(message: str, repository: Path) -> None:
    assert "Traceback" not in message
    assert 'File "' not in message
    assert str(repository.parent) not in message
    assert str(Path(__file__).parents[1]) not in message  # the source tree
    assert tempfile.gettempdir() + os.sep not in message
    assert "site-packages" not in message


def error_of(call: Any, *args: Any, **kwargs: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as raised:
        call(*args, **kwargs)
    return raised.value


@pytest.mark.parametrize(
    "name",
    ["..", ".", "../escaped", "a/b", "/abs", "", "a\0b", "x" * 256, "é" * 128],
)
def test_model_names_that_are_no_folder_name_are_refused(
    server: Server, tmp_path: Path, name: str
) -> None:
    """Over gRPC, which carries any string as the model name."""
    if name == "/abs":
        name = str(tmp_path / "written_here")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    files = {"file:1/model.py": ECHO.encode()}
    error = error_of(client.load_model, name, config=ECHO_CONFIG, files=files)
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "invalid model name" in error.message()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # nothing written
    assert not (Path(tempfile.gettempdir()) / "escaped").exists()
    client.load_model("x" * 255, config=ECHO_CONFIG, files=files)
    assert client.is_model_ready("x" * 255)  # the longest name is a name
    client.close()


def test_a_dot_dot_model_name_over_rest_is_refused(server: Server) -> None:
    response = httpx.post(f"http://127.0.0.1:{server.http_port}/v2/repository/models/%2e%2e/load")
    assert response.status_code == 400
    assert response.json() == {"error": "invalid model name '..'"}


def test_load_failures_name_files_from_the_repository(server: Server, repository: Path) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    expected = {
        "syntax_error": "syntax_error/1/model.py: failed to import: SyntaxError",
        "fails_to_start": "RuntimeError: cannot read fails_to_start/1/model.py",
        "bad_config": "bad_config/config.pbtxt",
    }
    for name, detail in expected.items():
        error = error_of(client.load_model, name)
        assert error.status() == "400"
        assert f"failed to load '{name}'" in error.message()
        assert detail in error.message()
        assert_no_server_detail(error.message(), repository)
    reasons = {entry["name"]: entry["reason"] for entry in client.get_model_repository_index()}
    for name, detail in expected.items():
        assert detail in reasons[name]
        assert_no_server_detail(reasons[name], repository)
    client.close()


def test_upload_failures_name_files_from_the_model(server: Server, repository: Path) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    config = json.dumps({"backend": "python", "max_batch_size": 0})
    for model, detail in (
        (SYNTAX_ERROR, "uploaded/1/model.py: failed to import: SyntaxError"),
        (FAILS_TO_START, "RuntimeError: cannot read uploaded/1/model.py"),
    ):
        files = {"file:1/model.py": model.encode()}
        error = error_of(client.load_model, "uploaded", config=config, files=files)
        assert "failed to load 'uploaded'" in error.message()
        assert detail in error.message()
        assert_no_server_detail(error.message(), repository)
    client.close()


def test_errors_across_endpoints_carry_no_server_detail(server: Server, repository: Path) -> None:
    base = f"http://127.0.0.1:{server.http_port}"
    infer = {"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}]}
    requests: list[tuple[str, str, Any]] = [
        ("GET", "/v2/models/nope", None),
        ("GET", "/v2/models/echo/versions/7", None),
        ("GET", "/v2/models/echo/versions/x/config", None),
        ("POST", "/v2/models/nope/infer", infer),
        ("POST", "/v2/models/echo/infer", {"inputs": "x"}),
        ("POST", "/v2/models/echo/infer", {"inputs": [{"name": "X"}]}),
        ("POST", "/v2/models/echo/infer", b"{not json"),
        ("POST", "/v2/models/echo/infer", b"\xff\xfe"),
        ("POST", "/v2/models/echo/infer", {**infer, "outputs": [{"name": "Z"}]}),
        ("POST", "/v2/models/raises/infer", infer),
        ("POST", "/v2/models/syntax_error/infer", infer),
        ("POST", "/v2/repository/models/nope/load", None),
        ("POST", "/v2/repository/models/nope/unload", None),
        ("POST", "/v2/repository/models/echo/load", {"parameters": {"file:../x": "eA=="}}),
        ("POST", "/v2/repository/models/echo/load", {"parameters": {"config": "{"}}),
        ("POST", "/v2/systemsharedmemory/region/r/register", {"key": "/none", "byte_size": 8}),
        ("POST", "/v2/cudasharedmemory/region/r/register", {"raw_handle": {"b64": "AA=="}}),
        ("GET", "/v2/systemsharedmemory/region/nope/status", None),
        ("POST", "/v2/models/echo/generate", {"text_input": "x"}),
        ("POST", "/v1/completions", {"model": "echo", "prompt": "x"}),
        ("DELETE", "/v2/models/echo", None),
    ]
    with httpx.Client(base_url=base) as http:
        for method, path, body in requests:
            content = body if isinstance(body, bytes) else None
            document = None if isinstance(body, bytes) else body
            response = http.request(method, path, content=content, json=document)
            assert 400 <= response.status_code < 600, (path, response.status_code)
            assert_no_server_detail(response.text, repository)
        raised = http.post("/v2/models/raises/infer", json=infer)
        assert raised.status_code == 500
        assert "ValueError: the model refuses" in raised.json()["error"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    x = grpcclient.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([1], np.int32))
    for call, args in (
        (client.infer, ("raises", [x])),
        (client.infer, ("nope", [x])),
        (client.infer, ("echo", [grpcclient.InferInput("X", [2], "INT32")])),
        (client.get_model_metadata, ("nope",)),
        (client.get_model_config, ("echo", "9")),
        (client.load_model, ("syntax_error",)),
        (client.register_system_shared_memory, ("r", "/none", 8)),
        (client.get_inference_statistics, ("nope",)),
    ):
        assert_no_server_detail(error_of(call, *args).message(), repository)
    assert client.is_server_live()
    client.close()


BAD_KEYS = [
    "../etc/passwd",
    "/../etc/passwd",
    "/dev/shm/../x",
    "a/b",
    "/a/b",
    "",
    "/",
    "//",
    ".",
    "..",
    "a\0b",
    "\0",
    "x" * 256,
    "/" + "é" * 128,
    "\ud800",
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_shared_memory_keys_outside_posix_names_are_refused_before_open(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[object] = []
    monkeypatch.setattr(os, "open", lambda *args, **kwargs: opened.append(args))
    registry = SharedMemoryRegistry()
    with pytest.raises(InvalidArgumentError, match="invalid shared memory key"):
        registry.register_system("r", key, 0, 8)
    assert opened == []
    assert registry.status("system", "") == []
    registry.close()


def test_the_longest_shared_memory_key_is_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """255 bytes (NAME_MAX) passes the name check: the open is what fails here."""
    opened: list[str] = []

    def fake_open(path: str, *args: object) -> int:
        opened.append(path)
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(os, "open", fake_open)
    registry = SharedMemoryRegistry()
    with pytest.raises(InvalidArgumentError, match="unable to open shared memory object"):
        registry.register_system("r", "/" + "k" * 255, 0, 8)
    assert opened == ["/dev/shm/" + "k" * 255]
    registry.close()


@pytest.mark.parametrize("key", ["../etc/passwd", "x" * 300, "a\0b", "/dev/shm/../x"])
def test_bad_keys_over_both_protocols(server: Server, key: str) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    error = error_of(http.register_system_shared_memory, "r", key, 8)
    assert error.status() == "400"
    assert "invalid shared memory key" in error.message()
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    error = error_of(grpc.register_system_shared_memory, "r", key, 8)
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "invalid shared memory key" in error.message()
    assert http.get_system_shared_memory_status() == []
    http.close()
    grpc.close()
