"""A worker's input blocks: binary bodies received into its arena, the parts of them the
core reads in place, and inputs that answers read where the worker wrote them; each
freed once its last holder is done, in whichever order they finish (a real arena), and
through a real server, outputs that are an input, a slice of one, or new."""

from __future__ import annotations

import gc
import json
import os
import socket
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2

from trioserve.ipc import Arena
from trioserve.workers._input_blocks import InputBlocks

from ._served import TIMEOUT, Served

MiB = 1024 * 1024


async def settle() -> None:
    """Let the event loop run what a collected body scheduled (its block let go of)."""
    gc.collect()
    await trio.testing.wait_all_tasks_blocked()


@pytest.fixture
def arena() -> Arena:
    return Arena(4 * MiB, 4 * MiB)


@pytest.fixture
async def blocks(arena: Arena) -> InputBlocks:
    return InputBlocks(arena)  # in the event loop: it lets go of bodies through it


def body(blocks: InputBlocks) -> memoryview:
    view = blocks.buffer(MiB)
    assert view is not None and len(view) == MiB and not view.readonly
    return view


async def test_a_body_is_freed_once_the_request_and_every_part_are_done(
    arena: Arena, blocks: InputBlocks
) -> None:
    view = body(blocks)
    view[:] = bytes(range(256)) * 4096
    first, second = view[100 : 100 + 65536], view[200_000:300_000]
    part, other = blocks.part(first), blocks.part(second)
    assert part is not None and other is not None
    assert bytes(arena.view(part)) == bytes(first)  # the core reads these very bytes
    assert part.size == 65536 and other.size == 100_000
    del first, second, view  # the request is done with its body
    await settle()
    assert arena.in_use() >= MiB  # the core still reads two parts
    blocks.free(part)
    assert arena.in_use() >= MiB
    blocks.free(other)
    assert arena.in_use() == 0


async def test_parts_freed_before_the_request_is_done(arena: Arena, blocks: InputBlocks) -> None:
    view = body(blocks)
    part = blocks.part(view[:100_000])
    assert part is not None
    blocks.free(part)
    assert arena.in_use() >= MiB  # the request still holds its body
    del view
    await settle()
    assert arena.in_use() == 0


async def test_data_outside_every_body_is_no_part(blocks: InputBlocks) -> None:
    assert blocks.part(bytes(100_000)) is None  # no body at all
    view = body(blocks)
    assert blocks.part(bytearray(100_000)) is None
    assert blocks.part(view[MiB - 10 :]) is not None  # the very end is inside


async def test_a_full_arena_gives_no_buffer() -> None:
    assert InputBlocks(Arena(MiB, MiB, max_bytes=MiB)).buffer(2 * MiB) is None


@pytest.mark.parametrize("core_frees_first", [True, False])
async def test_an_input_an_answer_reads_outlives_the_cores_free(
    arena: Arena, blocks: InputBlocks, core_frees_first: bool
) -> None:
    block = arena.write(b"x" * 100_000)  # an input the worker packed
    blocks.read_by_answer(block)
    blocks.read_by_answer(block)  # two outputs are that input
    if core_frees_first:
        blocks.free(block)
        blocks.answer_done(block)
        assert arena.in_use() > 0  # one answer still reads it
        blocks.answer_done(block)
    else:
        blocks.answer_done(block)
        blocks.answer_done(block)
        assert arena.in_use() > 0  # the core still reads it
        blocks.free(block)
    assert arena.in_use() == 0


async def test_a_body_part_an_answer_reads_outlives_its_free(
    arena: Arena, blocks: InputBlocks
) -> None:
    view = body(blocks)
    part = blocks.part(view[1000:200_000])
    assert part is not None
    del view
    await settle()
    blocks.read_by_answer(part)
    blocks.free(part)  # the core is done with it; the answer is not
    assert arena.in_use() >= MiB
    blocks.answer_done(part)
    assert arena.in_use() == 0


# Answers with its input, a slice of it that starts 4 bytes in (not aligned as the
# block is), and a new array: the first two are read by the worker where it wrote them.
VIEWS = """
import numpy as np
import trioserve

class Views(trioserve.Model):
    def execute(self, requests):
        results = []
        for request in requests:
            data = request.inputs["INPUT"].data
            results.append({"SAME": data, "TAIL": data[:, 1:], "DOUBLE": data * 2})
        return results

model = Views(
    name="views",
    inputs=[trioserve.TensorSpec("INPUT", "FP32", [-1])],
    outputs=[
        trioserve.TensorSpec("SAME", "FP32", [-1]),
        trioserve.TensorSpec("TAIL", "FP32", [-1]),
        trioserve.TensorSpec("DOUBLE", "FP32", [-1]),
    ],
    max_batch_size=4,
)
"""


# Two inputs, for a request that sends one in system shared memory, one in its body.
SUM = """
import trioserve

class Sum(trioserve.Model):
    def execute(self, requests):
        return [{"SUM": r.inputs["A"].data + r.inputs["B"].data} for r in requests]

model = Sum(
    name="sum",
    inputs=[trioserve.TensorSpec("A", "FP32", [-1]), trioserve.TensorSpec("B", "FP32", [-1])],
    outputs=[trioserve.TensorSpec("SUM", "FP32", [-1])],
)
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    for name, code in (("views", VIEWS), ("sum", SUM)):
        (root / name).mkdir()
        (root / name / "model.py").write_text(textwrap.dedent(code))
    return root


@pytest.fixture(scope="module")
def served(repository: Path) -> Iterator[Served]:
    server = Served("--model-repository", str(repository), workers=1)
    try:
        yield server
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    ("module", "binary"), [(httpclient, True), (httpclient, False), (grpcclient, False)]
)
def test_outputs_that_are_inputs_come_back_right(served: Served, module: Any, binary: bool) -> None:
    url = served.url if module is httpclient else served.grpc_url
    options = {"binary_data": binary} if module is httpclient else {}
    with module.InferenceServerClient(url) as client:
        for size in (20_000, 300_000):  # below and above a block's threshold
            data = np.random.default_rng(size).random((1, size), dtype=np.float32)
            tensor = module.InferInput("INPUT", [1, size], "FP32")
            tensor.set_data_from_numpy(data, **options)
            outputs = [
                module.InferRequestedOutput(n, **options) for n in ("SAME", "TAIL", "DOUBLE")
            ]
            for _ in range(3):  # the blocks are reused: each answer reads its own
                answer = client.infer("views", [tensor], outputs=outputs)
                np.testing.assert_array_equal(answer.as_numpy("SAME"), data)
                np.testing.assert_array_equal(answer.as_numpy("TAIL"), data[:, 1:])
                np.testing.assert_array_equal(answer.as_numpy("DOUBLE"), data * 2)


def test_a_raw_binary_body_received_into_the_arena_goes_the_generic_way(served: Served) -> None:
    """A body of one raw tensor (header length 0) means what the model says: the core
    reads it, from the worker's arena where it was received."""
    data = np.arange(100_000, dtype=np.float32)
    answer = httpx.post(
        f"http://{served.url}/v2/models/views/infer",
        content=data.tobytes(),
        headers={"Inference-Header-Content-Length": "0"},
        timeout=TIMEOUT,
    )
    assert answer.status_code == 200, answer.text
    length = int(answer.headers["inference-header-content-length"])
    header = json.loads(answer.content[:length])
    sizes = [output["parameters"]["binary_data_size"] for output in header["outputs"]]
    offsets = np.cumsum([length, *sizes])
    outputs = {
        output["name"]: np.frombuffer(answer.content[start:end], np.float32)
        for output, start, end in zip(header["outputs"], offsets[:-1], offsets[1:], strict=True)
    }
    np.testing.assert_array_equal(outputs["SAME"], data)
    np.testing.assert_array_equal(outputs["TAIL"], data[1:])


def test_a_body_with_a_tensor_in_shared_memory_goes_the_generic_way(served: Served) -> None:
    """The shared-memory registry is the core's: a large binary body that names a region
    is read there, from the worker's arena where it was received."""
    a = np.arange(100_000, dtype=np.float32)
    b = np.full(100_000, 0.5, dtype=np.float32)
    key = f"/input-blocks-{os.getpid()}"
    region = shm.create_shared_memory_region("a", key, a.nbytes)
    try:
        shm.set_shared_memory_region(region, [a])
        with httpclient.InferenceServerClient(served.url) as client:
            client.register_system_shared_memory("a", key, a.nbytes)
            try:
                first = httpclient.InferInput("A", [100_000], "FP32")
                first.set_shared_memory("a", a.nbytes)
                second = httpclient.InferInput("B", [100_000], "FP32")
                second.set_data_from_numpy(b, binary_data=True)
                output = httpclient.InferRequestedOutput("SUM", binary_data=True)
                answer = client.infer("sum", [first, second], outputs=[output])
            finally:
                client.unregister_system_shared_memory("a")
        np.testing.assert_array_equal(answer.as_numpy("SUM"), a + b)
    finally:
        shm.destroy_shared_memory_region(region)


def _resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_bodies_cut_short_give_their_blocks_back(served: Served) -> None:
    """A client that stops part way through a binary body received into the arena gets
    a 400, and the block goes back: 32 bodies cut after 4 of their 8 MiB would grow the
    worker by 128 MiB if they were kept."""
    header = json.dumps(
        {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 2 * MiB],
                     "parameters": {"binary_data_size": 8 * MiB}}]}
    ).encode()  # fmt: skip
    head = (
        f"POST /v2/models/views/infer HTTP/1.1\r\nhost: t\r\n"
        f"inference-header-content-length: {len(header)}\r\n"
        f"content-length: {len(header) + 8 * MiB}\r\n\r\n"
    ).encode()

    def cut_short() -> bytes:
        with socket.create_connection(("127.0.0.1", served.http)) as sock:
            sock.settimeout(TIMEOUT)
            sock.sendall(head + header + bytes(4 * MiB))
            sock.shutdown(socket.SHUT_WR)
            answer = b""
            while piece := sock.recv(65536):
                answer += piece
        return answer

    assert cut_short().startswith(b"HTTP/1.1 400 ")  # the arena's first segments too
    [worker] = served.worker_pids()
    before = _resident_bytes(worker)
    for _ in range(32):
        assert b"the client ended the request body" in cut_short()
    grown = _resident_bytes(worker) - before
    assert grown < 48 * MiB, f"the worker grew by {grown / MiB:.0f} MiB"
    data = np.arange(100_000, dtype=np.float32).reshape(1, -1)  # and serves on
    with httpclient.InferenceServerClient(served.url) as client:
        tensor = httpclient.InferInput("INPUT", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data, binary_data=True)
        answer = client.infer("views", [tensor])
    np.testing.assert_array_equal(answer.as_numpy("SAME"), data)


@pytest.mark.parametrize("method", ["ModelInfer", "ModelStreamInfer"])
def test_a_grpc_client_that_leaves_mid_reply_leaves_the_worker_serving(
    repository: Path, method: str
) -> None:
    """The reply's outputs are read where they lie; a client that resets the call while
    the reply waits for its window must not give those blocks back a second time (the
    reply's arrays give them back once the HTTP/2 core lets go of them): a worker that
    did would end, however soon after, and the server would not stop cleanly. Nor is the
    client's leaving a failure of the server's, logged as one."""
    served = Served("--model-repository", str(repository), workers=1)
    try:
        _leave_mid_reply(served, method)
    finally:
        assert served.stop() == 0
    assert not any("exited with status" in line for line in served.log)
    assert not [line for line in served.log if " ERROR " in line], "".join(served.log)


def _leave_mid_reply(served: Served, method: str) -> None:
    size = 300_000
    request = service_pb2.ModelInferRequest(model_name="views")
    request.inputs.add(name="INPUT", datatype="FP32", shape=[1, size])
    request.raw_input_contents.append(np.arange(size, dtype=np.float32).tobytes())
    message = request.SerializeToString()
    body = b"\0" + len(message).to_bytes(4, "big") + message
    [worker] = served.worker_pids()
    # The client's initial window (65,535 bytes), never opened further: the reply stops.
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    with socket.create_connection(("127.0.0.1", served.grpc)) as sock:
        sock.settimeout(TIMEOUT)
        conn.send_headers(1, [
            (":method", "POST"), (":scheme", "http"), (":authority", "test"),
            (":path", f"/inference.GRPCInferenceService/{method}"),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ])  # fmt: skip
        sent = 0
        replied = 0
        while replied == 0:
            room = min(conn.local_flow_control_window(1), conn.max_outbound_frame_size)
            if sent < len(body) and room:
                piece = body[sent : sent + room]
                sent += len(piece)
                conn.send_data(1, piece, end_stream=sent == len(body))
            sock.sendall(conn.data_to_send())
            if sent < len(body) and conn.local_flow_control_window(1):
                continue
            for event in conn.receive_data(sock.recv(65536)):
                if isinstance(event, h2.events.DataReceived):
                    replied += len(event.data)  # the reply has begun: its outputs are taken
                assert not isinstance(event, h2.events.StreamReset), "the call failed"
        conn.reset_stream(1)
        sock.sendall(conn.data_to_send())
    for _ in range(3):  # the worker serves on, and the same one does
        with grpcclient.InferenceServerClient(served.grpc_url) as client:
            tensor = grpcclient.InferInput("INPUT", [1, size], "FP32")
            tensor.set_data_from_numpy(np.ones((1, size), np.float32))
            assert client.infer("views", [tensor]).as_numpy("SAME").sum() == size
    assert served.worker_pids() == [worker]
