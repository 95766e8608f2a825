"""Repository uploads over REST, parsed as their body arrives (``rest/_load_body.py``):

- a large upload costs the server a few MiB (tracemalloc's peak while it is sent), not
  the body's size several times over;
- every way an upload can be wrong answers 400 (413 past the body limit) with a JSON
  error and leaves no file behind, nor does a client that leaves halfway;
- a compressed upload is inflated as it arrives.

One server (in a thread of this process, so tracemalloc sees its allocations) serves
the whole module; ``tempfile.tempdir`` points at a folder of the test's own, where both
the staging folders and the loads' folders go.
"""

from __future__ import annotations

import base64
import gzip
import http.client
import json
import socket
import tempfile
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from trioserve import Server, ServerConfig
from trioserve._limits import HttpLimits
from trioserve.testing import server_in_thread

MODEL = b"""
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests
        ]
"""
CONFIG = json.dumps(
    {
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
        "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}],
    }
)
BODY_LIMIT = 32 * 1024 * 1024


@pytest.fixture(scope="module")
def uploads(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("uploads")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(folder))
        yield folder


@pytest.fixture(scope="module")
def server(uploads: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = ServerConfig(
        model_repositories=[tmp_path_factory.mktemp("repository")],
        model_control_mode="explicit",
        http_port=0,
        grpc_port=None,
        http_limits=HttpLimits(max_body_bytes=BODY_LIMIT),
    )
    with server_in_thread(config) as running:
        yield running


def load_body(files: dict[str, bytes], config: str | None = CONFIG) -> bytes:
    parameters: dict[str, str] = {} if config is None else {"config": config}
    for path, content in files.items():
        parameters[f"file:{path}"] = base64.b64encode(content).decode()
    return json.dumps({"parameters": parameters}).encode()


def post(
    server: Server, body: bytes, name: str = "up", headers: dict[str, str] | None = None
) -> tuple[int, object]:
    """POST ``body`` to the load of ``name`` from a socket of our own, sent from slices
    of ``body`` (no copy of it made here); the status and the JSON answer (or None)."""
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        head = f"POST /v2/repository/models/{name}/load HTTP/1.1\r\nhost: x\r\n"
        for key, value in {"content-length": str(len(body)), **(headers or {})}.items():
            head += f"{key}: {value}\r\n"
        sock.sendall(head.encode() + b"\r\n")
        sock.sendall(memoryview(body))
        response = http.client.HTTPResponse(sock)
        response.begin()
        answer = response.read()
        return response.status, json.loads(answer) if answer else None


def folders(uploads: Path) -> set[str]:
    return {p.name for p in uploads.iterdir()}


def test_a_large_upload_costs_a_few_mib(server: Server, uploads: Path) -> None:
    data = np.random.default_rng(0).bytes(20 * 1024 * 1024)
    body = load_body({"1/model.py": MODEL, "1/data.bin": data})  # 27 MiB
    tracemalloc.start()
    try:
        status, _ = post(server, body, "big")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 200
    (folder,) = uploads.iterdir()  # staging gone, the load's folder kept
    assert (folder / "big" / "1" / "data.bin").read_bytes() == data
    unload(server, "big")
    assert folders(uploads) == set()
    assert peak < 12 * 1024 * 1024, peak  # the whole body would be 27 MiB at least


GOOD = {"1/model.py": MODEL, "1/data.bin": bytes(range(256)) * 2000}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            load_body(GOOD).replace(b'"file:1/data.bin": "AAEC', b'"file:1/data.bin": "A=EC'),
            "failed to load 'up', parameter 'file:1/data.bin' is not valid base64",
        ),
        (
            load_body(GOOD).replace(b'"file:1/data.bin": "AAEC', b'"file:1/data.bin": "AAE\\u00e9'),
            "failed to load 'up', parameter 'file:1/data.bin' is not valid base64",
        ),
        (
            load_body(GOOD)[:-3] + b'A"}}',  # a character after the padding
            "failed to load 'up', parameter 'file:1/data.bin' is not valid base64",
        ),
        (load_body(GOOD)[:-10], "malformed JSON in the request: Unterminated string"),
        (load_body(GOOD) + b" {", "malformed JSON in the request: Extra data"),
        (
            load_body({**GOOD, "../escaped": b"x"}),
            "failed to load 'up', Invalid file path '../escaped': must stay in the model",
        ),
        (
            load_body({**GOOD, "/abs/x": b"x"}),
            "failed to load 'up', Invalid file path '/abs/x': must stay in the model",
        ),
        (
            load_body(GOOD, config=None),
            "failed to load 'up', file: parameters need a 'config' parameter beside them",
        ),
        (load_body(GOOD, config="{"), "failed to load 'up', "),
        (
            load_body({**GOOD, "1/model.py": b"raise RuntimeError('no')"}),
            "failed to load 'up', ",
        ),
        (
            load_body(GOOD).replace(b'{"parameters": {', b'{"parameters": {"file:x": 1, '),
            "parameter 'file:x' must be a base64 string",
        ),
        (b'{"parameters": [' + load_body(GOOD) + b"]}", "'parameters' must be a JSON object"),
    ],
)
def test_a_bad_upload_is_refused_and_leaves_no_file(
    server: Server, uploads: Path, body: bytes, error: str
) -> None:
    status, answer = post(server, body)
    assert status == 400
    assert isinstance(answer, dict) and list(answer) == ["error"]
    assert answer["error"].startswith(error), answer
    assert folders(uploads) == set()


def test_inflated_past_the_body_limit_is_413_and_leaves_no_file(
    server: Server, uploads: Path
) -> None:
    bomb = gzip.compress(load_body({"1/model.py": MODEL, "1/data.bin": bytes(BODY_LIMIT)}), 9)
    status, answer = post(server, bomb, headers={"content-encoding": "gzip"})
    assert (status, answer) == (
        413,
        {"error": f"request body exceeds the limit of {BODY_LIMIT} bytes"},
    )
    assert folders(uploads) == set()


def test_a_client_that_leaves_halfway_leaves_no_file(server: Server, uploads: Path) -> None:
    body = load_body({"1/model.py": MODEL, "1/data.bin": bytes(8 * 1024 * 1024)})
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        head = f"POST /v2/repository/models/up/load HTTP/1.1\r\ncontent-length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body[: len(body) // 2])
    # The server reads the hangup soon; ask it something until its staging folder is
    # gone (each question a round trip, which lets the server's loop turn).
    for _ in range(1_000):
        if not folders(uploads):
            break
        live(server)
    assert folders(uploads) == set()


def test_a_compressed_upload_is_inflated_as_it_arrives(server: Server, uploads: Path) -> None:
    for encoding, compress in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        status, _ = post(
            server, compress(load_body(GOOD)), "zipped", {"content-encoding": encoding}
        )
        assert status == 200
        (folder,) = uploads.iterdir()
        assert (folder / "zipped" / "1" / "data.bin").read_bytes() == GOOD["1/data.bin"]
    truncated = gzip.compress(load_body(GOOD))[:-20]
    status, answer = post(server, truncated, "zipped", {"content-encoding": "gzip"})
    assert (status, answer) == (400, {"error": "truncated gzip body"})
    unload(server, "zipped")
    assert folders(uploads) == set()


def unload(server: Server, name: str) -> None:
    assert ask(server, f"POST /v2/repository/models/{name}/unload") == 200


def live(server: Server) -> None:
    assert ask(server, "GET /v2/health/live") == 200


def ask(server: Server, request: str) -> int:
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.sendall(f"{request} HTTP/1.1\r\ncontent-length: 0\r\n\r\n".encode())
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status
