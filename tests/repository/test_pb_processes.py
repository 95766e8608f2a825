"""Python-backend instances in processes of their own: a segfault, ``os._exit`` and a
SIGKILL mid-request fail only the requests that instance had in flight, with an error
naming the model and how its process ended; the instance starts again while the other
instance and the other models serve; one that keeps dying is UNAVAILABLE in the index;
the model's log lines and custom metrics (from three instances) reach the server's log
and /metrics; the stub imports no trio, protobuf or prometheus_client; nothing is left
behind (processes, descriptors, mappings); a model runs in its EXECUTION_ENV_PATH
environment beside the server's numpy. Over REST and gRPC with tritonclient."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig
from trioserve.repository import _pb_launch
from trioserve.testing import server_in_thread

from .._model_repository import write_model

# MODE 0 answers the instance's pid; 1 segfaults; 2 calls os._exit(3); 3 tells the test
# its pid through the FIFO named by the input and waits to be killed.
CRASHY = """
import ctypes
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        pb_utils.Logger.log_warn(f"{args['model_instance_name']} starts in {os.getpid()}")

    def execute(self, requests):
        responses = []
        for request in requests:
            mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0])
            if mode == 1:
                ctypes.string_at(0)
            elif mode == 2:
                os._exit(3)
            elif mode == 3:
                fifo = pb_utils.get_input_tensor_by_name(request, "FIFO").as_numpy()[0]
                with open(fifo.decode(), "w") as out:
                    out.write(str(os.getpid()))
                time.sleep(600)
            pid = pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))
            responses.append(pb_utils.InferenceResponse([pid]))
        return responses
"""

CRASHY_CONFIG = """
backend: "python"
input [ { name: "MODE" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "FIFO" data_type: TYPE_STRING dims: [ 1 ] optional: true } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
parameters { key: "TRIOSERVE_INSTANCE_MODE" value { string_value: "process" } }
"""

FRAGILE_CONFIG = CRASHY_CONFIG.replace("count: 2", "count: 1")

# Each of its three instances counts its start on one counter of the server's /metrics.
COUNTED = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        family = pb_utils.MetricFamily("instances_started", "instances that started",
                                       pb_utils.MetricFamily.COUNTER)
        family.Metric(labels={"model": args["model_name"]}).increment(1)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([1], np.int32))])
                for _ in requests]
"""

COUNTED_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 3 kind: KIND_CPU } ]
"""

# A 1 MiB output (made through DLPack), read in place from the instance's arena.
BIG = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            y = pb_utils.Tensor("Y", np.arange(1 << 18, dtype=np.float32) + x[0])
            # Through DLPack and back, as models hand tensors to and from frameworks.
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor.from_dlpack("Y", y.to_dlpack())
            ]))
        return responses
"""

BIG_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 262144 ] } ]
"""

# The numpy its process imports, and the interpreter it runs. Its input goes through
# DLPack and back (numpy 1.26 exports no read-only array: a copy of it).
VERSIONS = """
import sys
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            back = pb_utils.Tensor.from_dlpack("X", x.to_dlpack()).as_numpy()
            if back.tolist() != x.as_numpy().tolist():
                raise pb_utils.TritonModelException(f"through DLPack: {back}")
        found = np.array([np.__version__.encode(), sys.executable.encode()], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("V", found)]) for _ in requests]
"""

VERSIONS_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "V" data_type: TYPE_STRING dims: [ 2 ] } ]
parameters { key: "EXECUTION_ENV_PATH" value { string_value: "$$TRITON_MODEL_DIRECTORY/env" } }
"""

CLIENTS = [httpclient, grpcclient]
IDS = ["rest", "grpc"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("processes")
    write_model(root, "crashy", CRASHY_CONFIG, CRASHY)
    write_model(root, "counted", COUNTED_CONFIG, COUNTED)
    write_model(root, "big", BIG_CONFIG, BIG)
    # The tests here kill crashy's instances more often than the default allows.
    with server_in_thread(process_config(root, restart_limit=100)) as running:
        yield running


def process_config(root: Path, restart_limit: int) -> ServerConfig:
    return ServerConfig(
        model_repositories=[root],
        http_port=0,
        grpc_port=0,
        python_instance_mode="process",
        backend_config={"python": {"instance-restart-limit": str(restart_limit)}},
    )


def client_of(server: Server, module: Any) -> Any:
    port = server.http_port if module is httpclient else server.grpc_port
    return module.InferenceServerClient(f"127.0.0.1:{port}")


def mode(module: Any, value: int, fifo: str = "") -> list[Any]:
    tensor = module.InferInput("MODE", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], np.int32))
    if not fifo:
        return [tensor]
    path = module.InferInput("FIFO", [1], "BYTES")
    path.set_data_from_numpy(np.array([fifo.encode()], dtype=object))
    return [tensor, path]


def pids(server: Server, name: str) -> list[int | None]:
    return server.repository.get(name).model.instance_pids()  # type: ignore[attr-defined, no-any-return]


def failures(client: Any, name: str) -> int:
    stats = client.get_inference_statistics(name)
    if isinstance(stats, dict):
        return int(stats["model_stats"][0]["inference_stats"]["fail"]["count"])
    return int(stats.model_stats[0].inference_stats.fail.count)


def answered_pid(client: Any, module: Any) -> int:
    return int(client.infer("crashy", mode(module, 0)).as_numpy("PID")[0])


@pytest.mark.parametrize("module", CLIENTS, ids=IDS)
@pytest.mark.parametrize(
    ("crash", "ended"),
    [(1, "its process was killed by SIGSEGV"), (2, "its process exited with status 3")],
    ids=["segfault", "os._exit"],
)
def test_a_dying_instance_fails_only_its_request_and_starts_again(
    server: Server, module: Any, crash: int, ended: str
) -> None:
    client = client_of(server, module)
    before = pids(server, "crashy")
    failed_before = failures(client, "crashy")
    with pytest.raises(InferenceServerException) as raised:
        client.infer("crashy", mode(module, crash))
    assert "model 'crashy' instance 'crashy_" in str(raised.value)
    assert ended in str(raised.value)
    # The other instance served meanwhile; the dead one serves again once restarted.
    assert {answered_pid(client, module) for _ in range(6)} <= set(pids(server, "crashy"))
    after = pids(server, "crashy")
    assert len(set(before) & set(after)) == 1  # one instance is a new process
    assert failures(client, "crashy") == failed_before + 1
    assert client.infer("counted", counted_input(module)).as_numpy("Y").tolist() == [1]
    client.close()


def counted_input(module: Any) -> list[Any]:
    tensor = module.InferInput("X", [1], "INT32")
    tensor.set_data_from_numpy(np.array([0], np.int32))
    return [tensor]


@pytest.mark.parametrize("module", CLIENTS, ids=IDS)
def test_sigkill_mid_request(server: Server, module: Any, tmp_path: Path) -> None:
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    client = client_of(server, module)
    outcome: list[BaseException | None] = []

    def request() -> None:
        try:
            client.infer("crashy", mode(module, 3, str(fifo)))
            outcome.append(None)
        except Exception as exc:  # the test reads what it was
            outcome.append(exc)
        # Had it not reached the model, the test would still wait for the model's pid:
        # end its wait (it then reads no pid and fails).
        with contextlib.suppress(OSError):  # ENXIO: the test no longer waits
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=request)
    thread.start()
    with fifo.open() as started:  # opens once the model opened its end, mid-request
        pid = int(started.read())
    assert pid in pids(server, "crashy"), outcome
    other = client_of(server, module)  # a client of its own: the first one is waiting
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert "its process was killed by SIGKILL" in str(outcome[0])
    assert answered_pid(other, module) in pids(server, "crashy")
    other.close()
    client.close()


def test_the_models_log_reaches_the_servers_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_model(tmp_path, "crashy", FRAGILE_CONFIG, CRASHY)
    config = ServerConfig(
        model_repositories=[tmp_path],
        http_port=None,
        grpc_port=None,
        python_instance_mode="process",
    )
    with (
        caplog.at_level(logging.INFO, "trioserve.python_backend"),
        server_in_thread(config) as running,
    ):
        pid = pids(running, "crashy")[0]
    assert (
        "trioserve.python_backend",
        logging.WARNING,
        f"crashy_0 starts in {pid}",
    ) in caplog.record_tuples


def test_one_that_keeps_dying_is_unavailable(tmp_path: Path) -> None:
    write_model(tmp_path, "fragile", FRAGILE_CONFIG, CRASHY)
    config = ServerConfig(
        model_repositories=[tmp_path],
        http_port=0,
        grpc_port=None,
        python_instance_mode="process",
        backend_config={"python": {"instance-restart-limit": "2"}},
    )
    with server_in_thread(config) as running:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        for _ in range(2):
            with pytest.raises(InferenceServerException, match="SIGSEGV"):
                client.infer("fragile", mode(httpclient, 1))
        with pytest.raises(InferenceServerException, match="'fragile' is unavailable"):
            client.infer("fragile", mode(httpclient, 0))
        (entry,) = client.get_model_repository_index()
        assert entry["state"] == "UNAVAILABLE"
        assert "'fragile_0' ended 2 times within 60 s" in entry["reason"]
        assert "SIGSEGV" in entry["reason"]
        assert not client.is_model_ready("fragile")
        client.close()


def test_custom_metrics_from_three_instances(server: Server) -> None:
    url = f"http://127.0.0.1:{server.http_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert 'instances_started{model="counted"} 3.0' in text
    assert len(set(pids(server, "counted"))) == 3


@pytest.mark.parametrize("module", CLIENTS, ids=IDS)
def test_big_outputs_are_read_in_place_and_their_memory_reused(server: Server, module: Any) -> None:
    client = client_of(server, module)
    for step in range(40):
        x = module.InferInput("X", [1], "FP32")
        x.set_data_from_numpy(np.array([step], np.float32))
        y = client.infer("big", [x]).as_numpy("Y")
        assert y[0] == step and y[-1] == (1 << 18) - 1 + step
    client.close()
    (pid,) = pids(server, "big")
    # Each output block went back to the instance's arena once sent: its segments (of
    # 1 MiB) did not grow with the 40 MiB it answered.
    segments = Path(f"/proc/{pid}/maps").read_text().count("trioserve-ipc")
    assert segments <= 6


def test_the_stub_imports_no_trio_protobuf_or_prometheus() -> None:
    probe = (
        "import sys, trioserve.repository._pb_stub\n"
        "print(sorted(m for m in ('trio', 'google.protobuf', 'prometheus_client', "
        "'trioserve._server') if m in sys.modules))\n"
        "print(trioserve.repository._pb_stub.__file__)\n"
    )
    env = _pb_launch.environment(None)
    found = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    lines = found.stdout.splitlines()
    assert lines[0] == "[]", found.stderr
    assert lines[1].startswith(str(_pb_launch.stub_path()))


def _own_state() -> tuple[set[str], int]:
    """This process's descriptors, and its mappings of arena memory."""
    fds = set(os.listdir("/proc/self/fd"))
    maps = Path("/proc/self/maps").read_text()
    return fds, maps.count("trioserve-ipc")


def _stub_children() -> set[int]:
    """The instance processes among this process's children."""
    children = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread or child that just ended
            for child in (task / "children").read_text().split():
                if b"_pb_stub" in Path(f"/proc/{child}/cmdline").read_bytes():
                    children.add(int(child))
    return children


def _serve_and_crash(config: ServerConfig) -> set[int]:
    """Serve a few requests, then one death, and stop at once (while the instance may
    be starting again); the instance processes seen."""
    with server_in_thread(config) as running:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        results = [client.infer("crashy", mode(httpclient, 0)) for _ in range(4)]
        with pytest.raises(InferenceServerException):
            client.infer("crashy", mode(httpclient, 2))
        started = _stub_children()
        client.close()
    del results  # the server's responses are gone: their blocks went back
    return started


def test_nothing_is_left_behind(tmp_path: Path) -> None:
    write_model(tmp_path, "crashy", CRASHY_CONFIG, CRASHY)
    config = ServerConfig(
        model_repositories=[tmp_path], http_port=0, grpc_port=None, python_instance_mode="process"
    )
    # A first round makes what lives on in this process anyway (the HTTP client's event
    # hub); the second shows what a server left behind.
    _serve_and_crash(config)
    fds_before, mappings_before = _own_state()  # the module's server holds some
    children_before = _stub_children()
    started = _serve_and_crash(config)
    assert started - children_before
    fds_after, mappings_after = _own_state()
    assert mappings_after == mappings_before
    leaked = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in fds_after - fds_before}
    assert leaked == {}
    assert _stub_children() == children_before  # all reaped: none left, none a zombie


@pytest.fixture(scope="session")
def old_numpy_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding numpy 1.26.4 (the server runs numpy 2)."""
    env = tmp_path_factory.mktemp("env") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = (
        env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    )
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary", ":all:",
         "--target", str(site), "numpy==1.26.4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if installed.returncode != 0:
        pytest.skip(
            f"numpy 1.26.4 could not be installed from the package index: {installed.stderr[-300:]}"
        )
    return env


@pytest.mark.parametrize("module", CLIENTS, ids=IDS)
def test_execution_env_path_runs_the_models_own_environment(
    tmp_path: Path, old_numpy_env: Path, module: Any
) -> None:
    write_model(tmp_path, "versions", VERSIONS_CONFIG, VERSIONS)
    (tmp_path / "versions" / "env").symlink_to(old_numpy_env)
    config = ServerConfig(
        model_repositories=[tmp_path], http_port=0, grpc_port=0, python_instance_mode="process"
    )
    with server_in_thread(config) as running:
        client = client_of(running, module)
        version, python = client.infer("versions", counted_input(module)).as_numpy("V").tolist()
        client.close()
    assert version == b"1.26.4"
    assert np.__version__ != "1.26.4"
    assert python.decode() == str(tmp_path / "versions" / "env" / "bin" / "python")


# Each instance tells the device its process was given.
DEVICE = """
import os
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.device = args["model_instance_device_id"]

    def execute(self, requests):
        seen = np.array([self.device.encode(), os.environ["CUDA_VISIBLE_DEVICES"].encode()],
                        dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("V", seen)]) for _ in requests]
"""

DEVICE_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "V" data_type: TYPE_STRING dims: [ 2 ] } ]
instance_group [ { count: 1 kind: KIND_GPU gpus: [ 3 ] } ]
"""


def test_a_gpu_instance_sees_its_device(tmp_path: Path) -> None:
    write_model(tmp_path, "device", DEVICE_CONFIG, DEVICE)
    config = ServerConfig(
        model_repositories=[tmp_path], http_port=0, grpc_port=None, python_instance_mode="process"
    )
    with server_in_thread(config) as running:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        seen = client.infer("device", counted_input(httpclient)).as_numpy("V").tolist()
        client.close()
    assert seen == [b"3", b"3"]


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="python has no setting 'shm-size'"):
        ServerConfig(backend_config={"python": {"shm-size": "1"}})
    with pytest.raises(ValueError, match="python,shm-growth-byte-size must be an integer >= 1"):
        ServerConfig(backend_config={"python": {"shm-growth-byte-size": "0"}})
    with pytest.raises(ValueError, match="python_instance_mode must be one of thread, process"):
        ServerConfig(python_instance_mode="fork")


def test_a_bad_instance_mode_fails_that_model(tmp_path: Path) -> None:
    write_model(tmp_path, "odd", CRASHY_CONFIG.replace('"process"', '"fork"'), CRASHY)
    config = ServerConfig(model_repositories=[tmp_path], http_port=0, grpc_port=None)
    with server_in_thread(config) as running:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        (entry,) = client.get_model_repository_index()
        assert entry["state"] == "UNAVAILABLE"
        assert "TRIOSERVE_INSTANCE_MODE must be 'thread' or 'process'" in entry["reason"]
        client.close()


def test_an_instance_down_for_good_gets_no_more_batches(tmp_path: Path) -> None:
    write_model(tmp_path, "crashy", CRASHY_CONFIG, CRASHY)
    # One death leaves an instance down for good.
    with server_in_thread(process_config(tmp_path, restart_limit=1)) as running:
        rest = client_of(running, httpclient)
        with pytest.raises(InferenceServerException, match="SIGSEGV"):
            rest.infer("crashy", mode(httpclient, 1))
        (entry,) = rest.get_model_repository_index()
        assert "ended 1 times within 60 s" in entry["reason"]

        def answers(module: Any) -> list[int]:
            client = client_of(running, module)
            answered = [answered_pid(client, module) for _ in range(10)]
            client.close()
            return answered

        # Every request, one after another and four at a time, over both protocols,
        # goes to the instance that still serves.
        with ThreadPoolExecutor(4) as pool:
            answered = [
                p for f in [pool.submit(answers, m) for m in CLIENTS * 2] for p in f.result()
            ]
        answered += answers(httpclient)
        assert len(answered) == 50
        assert len(set(answered)) == 1
        os.kill(answered[0], 0)  # alive
        assert failures(rest, "crashy") == 1
        rest.close()
