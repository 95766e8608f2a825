"""The gRPC front ends against more real clients: tritonclient with compression and
its asyncio client, grpcio's reflection client, TLS, and the C clients h2load and nghttp.

Client calls block, so they run in threads (or their own asyncio loop in a thread).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import trustme
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import trioserve
from trioserve import Server, ServerConfig
from trioserve.grpc._generated import grpc_service_pb2 as pb
from trioserve.models import reference_zoo

TIMEOUT = 30


async def start(nursery: trio.Nursery, **settings: Any) -> Server:
    config = ServerConfig(models=reference_zoo(), http_port=None, grpc_port=0, **settings)
    server: Server = await nursery.start(trioserve.serve, config)
    return server


def simple_inputs(module: Any) -> list[Any]:
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(x)
    return inputs


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
async def test_tritonclient_compressed_requests_and_replies(
    nursery: trio.Nursery, grpc_server: str, algorithm: str
) -> None:
    server = await start(nursery, grpc_server=grpc_server)

    def infer() -> Any:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
            inputs = simple_inputs(grpcclient)
            return client.infer("simple", inputs, compression_algorithm=algorithm)

    with trio.fail_after(TIMEOUT):
        if grpc_server == "grpclib":  # grpclib reads no compressed message: a clear refusal
            with pytest.raises(grpcclient.InferenceServerException, match="not supported"):
                await trio.to_thread.run_sync(infer)
            return
        result = await trio.to_thread.run_sync(infer)
    assert result.as_numpy("OUTPUT0").tolist() == [list(range(0, 32, 2))]


async def test_tritonclient_asyncio_client_unary_and_streaming(
    nursery: trio.Nursery, grpc_server: str
) -> None:
    server = await start(nursery, grpc_server=grpc_server)

    async def session() -> tuple[Any, list[Any]]:
        client = aioclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:
            unary = await client.infer("simple", simple_inputs(aioclient))

            async def requests() -> Any:
                for index in range(3):
                    yield {
                        "model_name": "simple",
                        "inputs": simple_inputs(aioclient),
                        "request_id": str(index),
                    }

            streamed = [result async for result, error in client.stream_infer(requests())]
            return unary, streamed
        finally:
            await client.close()

    with trio.fail_after(TIMEOUT):
        unary, streamed = await trio.to_thread.run_sync(asyncio.run, session())
    assert unary.as_numpy("OUTPUT1").tolist() == [[0] * 16]
    assert sorted(r.get_response().id for r in streamed) == ["0", "1", "2"]


async def test_reflection_lists_and_describes_the_services(nursery: trio.Nursery) -> None:
    server = await start(nursery)

    def reflect() -> tuple[list[str], str]:
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = sorted(database.get_services())
            found = database.FindFileContainingSymbol("inference.GRPCInferenceService.ModelInfer")
            return services, found.name

    with trio.fail_after(TIMEOUT):
        services, file_name = await trio.to_thread.run_sync(reflect)
    assert "inference.GRPCInferenceService" in services
    assert "grpc.health.v1.Health" in services
    assert file_name.endswith("grpc_service.proto")


async def test_tls_with_tritonclient(nursery: trio.Nursery, tmp_path: Path) -> None:
    authority = trustme.CA()
    key_and_chain = tmp_path / "server.pem"
    authority.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(
        str(key_and_chain)
    )
    root = tmp_path / "root.pem"
    authority.cert_pem.write_to_path(str(root))
    server = await start(
        nursery, grpc_tls_certfile=str(key_and_chain), grpc_tls_keyfile=str(key_and_chain)
    )

    def infer() -> Any:
        url = f"localhost:{server.grpc_port}"
        with grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(root)) as c:
            return c.infer("simple", simple_inputs(grpcclient))

    with trio.fail_after(TIMEOUT):
        result = await trio.to_thread.run_sync(infer)
    assert result.as_numpy("OUTPUT0").tolist() == [list(range(0, 32, 2))]


def infer_body(tmp_path: Path) -> Path:
    request = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    message = request.SerializeToString()
    body = tmp_path / "body"
    body.write_bytes(len(message).to_bytes(5, "big") + message)  # gRPC's message prefix
    return body


GRPC_HEADERS = ["-H", "content-type: application/grpc", "-H", "te: trailers"]


@pytest.mark.skipif(shutil.which("h2load") is None, reason="needs h2load (nghttp2-client)")
async def test_h2load_many_streams_all_succeed(nursery: trio.Nursery, tmp_path: Path) -> None:
    server = await start(nursery)
    url = f"http://127.0.0.1:{server.grpc_port}/inference.GRPCInferenceService/ModelInfer"
    command = ["h2load", "-n", "400", "-c", "4", "-m", "16", "-d", str(infer_body(tmp_path))]
    with trio.fail_after(TIMEOUT):
        done = await trio.run_process([*command, *GRPC_HEADERS, url], capture_stdout=True)
    assert "400 succeeded, 0 failed, 0 errored" in done.stdout.decode()


@pytest.mark.skipif(shutil.which("nghttp") is None, reason="needs nghttp (nghttp2-client)")
async def test_nghttp_sees_grpc_status_ok(nursery: trio.Nursery, tmp_path: Path) -> None:
    server = await start(nursery)
    url = f"http://127.0.0.1:{server.grpc_port}/inference.GRPCInferenceService/ModelInfer"
    command = ["nghttp", "-v", "-d", str(infer_body(tmp_path)), *GRPC_HEADERS, url]
    with trio.fail_after(TIMEOUT):
        done = await trio.run_process(command, capture_stdout=True, stderr=subprocess.STDOUT)
    out = done.stdout.decode("latin-1")
    assert "grpc-status: 0" in out and ":status: 200" in out


async def test_client_mistakes_are_counted_in_metrics(nursery: trio.Nursery) -> None:
    server = await start(nursery)
    assert server.registry is not None
    before = server.registry.get_sample_value("trioserve_grpc_protocol_errors_total")
    assert before == 0
    stream = await trio.open_tcp_stream("127.0.0.1", server.grpc_port)
    async with stream:
        settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame
        data_on_stream_0 = b"\x00\x00\x01\x00\x00\x00\x00\x00\x00x"
        await stream.send_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings + data_on_stream_0)
        with trio.fail_after(TIMEOUT):
            while await stream.receive_some(65536):
                pass  # until the server closes the connection after its GOAWAY
    after = server.registry.get_sample_value("trioserve_grpc_protocol_errors_total")
    assert after == 1
