"""ONNX Runtime models: served with no config.pbtxt, the config auto-completed from the graph."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from trioserve import ServerConfig
from trioserve.testing import server_in_thread

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402


def write_add_model(write_onnx, path: Path, batch: str | int) -> None:
    """Z = X + Y over FP32 [batch, 3]."""
    shape = [batch, 3]
    float_tensor = (TensorProto.FLOAT, shape)
    write_onnx(
        path,
        [helper.make_node("Add", ["X", "Y"], ["Z"])],
        [("X", *float_tensor), ("Y", *float_tensor)],
        [("Z", *float_tensor)],
    )


@pytest.mark.parametrize(("batch", "max_batch_size", "dims"), [("N", 4, [3]), (2, 0, [2, 3])])
def test_onnx_model_without_config(write_onnx, tmp_path: Path, batch, max_batch_size, dims) -> None:
    write_add_model(write_onnx, tmp_path / "add" / "1" / "model.onnx", batch)
    config = ServerConfig(model_repositories=[tmp_path], http_port=0, grpc_port=None)
    with server_in_thread(config) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        described = client.get_model_config("add")
        assert described["platform"] == "onnxruntime_onnx"
        assert described["backend"] == "onnxruntime"
        assert described["max_batch_size"] == max_batch_size
        assert ("dynamic_batching" in described) == (max_batch_size > 0)
        assert [(t["name"], t["data_type"], t["dims"]) for t in described["input"]] == [
            ("X", "TYPE_FP32", dims),
            ("Y", "TYPE_FP32", dims),
        ]
        assert [(t["name"], t["dims"]) for t in described["output"]] == [("Z", dims)]
        assert client.get_model_metadata("add")["platform"] == "onnxruntime_onnx"
        inputs = []
        for name, value in (("X", 1.5), ("Y", 2.0)):
            tensor = httpclient.InferInput(name, [2, 3], "FP32")
            tensor.set_data_from_numpy(np.full((2, 3), value, np.float32))
            inputs.append(tensor)
        assert client.infer("add", inputs).as_numpy("Z").tolist() == [[3.5] * 3] * 2
        client.close()


def test_auto_complete_fills_only_what_the_config_leaves_empty(write_onnx, tmp_path: Path) -> None:
    """Triton's rules: a batching model keeps the config's max_batch_size and gets the
    dynamic batcher above 1; a list of inputs or outputs the config gives stays as given."""
    configs = {
        "eight": "max_batch_size: 8",
        "one": "max_batch_size: 1",
        "outputs_given": 'output { name: "Z" data_type: TYPE_FP32 dims: [3] }',
    }
    for name, text in configs.items():
        write_add_model(write_onnx, tmp_path / name / "1" / "model.onnx", "N")
        (tmp_path / name / "config.pbtxt").write_text(text + "\n")
    config = ServerConfig(model_repositories=[tmp_path], http_port=0, grpc_port=None)
    with server_in_thread(config) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        described = {name: client.get_model_config(name) for name in configs}
        client.close()
    assert (described["eight"]["max_batch_size"], "dynamic_batching" in described["eight"]) == (
        8,
        True,
    )
    assert (described["one"]["max_batch_size"], "dynamic_batching" in described["one"]) == (
        1,
        False,
    )
    given = described["outputs_given"]
    assert given["max_batch_size"] == 4
    assert [(t["name"], t["dims"]) for t in given["input"]] == [("X", [3]), ("Y", [3])]
    assert [(t["name"], t["dims"]) for t in given["output"]] == [("Z", [3])]


def test_default_max_batch_size_comes_from_the_backend_config(write_onnx, tmp_path: Path) -> None:
    write_add_model(write_onnx, tmp_path / "add" / "1" / "model.onnx", "N")
    config = ServerConfig(
        model_repositories=[tmp_path],
        http_port=0,
        grpc_port=None,
        backend_config={"onnxruntime": {"default-max-batch-size": "16"}},
    )
    with server_in_thread(config) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        assert client.get_model_config("add")["max_batch_size"] == 16
        client.close()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"tensorrt": {"x": "1"}}, "backend 'tensorrt'"),
        ({"onnxruntime": {"enable-global-threadpool": "yes"}}, "must be 0 or 1"),
        ({"onnxruntime": {"intra_op_thread_count": "-1"}}, "intra_op_thread_count"),
        ({"onnxruntime": {"no-such-key": "1"}}, "no setting 'no-such-key'"),
    ],
)
def test_a_bad_backend_config_is_refused(setting, message) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(backend_config=setting)


def test_backend_config_flags_are_read_as_triton_writes_them() -> None:
    from trioserve._cli import _parser, config_from_args

    flags = ["--backend-config", "onnxruntime,enable-global-threadpool=1",
             "--backend-config", "onnxruntime,intra_op_thread_count=2"]  # fmt: skip
    config = config_from_args(_parser().parse_args(["run", *flags]))
    assert config.backend_config == {
        "onnxruntime": {"enable-global-threadpool": "1", "intra_op_thread_count": "2"}
    }
    with pytest.raises(ValueError, match="expected BACKEND,KEY=VALUE"):
        config_from_args(_parser().parse_args(["run", "--backend-config", "onnxruntime"]))


# (config.pbtxt lines beside a Z = X + Y model, what the load error names)
REFUSED = {
    "bad_mode": ('parameters { key: "execution_mode" value: { string_value: "7" } }', "execution_mode"),
    "bad_threads": ('parameters { key: "intra_op_thread_count" value: { string_value: "many" } }', "intra_op_thread_count"),
    "bad_arena": ('parameters { key: "enable_mem_arena" value: { string_value: "perhaps" } }', "enable_mem_arena"),
    "bad_level": ("optimization { graph { level: 5 } }", "optimization.graph.level"),
    "openvino": ('optimization { execution_accelerators { cpu_execution_accelerator: [{ name: "openvino" }] } }', "'openvino' needs ONNX Runtime's OpenVINOExecutionProvider"),
    "unknown_cpu": ('optimization { execution_accelerators { cpu_execution_accelerator: [{ name: "dnnl" }] } }', "unknown CPU execution accelerator 'dnnl'"),
    "tensorrt": ('instance_group { kind: KIND_GPU }\noptimization { execution_accelerators { gpu_execution_accelerator: [{ name: "tensorrt" }] } }', "'tensorrt' needs ONNX Runtime's TensorrtExecutionProvider"),
    "gpu": ("instance_group { kind: KIND_GPU }", "KIND_GPU needs ONNX Runtime's CUDAExecutionProvider"),
    "wrong_dims": ('max_batch_size: 4\ninput { name: "X" data_type: TYPE_FP32 dims: [4] }', "input 'X': the model's shape is [3] (batch dimension left out), the config's [4]"),
    "wrong_type": ('max_batch_size: 4\noutput { name: "Z" data_type: TYPE_INT32 dims: [3] }', "output 'Z': the config says TYPE_INT32, the model has tensor(float)"),
    "cannot_batch": ("max_batch_size: 4", "the model cannot batch (not every input and output has a variable first dimension), yet max_batch_size is 4"),
    "not_batching": ('max_batch_size: 4\ninput { name: "X" data_type: TYPE_FP32 dims: [3] }\ninput { name: "Y" data_type: TYPE_FP32 dims: [3] }\noutput { name: "Z" data_type: TYPE_FP32 dims: [3] }', "input 'X': the model's first dimension is 2"),
    "input_left_out": ('input { name: "X" data_type: TYPE_FP32 dims: [-1, 3] }\noutput { name: "Z" data_type: TYPE_FP32 dims: [-1, 3] }', "the model's input 'Y' is not in the config"),
    "no_such_input": ('input { name: "W" data_type: TYPE_FP32 dims: [3] }', "input 'W': the model has no such input"),
}  # fmt: skip
HONOURED = "\n".join(
    [
        'parameters { key: "execution_mode" value: { string_value: "1" } }',
        'parameters { key: "inter_op_thread_count" value: { string_value: "1" } }',
        'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }',
        'parameters { key: "enable_mem_arena" value: { string_value: "1" } }',
        'parameters { key: "enable_mem_pattern" value: { string_value: "false" } }',
        'parameters { key: "memory.enable_memory_arena_shrinkage" value: { string_value: "cpu:0" } }',
        'parameters { key: "session.use_device_allocator_for_initializers" value: { string_value: "1" } }',
        'parameters { key: "share_session_between_instances" value: { string_value: "true" } }',
        "optimization { graph { level: 2 } }",
    ]
)


def test_onnx_parameters_are_honoured_or_refused_by_name(write_onnx, tmp_path: Path) -> None:
    import onnxruntime

    available = onnxruntime.get_available_providers()
    refused = {
        name: case
        for name, case in REFUSED.items()
        if name not in ("gpu", "tensorrt") or "CUDAExecutionProvider" not in available
    }
    for name, (lines, _) in {**refused, "tuned": (HONOURED, "")}.items():
        write_add_model(
            write_onnx, tmp_path / name / "1" / "model.onnx", 2 if "batch" in name else "N"
        )
        (tmp_path / name / "config.pbtxt").write_text(lines + "\n")
    config = ServerConfig(model_repositories=[tmp_path], http_port=0, grpc_port=None)
    with server_in_thread(config) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        index = {entry["name"]: entry for entry in client.get_model_repository_index()}
        for name, (_, message) in refused.items():
            assert index[name]["state"] == "UNAVAILABLE", name
            assert message in index[name]["reason"], (name, index[name]["reason"])
        assert index["tuned"]["state"] == "READY"
        x = httpclient.InferInput("X", [1, 3], "FP32")
        x.set_data_from_numpy(np.ones((1, 3), np.float32))
        y = httpclient.InferInput("Y", [1, 3], "FP32")
        y.set_data_from_numpy(np.full((1, 3), 2, np.float32))
        assert client.infer("tuned", [x, y]).as_numpy("Z").tolist() == [[3.0] * 3]
        client.close()


# Reads, loads and runs each model folder named on the command line in a pool of 8
# threads, the ONNX Runtime backend configured by argv[1] (global thread pools or not).
CONCURRENT_LOADS = """
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from trioserve._backend_config import OnnxRuntimeSettings
from trioserve._served import ModelRepository
from trioserve._types import InferenceRequest, InputTensor
from trioserve.repository import configure_onnxruntime
from trioserve.repository._reading import read_model

configure_onnxruntime(OnnxRuntimeSettings(global_thread_pools=sys.argv[1] == "1"))

def serve(folder):
    [model] = read_model(Path(folder), ModelRepository([]))
    model.load()
    data = np.arange(3, dtype=np.float32).reshape(1, 3)
    tensors = {s.name: InputTensor(s.name, s.wire_datatype, (1, 3), data) for s in model.inputs}
    [outputs] = model.execute([InferenceRequest(Path(folder).name, "1", tensors)])
    return outputs["Z"].reshape(-1).tolist()

with ThreadPoolExecutor(max_workers=8) as pool:
    print(list(pool.map(serve, sys.argv[2:])))
"""


@pytest.mark.parametrize("global_pools", ["0", "1"])
def test_sessions_are_created_in_many_worker_threads_at_once(
    write_onnx, tmp_path: Path, global_pools: str
) -> None:
    """What loading models in parallel does, in a process of its own (ONNX Runtime's
    global thread pools last as long as the process)."""
    folders = [tmp_path / f"add_{index}" for index in range(16)]
    for folder in folders:
        write_add_model(write_onnx, folder / "1" / "model.onnx", "N")
    done = subprocess.run(
        [sys.executable, "-c", CONCURRENT_LOADS, global_pools, *map(str, folders)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([[0.0, 2.0, 4.0]] * len(folders))


TOOL = Path(__file__).resolve().parents[2] / "tools" / "onnx_startup.py"


def test_many_models_share_onnx_runtime_thread_pools(tmp_path: Path) -> None:
    """60 models on the global pools: a handful of threads, not one pool per session."""
    done = subprocess.run(
        [sys.executable, str(TOOL), "--models", "60", "--max-threads", "20",
         "--backend-config", "onnxruntime,enable-global-threadpool=1",
         "--backend-config", "onnxruntime,intra_op_thread_count=2"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("onnx_startup: PASS")


def test_startup_scans_the_repository_once(
    write_onnx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each model's load reuses the startup scan: a scan per model would read n folders
    n times, which a repository of thousands of models notices."""
    from trioserve.repository import _manager

    scans = []

    def counted(folders):
        scans.append(folders)
        return model_folders(folders)

    model_folders = _manager.model_folders
    monkeypatch.setattr(_manager, "model_folders", counted)
    for index in range(5):
        write_add_model(write_onnx, tmp_path / f"add_{index}" / "1" / "model.onnx", "N")
    config = ServerConfig(model_repositories=[tmp_path], http_port=0, grpc_port=None)
    with server_in_thread(config) as server:
        assert sorted(server.repository.names()) == [f"add_{index}" for index in range(5)]
    assert len(scans) == 1
