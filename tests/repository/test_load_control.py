"""Loads that go wrong, through the repository API (explicit mode, in-process servers):

- loads of different models run at once, up to ``model_load_thread_count``;
- a load whose import or ``initialize`` hangs fails after ``model_load_timeout_s`` and
  frees its turn, while its thread is left behind (the test releases it at the end);
- a failed reload (invalid config override, an initialize that exits) leaves the version
  served before it serving, as Triton does;
- a failed upload's files are removed at once; a large REST upload is parsed off the
  event loop and decoded into its files a slice at a time;
- uploads' folders are removed in worker threads (failed, replaced, unloaded, and
  those left when the server closes).

The hanging model waits on an event the test sets (the python backend imports it in
this process); the timeouts run on trio's MockClock, moved by hand, so every expectation
is exact.
"""

from __future__ import annotations

import base64
import sys
import tempfile
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import trio.testing
import tritonclient.http as httpclient

from trioserve import Server, ServerConfig, serve
from trioserve._errors import InvalidArgumentError
from trioserve._tensor import datatype
from trioserve._types import InferenceRequest, InputTensor, RequestedOutput
from trioserve.repository import RepositoryManager
from trioserve.testing import server_in_thread

from .._model_repository import write_model

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""
# Answers X times its scale.
SCALED = """
import triton_python_backend_utils as pb_utils

SCALE = {scale}

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * SCALE)]
            )
            for r in requests
        ]
"""
GATE = "trioserve_test_load_control_gate"
# Hangs where it is told to (at import, or in initialize) until the test opens the gate.
HANGS_AT_IMPORT = f"""
import importlib
gate = importlib.import_module({GATE!r})
gate.entered.set()
gate.released.wait(30)  # bounds a broken test; the test sets it
""" + SCALED.format(scale=1)
HANGS_IN_INITIALIZE = SCALED.format(scale=1).replace(
    "class TritonPythonModel:",
    f"""class TritonPythonModel:
    def initialize(self, args):
        import importlib
        gate = importlib.import_module({GATE!r})
        gate.entered.set()
        gate.released.wait(30)  # bounds a broken test; the test sets it
""",
)
EXITS_IN_INITIALIZE = SCALED.format(scale=1).replace(
    "class TritonPythonModel:",
    """class TritonPythonModel:
    def initialize(self, args):
        raise SystemExit(4)
""",
)
TIMEOUT_S = 30.0
UPLOAD_CONFIG = """{"backend": "python", "max_batch_size": 0,
"input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
"output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}]}"""


class Gate(types.ModuleType):
    entered: threading.Event
    released: threading.Event


@pytest.fixture
def gate() -> Iterator[Gate]:
    module = Gate(GATE)
    module.entered = threading.Event()
    module.released = threading.Event()
    sys.modules[GATE] = module
    yield module
    module.released.set()  # whatever happened, the hung thread may end
    del sys.modules[GATE]


async def start(nursery: trio.Nursery, root: Path, **settings: Any) -> Server:
    config = ServerConfig(
        model_repositories=[root],
        model_control_mode="explicit",
        http_port=None,
        grpc_port=None,
        model_load_timeout_s=TIMEOUT_S,
        **settings,
    )
    server: Server = await nursery.start(serve, config)
    return server


def manager(server: Server) -> RepositoryManager:
    control = server.repository.control
    assert isinstance(control, RepositoryManager)
    return control


def states(server: Server) -> dict[str, tuple[str, str]]:
    """name -> (state, reason) from the repository index."""
    return {e["name"]: (e["state"], e["reason"]) for e in manager(server).index(False)}


async def infer(server: Server, name: str, value: int) -> int:
    inputs = {"X": InputTensor("X", datatype("INT32"), (1,), np.array([value], np.int32))}
    request = InferenceRequest(name, "", inputs, [RequestedOutput("Y")])
    response = await server.repository.get(name).infer(request)
    return int(response.outputs[0].data[0])


class Load:
    """A load running in its own task; ``error`` once it failed, ``done`` once it ended."""

    def __init__(self, nursery: trio.Nursery, server: Server, name: str) -> None:
        self.error = ""
        self.done = trio.Event()
        nursery.start_soon(self._run, manager(server), name)

    async def _run(self, control: RepositoryManager, name: str) -> None:
        try:
            await control.load(name, None, {})
        except InvalidArgumentError as exc:
            self.error = str(exc)
        finally:
            self.done.set()


@pytest.mark.parametrize("where", ["import", "initialize"])
async def test_a_hung_load_times_out_and_holds_up_no_other_load(
    mock_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    tmp_path: Path,
    gate: Gate,
    where: str,
) -> None:
    hangs = HANGS_AT_IMPORT if where == "import" else HANGS_IN_INITIALIZE
    write_model(tmp_path, "hangs", CONFIG.format(name="hangs"), hangs)
    write_model(tmp_path, "other", CONFIG.format(name="other"), SCALED.format(scale=2))
    server = await start(nursery, tmp_path)
    hung = Load(nursery, server, "hangs")
    await trio.to_thread.run_sync(gate.entered.wait)  # the model's code is running
    # Meanwhile another model loads, serves, unloads and loads again.
    await manager(server).load("other", None, {})
    assert await infer(server, "other", 3) == 6
    await manager(server).unload("other", False)
    await manager(server).load("other", None, {})
    assert states(server)["hangs"] == ("LOADING", "")
    mock_clock.jump(TIMEOUT_S - 0.001)
    await trio.testing.wait_all_tasks_blocked()
    assert not hung.done.is_set()
    mock_clock.jump(0.001)
    await hung.done.wait()
    reason = "loading took longer than 30 s (--model-load-timeout-secs)"
    assert hung.error.startswith(f"failed to load 'hangs', {reason}")
    state, why = states(server)["hangs"]
    assert state == "UNAVAILABLE" and why.startswith(reason)
    # The manager is free: the same model's next load begins (and hangs in turn).
    gate.entered.clear()
    again = Load(nursery, server, "hangs")
    await trio.to_thread.run_sync(gate.entered.wait)
    gate.released.set()  # both threads go on; the one left behind changes nothing
    await again.done.wait()
    assert again.error == ""
    assert await infer(server, "hangs", 5) == 5
    assert await infer(server, "other", 5) == 10
    nursery.cancel_scope.cancel()


async def test_loads_beyond_the_thread_count_wait_their_turn(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery, tmp_path: Path, gate: Gate
) -> None:
    write_model(tmp_path, "hangs", CONFIG.format(name="hangs"), HANGS_AT_IMPORT)
    write_model(tmp_path, "other", CONFIG.format(name="other"), SCALED.format(scale=2))
    server = await start(nursery, tmp_path, model_load_thread_count=1)
    hung = Load(nursery, server, "hangs")
    await trio.to_thread.run_sync(gate.entered.wait)
    waiting = Load(nursery, server, "other")
    await trio.testing.wait_all_tasks_blocked()
    assert states(server)["other"] == ("", "")  # not loading: the one load slot is taken
    mock_clock.jump(TIMEOUT_S)  # the hung load gives its slot up
    await waiting.done.wait()
    assert hung.done.is_set() and "took longer than 30 s" in hung.error
    assert waiting.error == ""
    assert await infer(server, "other", 4) == 8
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("config", "code", "reason"),
    [
        ('{"max_batch_size": "x"}', None, "the config override is not a valid ModelConfig"),
        (None, EXITS_IN_INITIALIZE, "model 'kept' called sys.exit(4) in initialize"),
    ],
)
async def test_a_failed_reload_keeps_the_old_version_serving(
    nursery: trio.Nursery, tmp_path: Path, config: str | None, code: str | None, reason: str
) -> None:
    write_model(tmp_path, "kept", CONFIG.format(name="kept"), SCALED.format(scale=3))
    server = await start(nursery, tmp_path)
    await manager(server).load("kept", None, {})
    if code is not None:
        write_model(tmp_path, "kept", CONFIG.format(name="kept"), code)
    with pytest.raises(InvalidArgumentError, match="failed to load 'kept'") as failed:
        await manager(server).load("kept", config, {})
    assert reason in str(failed.value)
    assert await infer(server, "kept", 2) == 6  # the old version, still serving
    assert states(server)["kept"] == ("READY", "")
    assert server.repository.model_ready("kept")
    nursery.cancel_scope.cancel()


async def test_a_failed_upload_leaves_no_files(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(uploads))
    (tmp_path / "repository").mkdir()
    server = await start(nursery, tmp_path / "repository")
    good = {"1/model.py": SCALED.format(scale=2).encode(), "1/data.bin": b"x" * 1000}
    await manager(server).load("uploaded", UPLOAD_CONFIG, good)
    assert len(list(uploads.iterdir())) == 1  # the served model's files
    bad = {"1/model.py": b"import sys\nsys.exit(3)\n", "1/data.bin": b"y" * 1000}
    for _ in range(3):
        with pytest.raises(InvalidArgumentError, match=r"called sys.exit\(3\) at import"):
            await manager(server).load("uploaded", UPLOAD_CONFIG, bad)
    # Only the files of the version that still serves are left.
    (kept,) = uploads.iterdir()
    assert (kept / "uploaded" / "1" / "data.bin").read_bytes() == b"x" * 1000
    assert await infer(server, "uploaded", 4) == 8
    await manager(server).unload("uploaded", False)
    assert list(uploads.iterdir()) == []
    nursery.cancel_scope.cancel()


async def test_upload_folders_are_removed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting a large model's files takes tens of milliseconds: never on the event
    loop (this test's thread), and each removal is over before its load, unload or
    close returns."""
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(uploads))
    removed_on: list[tuple[str, bool]] = []  # (folder, on the event loop's thread)
    cleanup = tempfile.TemporaryDirectory.cleanup

    def recorded(upload: tempfile.TemporaryDirectory[str]) -> None:
        removed_on.append((Path(upload.name).name, threading.current_thread() is loop))
        cleanup(upload)

    monkeypatch.setattr(tempfile.TemporaryDirectory, "cleanup", recorded)
    loop = threading.current_thread()
    (tmp_path / "repository").mkdir()
    files = {"1/model.py": SCALED.format(scale=2).encode()}
    bad = {"1/model.py": b"import sys\nsys.exit(3)\n"}

    def folders() -> list[str]:
        return sorted(folder.name for folder in uploads.iterdir())

    async with trio.open_nursery() as nursery:
        server = await start(nursery, tmp_path / "repository")
        await manager(server).load("first", UPLOAD_CONFIG, files)
        (first,) = folders()
        with pytest.raises(InvalidArgumentError):
            await manager(server).load("first", UPLOAD_CONFIG, bad)
        assert folders() == [first]  # the failed load's folder went before it answered
        failed = removed_on[-1][0]
        await manager(server).load("first", UPLOAD_CONFIG, files)  # replaces the first
        (second,) = folders()
        await manager(server).load("other", UPLOAD_CONFIG, files)
        await manager(server).unload("other", False)
        assert folders() == [second]
        other = removed_on[-1][0]
        nursery.cancel_scope.cancel()  # the server closes: the served upload goes
    assert folders() == []
    assert removed_on == [(failed, False), (first, False), (other, False), (second, False)]


def test_a_large_rest_upload_is_decoded_into_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over HTTP: a body past OFF_LOOP_BYTES is parsed in a worker thread, and each file
    decoded a slice at a time as it is written; bad base64 fails that load alone."""
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(uploads))
    (tmp_path / "repository").mkdir()
    config = ServerConfig(
        model_repositories=[tmp_path / "repository"],
        model_control_mode="explicit",
        http_port=0,
        grpc_port=None,
    )
    data = np.random.default_rng(0).bytes(9 * 1024 * 1024 + 1)  # slices, and a last one
    model = SCALED.format(scale=2).encode()
    url = "http://127.0.0.1:{}/v2/repository/models/uploaded/load"
    with server_in_thread(config) as running:
        files = {"file:1/model.py": model, "file:1/data.bin": data}
        body = {
            "parameters": {
                "config": UPLOAD_CONFIG,
                **{key: base64.b64encode(value).decode() for key, value in files.items()},
            }
        }
        loaded = httpx.post(url.format(running.http_port), json=body, timeout=60)
        assert loaded.status_code == 200
        (folder,) = uploads.iterdir()
        assert (folder / "uploaded" / "1" / "data.bin").read_bytes() == data
        for bad in ("QUJD=A==", "QUJ", "QUJD\n", "QUJDé"):
            body["parameters"]["file:1/data.bin"] = bad
            refused = httpx.post(url.format(running.http_port), json=body, timeout=60)
            assert refused.status_code == 400
            assert refused.json() == {
                "error": "failed to load 'uploaded', parameter 'file:1/data.bin' is not valid "
                "base64"
            }
        assert list(uploads.iterdir()) == [folder]  # the failed ones left nothing
        http = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        x = httpclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([21], np.int32))
        assert http.infer("uploaded", [x]).as_numpy("Y").tolist() == [42]
        http.close()
