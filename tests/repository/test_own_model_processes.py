"""trioserve's own ``Model``s (the own layout's model.py) with each instance in a process
of its own (``parameters={"TRIOSERVE_INSTANCE_MODE": "process"}``): a plain and a trio
``async`` model answer from processes other than the server's, one per instance; an
``os._exit`` in execute fails only its request, with an error naming the model and how
the process ended, and a new process serves next; one that keeps dying is UNAVAILABLE;
``load`` and ``unload`` run in the process, and a failing load fails the model; an error
returned for one request of a batch keeps its status, an exception fails its batch; a
decoupled model streams its responses from its process; a GPU model's processes see its
device; a client's system shared-memory input reaches the model; the model's
``memory_usage()`` and ``unavailable()`` are read in its processes; features that cannot
cross into a process fail the load, named; a model that does not opt in still runs in
the server, whatever the server's ``python_instance_mode``. Over REST and gRPC with
tritonclient, against a server in the test's process (``os.getpid()`` is the server's)."""

from __future__ import annotations

import os
import queue
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig
from trioserve.testing import server_in_thread

from .test_pb_processes import CLIENTS, IDS, client_of, failures, pids, process_config

# MODE 0 answers the pid; 2 calls os._exit(3); 4 is refused alone as invalid; 5 raises.
CRASHY = """
import os
import numpy as np
import trioserve

class Crashy(trioserve.Model):
    def execute(self, requests):
        results = []
        for request in requests:
            mode = int(request.inputs["MODE"].data.reshape(-1)[0])
            if mode == 2:
                os._exit(3)
            if mode == 4:
                results.append(trioserve.InvalidArgumentError("mode 4 is refused"))
                continue
            if mode == 5:
                raise ValueError(f"mode 5 in {os.getpid()}")
            results.append({"PID": np.array([[os.getpid()]]), "BATCH": np.array([[len(requests)]])})
        return results

model = Crashy(
    name="ignored: the folder names it",
    inputs=[trioserve.TensorSpec("MODE", "INT32", [1])],
    outputs=[
        trioserve.TensorSpec("PID", "INT64", [1]),
        trioserve.TensorSpec("BATCH", "INT64", [1]),
    ],
    instance_count=INSTANCES,
    max_batch_size=4,
    dynamic_batching=trioserve.DynamicBatching(
        preferred_batch_size=[2], max_queue_delay_microseconds=DELAY
    ),
    parameters={"TRIOSERVE_INSTANCE_MODE": "process"},
)
"""

# Trio code in execute; load, async too, keeps the pid it ran in; unload writes its pid
# beside the model.py.
ASYNC = """
import os
from pathlib import Path
import numpy as np
import trio
import trioserve

class Loaded(trioserve.Model):
    async def load(self):
        await trio.sleep(0)
        self.loaded_in = os.getpid()

    async def execute(self, requests):
        await trio.sleep(0)
        pid = np.array([os.getpid()])
        return [{"PID": pid, "LOADED": np.array([self.loaded_in])} for _ in requests]

    def unload(self):
        (Path(__file__).parent / "unloaded").write_text(str(os.getpid()))

model = Loaded(
    name="loaded",
    inputs=[trioserve.TensorSpec("MODE", "INT32", [1])],
    outputs=[
        trioserve.TensorSpec("PID", "INT64", [1]),
        trioserve.TensorSpec("LOADED", "INT64", [1]),
    ],
    parameters=PARAMETERS,
)
"""

# A decorated function; its input may come from a client's shared memory.
SUMMED = """
import os
import numpy as np
import trioserve

@trioserve.model(
    name="summed",
    inputs=[trioserve.TensorSpec("X", "FP32", [-1])],
    outputs=[
        trioserve.TensorSpec("SUM", "FP64", [1]),
        trioserve.TensorSpec("PID", "INT64", [1]),
    ],
    parameters={"TRIOSERVE_INSTANCE_MODE": "process"},
)
def model(X):
    return {"SUM": np.array([X.sum()]), "PID": np.array([os.getpid()])}
"""

# A GPU model: the device its instances' processes see.
DEVICE = """
import os
import numpy as np
import trioserve

@trioserve.model(
    name="device",
    inputs=[trioserve.TensorSpec("MODE", "INT32", [1])],
    outputs=[trioserve.TensorSpec("V", "BYTES", [1])],
    device="gpu",
    parameters={"TRIOSERVE_INSTANCE_MODE": "process"},
)
def model(MODE):
    return {"V": np.array([os.environ.get("CUDA_VISIBLE_DEVICES", "unset").encode()], object)}
"""

# Decoupled: COUNT responses, each with its index and the pid, then the final flag alone.
STREAMED = """
import os
import numpy as np
import trio
import trioserve

class Streamed(trioserve.Model):
    async def execute(self, requests):
        for request in requests:
            for index in range(int(request.inputs["COUNT"].data[0])):
                await trio.sleep(0)
                request.response_sender.send(
                    {"INDEX": np.array([index]), "PID": np.array([os.getpid()])}
                )
            request.response_sender.send(final=True)

model = Streamed(
    name="streamed",
    inputs=[trioserve.TensorSpec("COUNT", "INT32", [1])],
    outputs=[
        trioserve.TensorSpec("INDEX", "INT64", [1]),
        trioserve.TensorSpec("PID", "INT64", [1]),
    ],
    decoupled=True,
    parameters={"TRIOSERVE_INSTANCE_MODE": "process"},
)
"""

PROCESS = '{"TRIOSERVE_INSTANCE_MODE": "process"}'

# What the model says of itself, from its processes: 1,000 bytes of host memory held by
# each instance; MODE 9 takes the instance that runs it out of service.
REPORTING = """
import os
import numpy as np
import trioserve

class Reporting(trioserve.Model):
    def load(self):
        self.down = None

    def memory_usage(self):
        return [trioserve.MemoryUsage("CPU", 0, 1000)]

    def unavailable(self):
        return self.down

    def execute(self, requests):
        for request in requests:
            if int(request.inputs["MODE"].data.reshape(-1)[0]) == 9:
                self.down = f"taken out of service in {os.getpid()}"
        return [{"PID": np.array([os.getpid()])} for _ in requests]

model = Reporting(
    name="reporting",
    inputs=[trioserve.TensorSpec("MODE", "INT32", [1])],
    outputs=[trioserve.TensorSpec("PID", "INT64", [1])],
    instance_count=2,
    parameters={"TRIOSERVE_INSTANCE_MODE": "process"},
)
"""


def write(root: Path, name: str, code: str, **values: object) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    code = textwrap.dedent(code)
    for key, value in values.items():
        code = code.replace(key, str(value))
    (folder / "model.py").write_text(code)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("own")
    write(root, "crashy", CRASHY, INSTANCES=2, DELAY=0)
    write(root, "batched", CRASHY, INSTANCES=1, DELAY=20_000_000)
    write(root, "loaded", ASYNC, PARAMETERS=PROCESS)
    write(root, "threaded", ASYNC, PARAMETERS="{}")
    write(root, "summed", SUMMED)
    write(root, "streamed", STREAMED)
    write(root, "device", DEVICE)
    return root


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Server]:
    with server_in_thread(process_config(root, restart_limit=100)) as running:
        yield running


def mode(module: Any, value: int, batched: bool = True) -> list[Any]:
    """The MODE input; ``batched``: for a model that batches (a batch of one)."""
    shape = [1, 1] if batched else [1]
    tensor = module.InferInput("MODE", shape, "INT32")
    tensor.set_data_from_numpy(np.full(shape, value, np.int32))
    return [tensor]


def answered_pid(client: Any, module: Any, name: str = "crashy") -> int:
    return int(client.infer(name, mode(module, 0)).as_numpy("PID").reshape(-1)[0])


@pytest.mark.parametrize("module", CLIENTS, ids=IDS)
def test_instances_answer_from_processes_of_their_own(server: Server, module: Any) -> None:
    client = client_of(server, module)
    instances = pids(server, "crashy")
    assert len(set(instances)) == 2 and os.getpid() not in instances
    assert {answered_pid(client, module) for _ in range(4)} <= set(instances)
    # The trio model: its load ran in its process too, before the first batch.
    (loaded,) = pids(server, "loaded")
    answer = client.infer("loaded", mode(module, 0, batched=False))
    assert answer.as_numpy("PID").tolist() == answer.as_numpy("LOADED").tolist() == [loaded]
    assert loaded != os.getpid()
    # The same model without the parameter runs in the server, whatever the server's
    # python_instance_mode.
    answer = client.infer("threaded", mode(module, 0, batched=False))
    assert answer.as_numpy("PID").tolist() == [os.getpid()]
    assert not hasattr(server.repository.get("threaded").model, "instance_pids")
    client.close()


@pytest.mark.parametrize("module", CLIENTS, ids=IDS)
def test_a_dying_instance_fails_only_its_request_and_starts_again(
    server: Server, module: Any
) -> None:
    client = client_of(server, module)
    before = pids(server, "crashy")
    failed_before = failures(client, "crashy")
    with pytest.raises(InferenceServerException) as raised:
        client.infer("crashy", mode(module, 2))
    assert "model 'crashy' instance 'crashy_" in str(raised.value)
    assert "its process exited with status 3" in str(raised.value)
    # The other instance served meanwhile; the dead one serves again once restarted.
    assert {answered_pid(client, module) for _ in range(6)} <= set(pids(server, "crashy"))
    # One process that served before is gone (an instance of the test before may have
    # been starting again then: its pid None).
    serving = {pid for pid in before if pid is not None}
    assert len(serving - set(pids(server, "crashy"))) == 1
    assert failures(client, "crashy") == failed_before + 1
    client.close()


@pytest.mark.parametrize(
    ("module", "status"),
    [(httpclient, "400"), (grpcclient, "StatusCode.INVALID_ARGUMENT")],
    ids=IDS,
)
def test_an_error_for_one_request_of_a_batch_keeps_its_status(
    server: Server, module: Any, status: str
) -> None:
    def infer(value: int) -> Any:
        client = client_of(server, module)
        try:
            return client.infer("batched", mode(module, value))
        except InferenceServerException as exc:
            return exc
        finally:
            client.close()

    # Two requests make a batch at once (the preferred size); alone, either would wait
    # the queue delay (20 s) and then run in a batch of one.
    with ThreadPoolExecutor(2) as pool:
        refused, answered = pool.map(infer, [4, 0])
    assert isinstance(refused, InferenceServerException)
    assert refused.status() == status
    assert "mode 4 is refused" in str(refused)
    assert answered.as_numpy("BATCH").tolist() == [[2]]
    assert answered.as_numpy("PID").tolist() == [pids(server, "batched")]


@pytest.mark.parametrize(
    ("module", "status"), [(httpclient, "500"), (grpcclient, "StatusCode.INTERNAL")], ids=IDS
)
def test_an_exception_in_execute_fails_its_batch(server: Server, module: Any, status: str) -> None:
    client = client_of(server, module)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("crashy", mode(module, 5))
    assert raised.value.status() == status
    assert "model 'crashy' failed: mode 5 in " in str(raised.value)
    assert f"mode 5 in {os.getpid()}" not in str(raised.value)  # not the server's process
    client.close()


def test_a_gpu_models_instances_see_the_device_of_its_config(server: Server) -> None:
    client = client_of(server, httpclient)
    assert client.infer("device", mode(httpclient, 0, batched=False)).as_numpy("V").tolist() == [
        b"0"
    ]
    (group,) = client.get_model_config("device")["instance_group"]
    assert (group["kind"], group["gpus"]) == ("KIND_GPU", [0])
    client.close()


def test_a_client_system_shm_input_reaches_the_model(server: Server) -> None:
    client = client_of(server, httpclient)
    data = np.arange(1000, dtype=np.float32)
    key = f"/trioserve-own-{os.getpid()}"
    region = shm.create_shared_memory_region("own_input", key, data.nbytes)
    try:
        shm.set_shared_memory_region(region, [data])
        client.register_system_shared_memory("own_input", key, data.nbytes)
        tensor = httpclient.InferInput("X", [1000], "FP32")
        tensor.set_shared_memory("own_input", data.nbytes)
        answer = client.infer("summed", [tensor])
        assert answer.as_numpy("SUM").tolist() == [float(data.sum())]
        assert answer.as_numpy("PID").tolist() == pids(server, "summed")
        client.unregister_system_shared_memory("own_input")
    finally:
        shm.destroy_shared_memory_region(region)
        client.close()


def test_a_decoupled_model_streams_from_its_process(server: Server) -> None:
    client = client_of(server, grpcclient)
    replies: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put(error or result))
    count = grpcclient.InferInput("COUNT", [1], "INT32")
    count.set_data_from_numpy(np.array([3], np.int32))
    client.async_stream_infer("streamed", [count], enable_empty_final_response=True)
    received = [replies.get(timeout=20) for _ in range(4)]
    client.stop_stream()
    client.close()
    answers = [r.as_numpy("INDEX").tolist() for r in received[:3]]
    assert answers == [[0], [1], [2]]
    assert {r.as_numpy("PID")[0] for r in received[:3]} == set(pids(server, "streamed"))
    final = received[3].get_response()
    assert final.parameters["triton_final_response"].bool_param and not final.outputs


def test_load_and_unload_run_in_the_process(tmp_path: Path) -> None:
    folder = write(tmp_path, "loaded", ASYNC, PARAMETERS=PROCESS)
    with server_in_thread(process_config(tmp_path, restart_limit=100)) as running:
        (pid,) = pids(running, "loaded")
    assert (folder / "unloaded").read_text() == str(pid)


def test_a_failing_load_fails_the_model_with_its_error(tmp_path: Path) -> None:
    code = ASYNC.replace(
        "self.loaded_in = os.getpid()", "raise RuntimeError(f'no weights in {os.getpid()}')"
    )
    write(tmp_path, "loaded", code, PARAMETERS=PROCESS)
    with server_in_thread(process_config(tmp_path, restart_limit=100)) as running:
        client = client_of(running, httpclient)
        (entry,) = client.get_model_repository_index()
        assert entry["state"] == "UNAVAILABLE"
        assert "model 'loaded' failed in load: RuntimeError: no weights in " in entry["reason"]
        assert f"no weights in {os.getpid()}" not in entry["reason"]  # not in the server
        client.close()


def test_one_that_keeps_dying_is_unavailable(tmp_path: Path) -> None:
    write(tmp_path, "fragile", CRASHY, INSTANCES=1, DELAY=0)
    with server_in_thread(process_config(tmp_path, restart_limit=2)) as running:
        client = client_of(running, httpclient)
        assert os.getpid() not in pids(running, "fragile")  # its exit ends no test run
        with pytest.raises(InferenceServerException, match="exited with status 3"):
            client.infer("fragile", mode(httpclient, 2))
        # Restarted: the next request waits for the new process.
        assert answered_pid(client, httpclient, "fragile") == pids(running, "fragile")[0]
        with pytest.raises(InferenceServerException, match="exited with status 3"):
            client.infer("fragile", mode(httpclient, 2))
        with pytest.raises(InferenceServerException, match="'fragile' is unavailable"):
            client.infer("fragile", mode(httpclient, 0))
        (entry,) = client.get_model_repository_index()
        assert entry["state"] == "UNAVAILABLE"
        assert "'fragile_0' ended 2 times within 60 s" in entry["reason"]
        client.close()


OPTED_IN = "'TRIOSERVE_INSTANCE_MODE': 'process'"
REFUSED = [
    (
        "sequence_batching=trioserve.SequenceBatching(controls=["
        "trioserve.SequenceControl('START', 'START')]), "
        f"parameters={{{OPTED_IN}}}",
        "the sequence batcher",
    ),
    (f"parameters={{{OPTED_IN}, 'EXECUTION_ENV_PATH': 'env'}}", "EXECUTION_ENV_PATH"),
]


@pytest.mark.parametrize(("setting", "feature"), REFUSED, ids=["sequences", "env"])
def test_features_that_cannot_cross_fail_the_load(
    tmp_path: Path, setting: str, feature: str
) -> None:
    code = (
        f"import trioserve\nmodel = trioserve.Model(name='m', inputs=[], outputs=[], {setting})\n"
    )
    write(tmp_path, "refused", code)
    with server_in_thread(ServerConfig(model_repositories=[tmp_path], http_port=0)) as running:
        client = client_of(running, httpclient)
        (entry,) = client.get_model_repository_index()
        assert entry["state"] == "UNAVAILABLE"
        assert f"model 'refused': {feature}" in entry["reason"]
        assert "cannot be used with TRIOSERVE_INSTANCE_MODE 'process'" in entry["reason"]
        client.close()


def test_withdraw_cancels_execution_fails_the_load(tmp_path: Path) -> None:
    code = """
    import trioserve

    class Cancellable(trioserve.Model):
        withdraw_cancels_execution = True

        async def execute(self, requests):
            return [{} for _ in requests]

    model = Cancellable(name="m", inputs=[], outputs=[],
                        parameters={"TRIOSERVE_INSTANCE_MODE": "process"})
    """
    write(tmp_path, "refused", code)
    with server_in_thread(ServerConfig(model_repositories=[tmp_path], http_port=0)) as running:
        client = client_of(running, httpclient)
        (entry,) = client.get_model_repository_index()
        assert "model 'refused': withdraw_cancels_execution cannot be used" in entry["reason"]
        client.close()


def test_the_models_own_memory_and_unavailability_come_from_its_processes(
    tmp_path: Path,
) -> None:
    write(tmp_path, "reporting", REPORTING)
    with server_in_thread(process_config(tmp_path, restart_limit=100)) as running:
        client = client_of(running, httpclient)
        [stats] = client.get_inference_statistics("reporting")["model_stats"]
        # Two processes, each holding its own copy.
        assert stats["memory_usage"] == [{"type": "CPU", "id": 0, "byte_size": 2000}]
        assert client.is_model_ready("reporting")
        answer = client.infer("reporting", mode(httpclient, 9, batched=False))
        pid = int(answer.as_numpy("PID")[0])
        assert pid in pids(running, "reporting") and pid != os.getpid()
        # Said in the process before its answer: the server knows it already.
        assert not client.is_model_ready("reporting")
        (entry,) = client.get_model_repository_index()
        assert entry["state"] == "UNAVAILABLE"
        assert entry["reason"] == f"taken out of service in {pid}"
        client.close()
