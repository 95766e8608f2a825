"""Fuzzing as tests: whatever a client sends, the server answers with a well-formed client
error (or success), never a server error it caused, never a hang, never a logged failure.
The request parameters of every front end are fuzzed in ``test_fuzz_parameters.py``.

The properties run against the parsers and decoders alone (many examples, cheap) and against
live servers over real sockets: the built-in HTTP/1.1 server, and both gRPC front ends
through grpcio raw unary calls. The normal test run uses a short, deterministic profile;
``tools/fuzz.py --minutes N`` runs the same properties with many random examples
(``TRIOSERVE_FUZZ_EXAMPLES`` and ``TRIOSERVE_FUZZ_SEED`` select that profile).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
import tritonclient.utils.shared_memory as shm
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from trioserve import InferenceServerError, Server, ServerConfig
from trioserve._limits import HttpLimits
from trioserve.grpc._errors import GrpcError, GrpcStatus
from trioserve.grpc._infer_wire import InferPlans, WireRequest
from trioserve.models import reference_zoo
from trioserve.rest._http11_parser import ChunkedDecoder, HttpError, parse_head
from trioserve.rest._infer_codec import decode_request
from trioserve.shm import RequestRegions, SharedMemoryRegistry
from trioserve.testing import server_in_thread

from ._fuzzing import (
    ErrorRecords,
    check_grpc,
    fuzz_settings,
    json_values,
    refusal,
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
