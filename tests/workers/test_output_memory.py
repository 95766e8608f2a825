"""An answer's outputs over 64 KiB cross from the core to the worker in blocks of the
core's arena; the worker gives each back once its response is encoded, so the core's
memory follows the outputs in flight, not every output ever sent. Inputs go the other
way (a binary REST body is received straight into the worker's arena), and an output
that is its input is read by the worker where it wrote it: the worker's memory follows
the requests in flight too (real processes, tritonclient REST and gRPC)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from ._served import Served

OUTPUT = np.arange(512 * 1024, dtype=np.float32)  # 2 MiB
REQUESTS = 48  # 96 MiB of outputs in all


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    server = Served()
    try:
        yield server
    finally:
        assert server.stop() == 0


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("module", [httpclient, grpcclient])
def test_the_cores_memory_follows_the_outputs_in_flight(served: Served, module: Any) -> None:
    url = served.url if module is httpclient else served.grpc_url
    binary = {"binary_data": True} if module is httpclient else {}
    with module.InferenceServerClient(url) as client:

        def infer() -> None:
            tensor = module.InferInput("INPUT0", [OUTPUT.size], "FP32")
            tensor.set_data_from_numpy(OUTPUT, **binary)
            outputs = [module.InferRequestedOutput("OUTPUT0", **binary)]
            answer = client.infer("identity_fp32", [tensor], outputs=outputs)
            np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), OUTPUT)

        for _ in range(8):  # the arena's first segments, the allocator's warm-up
            infer()
        processes = {"the core": served.process.pid}
        processes.update({f"worker {pid}": pid for pid in served.worker_pids()})
        before = {name: resident_bytes(pid) for name, pid in processes.items()}
        for _ in range(REQUESTS):
            infer()
        grown = {name: resident_bytes(pid) - before[name] for name, pid in processes.items()}
    # Kept blocks would hold all 96 MiB; given back, a few blocks' worth at most.
    for name, size in grown.items():
        assert size < 32 * 1024 * 1024, f"{name} grew by {size / 2**20:.0f} MiB"
