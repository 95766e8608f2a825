"""Restricted APIs cannot be reached through path tricks, on either protocol.

REST: a request target that decodes to a restricted path (percent-encoded letters or
slashes, absolute form, a query) reaches the restricted endpoint, whose guard answers 403
without the header; every other spelling (double, trailing or encoded trailing slashes,
dot segments, case, ``;`` parameters, a fragment, backslashes, NUL) is no route: 404.
Never the protected action: the model that the unload tricks aim at stays loaded.
The targets go over raw sockets, since HTTP clients would normalise them.

gRPC: a method path is looked up exactly, so any other spelling of a restricted method
is UNIMPLEMENTED; the method itself without the metadata is UNAVAILABLE, as in Triton.
"""

from __future__ import annotations

import json

import grpc
import pytest
import trio

import trioserve
from trioserve import Restriction, Server, ServerConfig
from trioserve.grpc._generated import grpc_service_pb2 as pb
from trioserve.models import reference_zoo

KEY = ("admin-key", "s3cret")
GUARD = Restriction(*KEY)
RESTRICTED = {"shared-memory": GUARD, "model-repository": GUARD}
REFUSED = b"This API is restricted, expecting header 'admin-key'"

# Spellings that decode to a restricted path: the guard answers them (403).
GUARDED = [
    "/v2/repository/index",
    "/v2/repository%2Findex",
    "/v2/repository%2findex",
    "/v2/%72epository/index",
    "/v2/repository/%69ndex",
    "/v2/repository/index?x=1",
    "/v2/repository/models/simple/unload",
    "/v2/repository/models/%73imple/unload",
    "/v2/repository%2Fmodels%2Fsimple%2Funload",
    "/v2/repository/models/%2e%2e/load",
    "/v2/systemsharedmemory/region/r/register",
    "/v2/systemsharedmemory%2Fregion%2Fr%2Fregister",
    "/v2/cudasharedmemory/region/r/register",
    "/v2/systemsharedmemory/unregister",
]
# Spellings that are no route at all (404).
NOT_FOUND = [
    "//v2/repository/index",
    "/v2//repository/index",
    "/v2/repository/index/",
    "/v2/repository/index%2F",
    "/v2/repository/index/.",
    "/v2/repository/index/..",
    "/v2/./repository/index",
    "/v2/models/../repository/index",
    "/v2/models/%2e%2e/repository/index",
    "/v2/models/simple/../../repository/models/simple/unload",
    "/V2/Repository/Index",
    "/v2/REPOSITORY/index",
    "/v2/repository/index;x=1",
    "/v2/repository;x/index",
    "/v2/repository/models/simple/unload;x",
    "/v2/repository/index#fragment",
    "/v2/repository/index%00",
    "/v2/repository/index%20",
    "/v2/repository/index%3F",
    "/v2\\repository\\index",
    "/v2/repository/models/x%2F..%2F..%2Fsimple/unload",
    "/v2/systemsharedmemory/region/r/register/",
    "http://127.0.0.1//v2/repository/index",
    "*",
]
# Absolute-form targets (RFC 9112 3.2.2): the built-in server takes their path,
# hypercorn answers no route for them.
ABSOLUTE = ["http://127.0.0.1/v2/repository/index", "HTTP://x/v2/repository/models/simple/unload"]


async def start(nursery: trio.Nursery, **settings: object) -> Server:
    """The zoo's "simple" model, served in explicit mode so the repository API can
    unload it."""
    config = ServerConfig(
        models=[model for model in reference_zoo() if model.name == "simple"],
        model_control_mode="explicit",
        load_models=["*"],
        **settings,  # type: ignore[arg-type]
    )
    server: Server = await nursery.start(trioserve.serve, config)
    return server


async def exchange(port: int, target: str, headers: str = "") -> tuple[int, bytes]:
    """POST ``target`` verbatim with an empty JSON body; the status and the body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            f"POST {target} HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"
            f"connection: close\r\n{headers}\r\n{{}}".encode()
        )
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


@pytest.mark.parametrize("http_server", ["stdlib", "hypercorn"])
async def test_rest_path_tricks_never_reach_a_restricted_api(
    nursery: trio.Nursery, http_server: str
) -> None:
    server = await start(
        nursery,
        http_port=0,
        grpc_port=None,
        http_server=http_server,
        http_restricted_apis=RESTRICTED,
    )
    port = server.http_port
    assert port is not None
    absolute = 403 if http_server == "stdlib" else 404
    expected = {
        **dict.fromkeys(GUARDED, 403),
        **dict.fromkeys(NOT_FOUND, 404),
        **dict.fromkeys(ABSOLUTE, absolute),
    }
    with trio.fail_after(30):
        answers = {target: await exchange(port, target) for target in expected}
        assert {target: status for target, (status, _) in answers.items()} == expected
        for status, body in answers.values():
            assert status == 404 or json.loads(body) == {"error": REFUSED.decode()}
        assert server.repository.model_ready("simple", "")  # no unload got through
        # The header opens the same door: the guard is what refused the tricks above.
        status, body = await exchange(port, "/v2/repository/index", f"{KEY[0]}: {KEY[1]}\r\n")
        assert status == 200
        assert [entry["name"] for entry in json.loads(body)] == ["simple"]
        status, _ = await exchange(port, "/v2/repository/index", f"{KEY[0]}: S3CRET\r\n")
        assert status == 403  # the value is compared exactly
        status, _ = await exchange(
            port, "/v2/repository%2Fmodels/simple/unload", f"Admin-Key: {KEY[1]}\r\n"
        )
        assert status == 200  # header names are case-insensitive
        assert not server.repository.model_ready("simple", "")


SERVICE = "/inference.GRPCInferenceService/"
GRPC_TRICKS = [
    SERVICE + "repositoryindex",
    SERVICE + "REPOSITORYINDEX",
    SERVICE + "RepositoryIndex/",
    SERVICE + "Repository%49ndex",
    SERVICE + "RepositoryIndex%00",
    SERVICE + "RepositoryIndex?x=1",
    SERVICE + "RepositoryIndex;x",
    SERVICE + "./RepositoryIndex",
    SERVICE + "/RepositoryIndex",
    "/inference.grpcinferenceservice/RepositoryIndex",
    "/inference%2EGRPCInferenceService/RepositoryIndex",
    "//inference.GRPCInferenceService/RepositoryIndex",
    "/x/../inference.GRPCInferenceService/RepositoryIndex",
    "inference.GRPCInferenceService/RepositoryIndex",
    SERVICE + "systemsharedmemoryregister",
    SERVICE + "SystemSharedMemoryRegister/",
    SERVICE + "RepositoryModelUnload/",
    SERVICE + "repositorymodelunload",
]


def call(port: int, path: str, request: object, metadata: tuple[tuple[str, str], ...] = ()) -> str:
    """The status name of a unary call to ``path``, with its message when not OK."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.unary_unary(
            path,
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=lambda raw: raw,
        )
        try:
            method(request, timeout=10, metadata=metadata)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
        return "OK"


async def test_grpc_method_path_tricks_are_unimplemented(
    nursery: trio.Nursery, grpc_server: str
) -> None:
    server = await start(
        nursery,
        http_port=None,
        grpc_port=0,
        grpc_server=grpc_server,
        grpc_restricted_apis=RESTRICTED,
    )
    port = server.grpc_port
    assert port is not None
    unload = pb.RepositoryModelUnloadRequest(model_name="simple")
    with trio.fail_after(60):
        for path in GRPC_TRICKS:
            answer = await trio.to_thread.run_sync(call, port, path, unload)
            assert answer.startswith("UNIMPLEMENTED"), (path, answer)
        refused = f"UNAVAILABLE: {REFUSED.decode()}"
        for rpc in ("RepositoryModelUnload", "SystemSharedMemoryRegister"):
            assert await trio.to_thread.run_sync(call, port, SERVICE + rpc, unload) == refused
        wrong = ((KEY[0], "S3CRET"),)
        answer = await trio.to_thread.run_sync(
            call, port, SERVICE + "RepositoryIndex", unload, wrong
        )
        assert answer == refused
        assert server.repository.model_ready("simple", "")  # no unload got through
        answer = await trio.to_thread.run_sync(
            call, port, SERVICE + "RepositoryModelUnload", unload, (KEY,)
        )
        assert answer == "OK"
        assert not server.repository.model_ready("simple", "")
