"""CUDA shared memory on a real GPU: skipped without cupy and a device.

A CUDA IPC handle cannot be opened by the process that made it, so the client here is a
second Python process that allocates device memory with cupy, prints the handles, and
reads its output region back when told to.
"""

from __future__ import annotations

import base64
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient

import trioserve
from trioserve import Server, ServerConfig
from trioserve.models import reference_zoo
from trioserve.shm._cuda import cuda_unavailable_reason
from trioserve.testing import server_in_thread

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        cuda_unavailable_reason() is not None, reason=str(cuda_unavailable_reason())
    ),
]

COUNT = 256
CLIENT = textwrap.dedent(
    f"""
    import base64, sys
    import cupy, numpy as np
    runtime = cupy.cuda.runtime
    size = {COUNT} * 4
    pointers = [runtime.malloc(size), runtime.malloc(size)]  # not pooled: own allocations
    values = np.arange({COUNT}, dtype=np.float32)
    runtime.memcpy(pointers[0], values.ctypes.data, size, runtime.memcpyHostToDevice)
    runtime.memset(pointers[1], 0, size)
    for pointer in pointers:
        print(base64.b64encode(runtime.ipcGetMemHandle(pointer)).decode(), flush=True)
    sys.stdin.readline()
    out = np.empty({COUNT}, dtype=np.float32)
    runtime.memcpy(out.ctypes.data, pointers[1], size, runtime.memcpyDeviceToHost)
    print(" ".join(str(v) for v in out.tolist()), flush=True)
    sys.stdin.readline()
    """
)


@pytest.fixture(scope="module")
def server(double_gpu: trioserve.Model) -> Iterator[Server]:
    models = [*reference_zoo(), double_gpu]
    with server_in_thread(ServerConfig(models=models, http_port=0, grpc_port=0)) as running:
        yield running


@pytest.fixture
def device_client() -> Iterator[tuple[subprocess.Popen[str], list[bytes]]]:
    with subprocess.Popen(
        [sys.executable, "-c", CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout is not None
        handles = [process.stdout.readline().strip().encode() for _ in range(2)]
        yield process, handles
        process.kill()


def _read_output(process: subprocess.Popen[str]) -> np.ndarray:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("\n")
    process.stdin.flush()
    return np.array([float(v) for v in process.stdout.readline().split()], dtype=np.float32)


@pytest.mark.parametrize("model", ["identity_fp32", "double_gpu"])
def test_cuda_regions_end_to_end(server, device_client, model):
    process, (in_handle, out_handle) = device_client
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    assert "cuda_shared_memory" in client.get_server_metadata()["extensions"]
    size = COUNT * 4
    client.register_cuda_shared_memory("cuda_in", in_handle, 0, size)
    client.register_cuda_shared_memory("cuda_out", out_handle, 0, size)
    assert client.get_cuda_shared_memory_status("cuda_in") == [
        {"name": "cuda_in", "device_id": 0, "byte_size": size}
    ]
    tensor = httpclient.InferInput("INPUT0", [COUNT], "FP32")
    tensor.set_shared_memory("cuda_in", size)
    output = httpclient.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("cuda_out", size)
    client.infer(model, [tensor], outputs=[output])
    expected = np.arange(COUNT, dtype=np.float32) * (2 if model == "double_gpu" else 1)
    np.testing.assert_array_equal(_read_output(process), expected)
    client.unregister_cuda_shared_memory()
    assert client.get_cuda_shared_memory_status() == []
    client.close()


def test_bad_cuda_handle_is_refused(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    with pytest.raises(Exception, match="failed to register CUDA shared memory region"):
        client.register_cuda_shared_memory("junk", base64.b64encode(b"\1" * 64), 0, 64)
    with pytest.raises(Exception, match="64-byte"):
        client.register_cuda_shared_memory("short", base64.b64encode(b"\1" * 8), 0, 64)
    assert client.is_server_live()
    client.close()
