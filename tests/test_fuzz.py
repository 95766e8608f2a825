"""Fuzzing as tests: whatever a client sends, the server answers with a well-formed client
error (or success), never a server error it caused, never a hang, never a logged failure.
Request parameters are fuzzed on every front end of a generative model (OIP over REST and
gRPC, generate, OpenAI) and on tensor and sequence models, the server alive after each.

The properties run against the parsers and decoders alone (many examples, cheap) and against
live servers over real sockets: the built-in HTTP/1.1 server, and both gRPC front ends
through grpcio raw unary calls. The normal test run uses a short, deterministic profile;
``tools/fuzz.py --minutes N`` runs the same properties with many random examples
(``TRIOSERVE_FUZZ_EXAMPLES`` and ``TRIOSERVE_FUZZ_SEED`` select that profile).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import pytest
import trio
import tritonclient.utils.shared_memory as shm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

import trioserve
from trioserve import InferenceServerError, Server, ServerConfig
from trioserve._limits import HttpLimits
from trioserve.grpc._errors import GrpcError, GrpcStatus
from trioserve.grpc._infer_wire import InferPlans, WireRequest
from trioserve.models import TinyLM, reference_zoo
from trioserve.rest._http11_parser import ChunkedDecoder, HttpError, parse_head
from trioserve.rest._infer_codec import decode_request
from trioserve.scheduler import PARAMETERS
from trioserve.shm import RequestRegions, SharedMemoryRegistry
from trioserve.testing import server_in_thread

_LONG_RUN = "TRIOSERVE_FUZZ_EXAMPLES" in os.environ


def fuzz_settings(examples: int) -> settings:
    """``examples`` in the normal run (derandomized, so CI is deterministic); the long run's
    count, with fresh randomness, under ``tools/fuzz.py``."""
    if _LONG_RUN:
        return settings(
            max_examples=int(os.environ["TRIOSERVE_FUZZ_EXAMPLES"]),
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


# --- strategies ----------------------------------------------------------------------

MODELS = ["identity_fp32", "identity_bytes", "simple", "simple_string"]
DATATYPES = ["BOOL", "UINT8", "INT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16"]
REGION = "fuzz_region"  # registered on every fuzzed server, REGION_BYTES long
REGION_BYTES = 64
REGION_KEY = f"/trioserve_fuzz_{os.getpid()}"


def mutated(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """A valid message with a few bytes flipped, spans deleted or inserted, or cut short."""

    @st.composite
    def mutate(draw: Any) -> bytes:
        data = bytearray(draw(valid))
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(data)))
            op = draw(st.sampled_from(["flip", "delete", "insert", "truncate"]))
            if op == "flip" and at < len(data):
                data[at] ^= 1 << draw(st.integers(0, 7))
            elif op == "delete":
                del data[at : at + draw(st.integers(1, 8))]
            elif op == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=8))
            else:
                del data[at:]
        return bytes(data)

    return mutate()


shapes = st.lists(
    st.one_of(st.integers(-2, 20), st.sampled_from([2**31, 2**62, 2**63 - 1, -(2**63)])),
    max_size=4,
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
# Parameters the server acts on (binary data, shared memory, scheduling), with values of
# every kind, the registered region's name among them.
parameter_values = st.one_of(
    json_values, st.sampled_from([REGION, "no_such_region"]), st.integers(-1, 2 * REGION_BYTES)
)
parameters = st.dictionaries(
    st.sampled_from([
        "binary_data_size", "binary_data", "binary_data_output", "shared_memory_region",
        "shared_memory_offset", "shared_memory_byte_size", "classification", "priority",
        "timeout", "sequence_id", "sequence_start", "sequence_end",
    ]) | st.text(max_size=6),
    parameter_values,
    max_size=4,
)  # fmt: skip
json_inputs = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["INPUT0", "INPUT1"]) | st.text(max_size=6),
        "datatype": st.sampled_from(DATATYPES) | st.text(max_size=6),
        "shape": shapes,
    },
    optional={"data": json_values, "parameters": parameters},
)
json_documents = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {},
        optional={
            "id": json_values,
            "inputs": st.lists(json_inputs, max_size=3),
            "outputs": st.lists(
                st.fixed_dictionaries(
                    {"name": st.sampled_from(["OUTPUT0", "OUTPUT1"]) | st.text(max_size=6)},
                    optional={"parameters": parameters},
                ),
                max_size=3,
            ),
            "parameters": parameters,
        },
    ),
)


SPECS = {m.name: m for m in reference_zoo()}
# Elements by datatype: in range, at the edges, out of range, of the wrong kind.
elements = st.one_of(
    st.integers(-129, 256),
    st.sampled_from([2**31, 2**63 - 1, -(2**63), 2**64, 1e39, -0.0, "7", "x", "\\u00e9", True]),
    st.floats(),
)


@st.composite
def near_valid_documents(draw: Any) -> dict[str, Any]:
    """A request for one of ``MODELS`` that is right in all but a few places: it passes
    the early checks and reaches the deeper ones (shapes against data, binary sizes,
    shared-memory offsets, output flags)."""
    model = SPECS[draw(st.sampled_from(MODELS))]
    inputs = []
    for spec in model.inputs:
        count = draw(st.integers(0, 17))
        tensor: dict[str, Any] = {
            "name": spec.name,
            "datatype": draw(st.just(spec.datatype) | st.sampled_from(DATATYPES)),
            "shape": draw(st.just([count]) | st.just([1, count]) | shapes),
        }
        where = draw(st.sampled_from(["data", "binary", "shm"]))
        if where == "data":
            tensor["data"] = draw(st.lists(elements, min_size=count, max_size=count) | json_values)
        elif where == "binary":
            tensor["parameters"] = {"binary_data_size": draw(st.integers(-1, 80))}
        else:
            tensor["parameters"] = {
                "shared_memory_region": draw(st.sampled_from([REGION, "no_such_region"])),
                "shared_memory_byte_size": draw(st.integers(-1, 2 * REGION_BYTES)),
                "shared_memory_offset": draw(st.integers(-1, 2 * REGION_BYTES)),
            }
        inputs.append(tensor)
    document: dict[str, Any] = {"inputs": draw(st.permutations(inputs))}
    if draw(st.booleans()):
        document["outputs"] = [
            {"name": spec.name, "parameters": draw(parameters)} for spec in model.outputs
        ]
    return {"model": model.name, "document": document}


@st.composite
def infer_requests(draw: Any) -> tuple[str, bytes, str | None]:
    """A model name, an inference body and its ``Inference-Header-Content-Length``
    (``None``: absent)."""
    name, document = draw(
        st.tuples(st.sampled_from(MODELS), json_documents)
        | near_valid_documents().map(lambda d: (d["model"], d["document"]))
    )
    header = json.dumps(document).encode()
    if draw(st.booleans()):
        header = draw(mutated(st.just(header)))
    binary = draw(st.binary(max_size=80))
    length = draw(
        st.sampled_from([None, str(len(header)), "0", "-1", "x", str(2**64)])
        | st.integers(0, len(header) + len(binary)).map(str)
    )
    return name, header + (binary if length is not None else b""), length


def http_request(method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


VALID_HTTP = st.sampled_from([
    b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n",
    http_request("POST", "/v2/models/identity_fp32/infer", json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]}).encode(), {}),
    b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: x\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n1f\r\n{\"inputs\": [{\"name\": \"INPUT0\", "
    b"\r\n30\r\n\"datatype\": \"FP32\", \"shape\": [1], \"data\": [3]}]}\r\n0\r\n\r\n",
    http_request("POST", "/v2/models/identity_bytes/infer", b"\x01\x00\x00\x00a",
                 {"Inference-Header-Content-Length": "0"}),
])  # fmt: skip


@st.composite
def http_heads(draw: Any) -> bytes:
    """A request head built from the parts the parser acts on, each possibly malformed."""
    method = draw(st.sampled_from(["GET", "POST", "HEAD", "PUT", "OPTIONS"]) | st.text(max_size=5))
    target = draw(
        st.sampled_from(["/v2", "/v2/models/simple/infer", "*", "/%", "/v2/%2e%2e/x", "//v2"])
        | st.text(max_size=12)
    )
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.1 x"]))
    names = st.sampled_from([
        "Content-Length", "Transfer-Encoding", "Connection", "Expect", "Host",
        "Inference-Header-Content-Length", "Content-Encoding",
    ]) | st.text(max_size=6)  # fmt: skip
    values = st.sampled_from(
        ["0", "5", "-1", "chunked", "gzip, chunked", "close", "100-continue", "1, 1", " 3"]
    ) | st.text(max_size=8)
    fields = draw(st.lists(st.tuples(names, values), max_size=5))
    lines = [f"{method} {target} {version}", *(f"{n}: {v}" for n, v in fields)]
    body = draw(st.binary(max_size=40))
    return "\r\n".join(lines).encode("utf-8", "surrogatepass") + b"\r\n\r\n" + body


http_bytes = st.one_of(st.binary(max_size=200), mutated(VALID_HTTP), http_heads())


@st.composite
def infer_messages(draw: Any) -> pb.ModelInferRequest:
    """A ``ModelInferRequest`` with every field the server reads drawn loosely."""
    message = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(MODELS) | st.text(max_size=6)),
        model_version=draw(st.sampled_from(["", "1", "2"]) | st.text(max_size=3)),
        id=draw(st.text(max_size=6)),
    )
    for _ in range(draw(st.integers(0, 3))):
        tensor = message.inputs.add(
            name=draw(st.sampled_from(["INPUT0", "INPUT1"]) | st.text(max_size=6)),
            datatype=draw(st.sampled_from(DATATYPES) | st.text(max_size=6)),
            shape=draw(shapes),
        )
        _fill_parameters(draw, tensor.parameters)
        contents = draw(st.sampled_from([None, "fp32", "int", "int64", "bytes", "bool"]))
        if contents == "fp32":
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=4)))
        elif contents == "int":
            tensor.contents.int_contents.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4)))  # fmt: skip
        elif contents == "int64":
            tensor.contents.int64_contents.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)))  # fmt: skip
        elif contents == "bytes":
            tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=6), max_size=4)))  # fmt: skip
        elif contents == "bool":
            tensor.contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=4)))
    for _ in range(draw(st.integers(0, 2))):
        output = message.outputs.add(name=draw(st.sampled_from(["OUTPUT0", "OUTPUT1"]) | st.text(max_size=6)))  # fmt: skip
        _fill_parameters(draw, output.parameters)
    _fill_parameters(draw, message.parameters)
    message.raw_input_contents.extend(draw(st.lists(st.binary(max_size=70), max_size=3)))
    return message


ITEM_BYTES = {"BOOL": 1, "UINT8": 1, "INT8": 1, "INT32": 4, "INT64": 8, "FP16": 2, "FP32": 4,
              "FP64": 8, "BF16": 2}  # fmt: skip


@st.composite
def near_valid_messages(draw: Any) -> pb.ModelInferRequest:
    """A ``ModelInferRequest`` for one of ``MODELS`` that is right in all but a few places
    (raw sizes, shapes, shared-memory offsets), as ``near_valid_documents`` for REST."""
    model = SPECS[draw(st.sampled_from(MODELS))]
    message = pb.ModelInferRequest(model_name=model.name)
    for spec in model.inputs:
        count = draw(st.integers(0, 17))
        dt = draw(st.just(spec.datatype) | st.sampled_from(DATATYPES))
        tensor = message.inputs.add(name=spec.name, datatype=dt, shape=draw(st.just([count]) | shapes))  # fmt: skip
        where = draw(st.sampled_from(["raw", "shm"]))
        if where == "raw" and dt == "BYTES":
            items = draw(st.lists(st.binary(max_size=4), min_size=count, max_size=count))
            raw = b"".join(len(i).to_bytes(4, "little") + i for i in items)
            message.raw_input_contents.append(draw(st.just(raw) | mutated(st.just(raw))))
        elif where == "raw":
            size = count * ITEM_BYTES.get(dt, 1) + draw(st.sampled_from([0, 0, -1, 1]))
            message.raw_input_contents.append(draw(st.binary(min_size=max(size, 0), max_size=max(size, 0))))  # fmt: skip
        else:
            tensor.parameters["shared_memory_region"].string_param = draw(st.sampled_from([REGION, "no_such_region"]))  # fmt: skip
            tensor.parameters["shared_memory_byte_size"].int64_param = draw(st.integers(-1, 2 * REGION_BYTES))  # fmt: skip
            tensor.parameters["shared_memory_offset"].int64_param = draw(st.integers(-1, 2 * REGION_BYTES))  # fmt: skip
    for spec in model.outputs:
        if draw(st.booleans()):
            _fill_parameters(draw, message.outputs.add(name=spec.name).parameters)
    return message


def _fill_parameters(draw: Any, target: Any) -> None:
    for key, value in draw(parameters).items():
        kind = draw(st.sampled_from(["bool", "int64", "string", "double", "uint64"]))
        if kind == "bool":
            target[key].bool_param = bool(value)
        elif kind == "int64":
            target[key].int64_param = draw(st.integers(-(2**63), 2**63 - 1))
        elif kind == "uint64":
            target[key].uint64_param = draw(st.integers(0, 2**64 - 1))
        elif kind == "double":
            target[key].double_param = draw(st.floats())
        else:
            target[key].string_param = value if isinstance(value, str) else json.dumps(value)


grpc_messages = (infer_messages() | near_valid_messages()).map(lambda m: m.SerializeToString())
grpc_payloads = st.one_of(st.binary(max_size=120), grpc_messages, mutated(grpc_messages))


# --- the servers ---------------------------------------------------------------------


class ErrorRecords(logging.Handler):
    """Every ERROR record any logger emits while installed (the servers run in threads of
    this process, so their records arrive here)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def take(self) -> list[str]:
        taken, self.records = self.records, []
        return [f"{r.name}: {r.getMessage()}" for r in taken]


@pytest.fixture(scope="module")
def error_records() -> Iterator[ErrorRecords]:
    handler = ErrorRecords()
    logging.getLogger().addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger().removeHandler(handler)


@pytest.fixture(scope="module")
def servers(error_records: ErrorRecords) -> Iterator[dict[str, Server]]:
    """The zoo on the built-in HTTP server, once per gRPC front end, each with ``REGION``
    registered."""
    key = REGION_KEY
    handle = shm.create_shared_memory_region(REGION, key, REGION_BYTES)
    try:
        with (
            server_in_thread(ServerConfig(models=reference_zoo(), http_port=0, grpc_port=0,
                                          grpc_server="trio")) as trio_front,
            server_in_thread(ServerConfig(models=reference_zoo(), http_port=0, grpc_port=0,
                                          grpc_server="grpclib")) as grpclib_front,
        ):  # fmt: skip
            running = {"trio": trio_front, "grpclib": grpclib_front}
            for server in running.values():
                url = f"http://127.0.0.1:{server.http_port}/v2/systemsharedmemory/region/{REGION}/register"
                body = {"key": key, "offset": 0, "byte_size": REGION_BYTES}
                httpx.post(url, json=body).raise_for_status()
            yield running
    finally:
        shm.destroy_shared_memory_region(handle)


# --- properties: parsers and decoders alone -------------------------------------------

LIMITS = HttpLimits()
_E = TypeVar("_E", bound=BaseException)


def refusal(expected: type[_E], call: Callable[[], object]) -> _E | None:
    """The ``expected`` error ``call`` raised, if any (any other error propagates)."""
    try:
        call()
    except expected as exc:
        return exc
    return None


@fuzz_settings(300)
@given(http_bytes)
def test_http_head_parser(data: bytes) -> None:
    end = data.find(b"\r\n\r\n")
    error = refusal(HttpError, lambda: parse_head(data, 0, len(data) if end < 0 else end, LIMITS))
    assert error is None or 400 <= error.status < 500 or error.status in _CLIENT_CAUSED_5XX


@fuzz_settings(300)
@given(st.one_of(st.binary(max_size=100), mutated(st.just(b"5\r\nhello\r\n0\r\nX: y\r\n\r\n"))))
def test_chunked_decoder(data: bytes) -> None:
    decoder = ChunkedDecoder(LIMITS)
    error = refusal(HttpError, lambda: decoder.decode(data, 0))
    assert error is None or 400 <= error.status < 500


ZOO = {m.name: m for m in reference_zoo()}


@fuzz_settings(300)
@given(infer_requests())
def test_json_and_binary_decoder(request: tuple[str, bytes, str | None]) -> None:
    name, data, length = request
    header_length = int(length) if length is not None and length.isdigit() else None
    regions = RequestRegions(SharedMemoryRegistry())
    refusal(
        InferenceServerError,
        lambda: decode_request(data, header_length, ZOO[name], name, "1", regions),
    )


@fuzz_settings(300)
@given(grpc_payloads)
def test_grpc_infer_wire_decoder(data: bytes) -> None:
    from google.protobuf.message import DecodeError

    from trioserve.grpc._codec import decode_request as decode_message

    def decode() -> None:
        regions = RequestRegions(SharedMemoryRegistry())
        request = WireRequest.FromString(data)
        InferPlans().plan(request).decode(request.raw, regions)
        decode_message(pb.ModelInferRequest.FromString(data), regions)

    error = refusal((DecodeError, InferenceServerError, GrpcError), decode)
    assert not isinstance(error, GrpcError) or error.status == GrpcStatus.INVALID_ARGUMENT


# --- properties: live servers over real sockets ----------------------------------------

_STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ")
# Server errors a client may cause: an unknown transfer coding, an unsupported version.
_CLIENT_CAUSED_5XX = {501, 505}


async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, close our side, read until the server closes: within 10 s."""
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            try:
                await stream.send_all(data)
                await stream.send_eof()
            except trio.BrokenResourceError:
                pass  # the server answered and closed before taking everything
            received = bytearray()
            try:
                while chunk := await stream.receive_some(65536):
                    received += chunk
            except trio.BrokenResourceError:
                pass  # a reset after the server's answer
            return bytes(received)


def check_http(server: Server, data: bytes, error_records: ErrorRecords) -> None:
    reply = trio.run(_exchange, server.http_port, data)
    if reply:
        assert _STATUS.match(reply), reply[:200]
    for status in map(int, _STATUS.findall(reply)):
        assert status < 500 or status in _CLIENT_CAUSED_5XX, reply[:500]
    assert error_records.take() == []


def test_live_http_parser(servers: dict[str, Server], error_records: ErrorRecords) -> None:
    @fuzz_settings(60)
    @given(http_bytes)
    def prop(data: bytes) -> None:
        check_http(servers["trio"], data, error_records)

    prop()


def test_live_http_infer(servers: dict[str, Server], error_records: ErrorRecords) -> None:
    @fuzz_settings(60)
    @given(infer_requests())
    def prop(request: tuple[str, bytes, str | None]) -> None:
        name, data, length = request
        headers = {} if length is None else {"Inference-Header-Content-Length": length}
        path = f"/v2/models/{name}/infer"
        check_http(servers["trio"], http_request("POST", path, data, headers), error_records)

    prop()


registrations = st.fixed_dictionaries(
    {},
    optional={
        "key": st.sampled_from([REGION_KEY, "/no_such_key", "../etc/passwd", "/", "", "/a/b"])
        | st.text(max_size=8)
        | json_values,
        "offset": st.integers(-1, 2 * REGION_BYTES) | json_values,
        "byte_size": st.integers(-1, 2 * REGION_BYTES) | json_values,
        "device_id": json_values,
        "raw_handle": json_values,
    },
)


def test_live_http_shared_memory_registration(
    servers: dict[str, Server], error_records: ErrorRecords
) -> None:
    """Registration bodies (the fuzzed region's key among the keys), then an inference
    request that reads the region (registered or not) at ``offset``."""

    @fuzz_settings(40)
    @given(st.sampled_from(["system", "cuda"]), registrations, st.integers(-1, 2 * REGION_BYTES))
    def prop(kind: str, body: dict[str, Any], offset: int) -> None:
        data = json.dumps(body).encode()
        path = f"/v2/{kind}sharedmemory/region/fuzz_registration"
        check_http(servers["trio"], http_request("POST", f"{path}/register", data, {}), error_records)  # fmt: skip
        placed = {"shared_memory_region": "fuzz_registration", "shared_memory_offset": offset,
                  "shared_memory_byte_size": 8}  # fmt: skip
        infer = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2], "parameters": placed}]}  # fmt: skip
        infer_path = "/v2/models/identity_fp32/infer"
        check_http(servers["trio"], http_request("POST", infer_path, json.dumps(infer).encode(), {}), error_records)  # fmt: skip
        check_http(servers["trio"], http_request("POST", f"{path}/unregister", b"", {}), error_records)  # fmt: skip

    prop()


_SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def check_grpc(
    server: Server, payload: bytes, error_records: ErrorRecords, method: str = "ModelInfer"
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call: Callable[..., bytes] = channel.unary_unary(
            f"/inference.GRPCInferenceService/{method}"
        )
        error: Any = refusal(grpc.RpcError, lambda: call(payload, timeout=10))
    if error is not None:
        assert error.code() not in _SERVER_FAULTS, (error.code(), error.details())
        assert error.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the server did not answer"
    assert error_records.take() == []


@pytest.mark.parametrize("front_end", ["trio", "grpclib"])
def test_live_grpc_infer(
    servers: dict[str, Server], error_records: ErrorRecords, front_end: str
) -> None:
    @fuzz_settings(60)
    @given(grpc_payloads)
    def prop(payload: bytes) -> None:
        check_grpc(servers[front_end], payload, error_records)

    prop()


@st.composite
def shared_memory_registrations(draw: Any) -> bytes:
    message = pb.SystemSharedMemoryRegisterRequest(
        name="fuzz_registration",
        key=draw(st.sampled_from([REGION_KEY, "/no_such_key", "../x", "/", ""]) | st.text(max_size=8)),
        offset=draw(st.integers(0, 2 * REGION_BYTES) | st.just(2**64 - 1)),
        byte_size=draw(st.integers(0, 2 * REGION_BYTES) | st.just(2**64 - 1)),
    )  # fmt: skip
    return draw(
        st.just(message.SerializeToString()) | mutated(st.just(message.SerializeToString()))
    )


@pytest.mark.parametrize("front_end", ["trio", "grpclib"])
def test_live_grpc_shared_memory_registration(
    servers: dict[str, Server], error_records: ErrorRecords, front_end: str
) -> None:
    """Registration messages (the fuzzed region's key among the keys), then an inference
    request that reads the region (registered or not) at ``offset``."""

    @fuzz_settings(30)
    @given(shared_memory_registrations(), st.integers(0, 2 * REGION_BYTES))
    def prop(registration: bytes, offset: int) -> None:
        server = servers[front_end]
        check_grpc(server, registration, error_records, "SystemSharedMemoryRegister")
        infer = pb.ModelInferRequest(model_name="identity_fp32")
        tensor = infer.inputs.add(name="INPUT0", datatype="FP32", shape=[2])
        tensor.parameters["shared_memory_region"].string_param = "fuzz_registration"
        tensor.parameters["shared_memory_offset"].int64_param = offset
        tensor.parameters["shared_memory_byte_size"].int64_param = 8
        check_grpc(server, infer.SerializeToString(), error_records)
        unregister = pb.SystemSharedMemoryUnregisterRequest(name="fuzz_registration")
        check_grpc(server, unregister.SerializeToString(), error_records, "SystemSharedMemoryUnregister")  # fmt: skip

    prop()


def grpc_call_bytes(payload: bytes) -> bytes:
    """What a client writes for one unary ModelInfer call on a fresh connection."""
    import h2.config
    import h2.connection

    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
               (":authority", "127.0.0.1"), ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
    connection.send_headers(1, headers)
    connection.send_data(1, b"\\0" + len(payload).to_bytes(4, "big") + payload, end_stream=True)
    return connection.data_to_send()


def test_live_http2_frames(servers: dict[str, Server], error_records: ErrorRecords) -> None:
    """A gRPC call's HTTP/2 bytes, mutated, to the built-in gRPC server: it answers or
    closes the connection, within the bound, and logs no failure."""

    @fuzz_settings(40)
    @given(mutated(grpc_messages.map(grpc_call_bytes)))
    def prop(data: bytes) -> None:
        trio.run(_exchange, servers["trio"].grpc_port, data)
        assert error_records.take() == []

    prop()


# --- request parameters of a generative model and of sequence models, every front end ---

# Values at and beyond every range of the parameter table, of every JSON type.
parameter_edges = st.sampled_from([
    -1, 0, 1, 2, 4, 5, 20, 21, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**400, -(2**63) - 1,
    -2.5, -2.0, -0.0, 1e-6, 0.5, 1.0, 1.5, 2.0, 1e300, float("nan"), float("inf"),
    float("-inf"), "", "x", "\n", "\ud800", [], [""], ["a", "\ud800"], {}, {"a": 1},
])  # fmt: skip
LLM_PARAMETERS = sorted(
    {name for row in PARAMETERS for dialect in ("vllm", "completions", "chat")
     for name in row.wire_names(dialect)}
    | {"stream", "echo", "logprobs", "top_logprobs", "best_of", "stream_options", "user",
       "sequence_id", "timeout"}
)  # fmt: skip
llm_parameters = st.dictionaries(
    st.sampled_from(LLM_PARAMETERS) | st.text(max_size=6),
    parameter_edges | json_values,
    max_size=6,
)
# Generation stays short whatever max_tokens and n say: 24 tokens at most, 4 samples.
FUZZ_LM = {"max_model_len": 24, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def llm_server(error_records: ErrorRecords) -> Iterator[Server]:
    """tiny_lm (kept short) beside the zoo and the Triton example repository (its
    sequence models), on the built-in servers."""
    config = ServerConfig(
        models=[*reference_zoo(), TinyLM(**FUZZ_LM)],
        model_repositories=[Path(trioserve.__file__).parent / "models" / "triton"],
        http_port=0,
        grpc_port=0,
    )
    with server_in_thread(config) as server:
        yield server


def check_answer(response: httpx.Response, client: httpx.Client, *, timed: bool = False) -> None:
    """An answer or a client error in the protocol's JSON shape (503 too for a request
    with a queue ``timeout``, which may expire); the server goes on."""
    allowed = (200, 400, 503) if timed else (200, 400)
    assert response.status_code in allowed, (response.status_code, response.text[:300])
    if response.status_code != 200:
        error = response.json()["error"]
        if response.request.url.path.startswith("/v1/"):
            assert error.keys() == {"message", "type", "param", "code"}, error
        else:
            assert isinstance(error, str)
    assert client.get("/v2/health/ready").status_code == 200


def test_live_generate_parameters(llm_server: Server, error_records: ErrorRecords) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{llm_server.http_port}", timeout=30) as client:

        @fuzz_settings(60)
        @given(st.sampled_from(["generate", "generate_stream"]), llm_parameters, llm_parameters)
        def prop(endpoint: str, parameters: dict[str, Any], top: dict[str, Any]) -> None:
            document = {"text_input": "hi", "parameters": parameters, **top}
            content = json.dumps(document)
            check_answer(client.post(f"/v2/models/tiny_lm/{endpoint}", content=content), client)
            assert error_records.take() == []

        prop()


def test_live_openai_parameters(llm_server: Server, error_records: ErrorRecords) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{llm_server.http_port}", timeout=30) as client:

        @fuzz_settings(60)
        @given(st.booleans(), llm_parameters)
        def prop(chat: bool, parameters: dict[str, Any]) -> None:
            asked: dict[str, Any] = {"model": "tiny_lm"}
            if chat:
                asked["messages"] = [{"role": "user", "content": "hi"}]
            else:
                asked["prompt"] = "hi"
            content = json.dumps({**parameters, **asked})
            path = "/v1/chat/completions" if chat else "/v1/completions"
            check_answer(client.post(path, content=content), client)
            assert error_records.take() == []

        prop()


def test_live_oip_llm_parameters(llm_server: Server, error_records: ErrorRecords) -> None:
    """OIP inference on tiny_lm: parameters in the request and in a ``sampling_parameters``
    input, of every type; then the same over gRPC, typed as the wire types them."""
    with httpx.Client(base_url=f"http://127.0.0.1:{llm_server.http_port}", timeout=30) as client:

        @fuzz_settings(60)
        @given(llm_parameters, st.none() | llm_parameters)
        def prop(parameters: dict[str, Any], in_input: dict[str, Any] | None) -> None:
            inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]
            if in_input is not None:
                data = [json.dumps(in_input)]
                inputs.append({"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": data})  # fmt: skip
            content = json.dumps({"inputs": inputs, "parameters": parameters})
            check_answer(client.post("/v2/models/tiny_lm/infer", content=content), client)
            assert error_records.take() == []

        prop()

    @fuzz_settings(60)
    @given(st.data())
    def grpc_prop(data: st.DataObject) -> None:
        message = pb.ModelInferRequest(model_name="tiny_lm")
        prompt = message.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        prompt.contents.bytes_contents.append(b"hi")
        typed_parameters(data.draw, message.parameters, llm_parameters)
        if data.draw(st.booleans(), label="streamed"):
            check_grpc_stream(llm_server, message.SerializeToString(), error_records)
        else:
            check_grpc(llm_server, message.SerializeToString(), error_records)

    grpc_prop()


def check_grpc_stream(server: Server, payload: bytes, error_records: ErrorRecords) -> None:
    """One ModelStreamInfer message: its replies end, none is a server fault."""
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call: Callable[..., Any] = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer"
        )
        replies = [pb.ModelStreamInferResponse.FromString(r) for r in call(iter([payload]), timeout=10)]  # fmt: skip
    assert replies, "no answer"
    for reply in replies:
        assert "unexpectedly" not in reply.error_message, reply.error_message
    assert error_records.take() == []


def typed_parameters(draw: Any, target: Any, drawn: st.SearchStrategy[dict[str, Any]]) -> None:
    """``drawn``'s parameters as gRPC carries them: each value as the type it reads as
    (numbers to 64 bits; anything else as its JSON text)."""
    for key, value in draw(drawn).items():
        if type(value) is bool:
            target[key].bool_param = value
        elif type(value) is int and -(2**63) <= value < 2**63:
            target[key].int64_param = value
        elif type(value) is int and 0 <= value < 2**64:
            target[key].uint64_param = value
        elif type(value) is float:
            target[key].double_param = value
        elif isinstance(value, str) and value.isascii():
            target[key].string_param = value
        else:  # protobuf strings are UTF-8: a lone surrogate travels escaped
            target[key].string_param = json.dumps(value)


SEQUENCE_MODELS = ["simple_dyna_sequence", "simple_string_dyna_sequence", "simple_sequence"]
tensor_parameters = st.dictionaries(
    st.sampled_from(["priority", "timeout", "sequence_id", "sequence_start", "sequence_end",
                     "binary_data_output"]) | st.text(max_size=6),
    parameter_edges | json_values,
    max_size=4,
)  # fmt: skip


def test_live_tensor_parameters(llm_server: Server, error_records: ErrorRecords) -> None:
    """Scheduling parameters of every type, to a dynamic batcher and to sequence batchers
    (string and integer correlation ids), over REST and gRPC."""
    with httpx.Client(base_url=f"http://127.0.0.1:{llm_server.http_port}", timeout=30) as client:

        @fuzz_settings(60)
        @given(st.sampled_from(["simple", *SEQUENCE_MODELS]), tensor_parameters)
        def prop(model: str, parameters: dict[str, Any]) -> None:
            if model == "simple":
                data = list(range(16))
                inputs = [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": data}
                          for n in ("INPUT0", "INPUT1")]  # fmt: skip
            else:
                inputs = [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}]
            content = json.dumps({"inputs": inputs, "parameters": parameters})
            response = client.post(f"/v2/models/{model}/infer", content=content)
            check_answer(response, client, timed="timeout" in parameters)
            assert error_records.take() == []

        prop()

    @fuzz_settings(60)
    @given(st.sampled_from(SEQUENCE_MODELS), st.data())
    def grpc_prop(model: str, data: st.DataObject) -> None:
        message = pb.ModelInferRequest(model_name=model)
        message.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
        message.raw_input_contents.append((1).to_bytes(4, "little"))
        typed_parameters(data.draw, message.parameters, tensor_parameters)
        check_grpc(llm_server, message.SerializeToString(), error_records)

    grpc_prop()
