"""Server reflection: the handler on an in-memory stream, and grpcio-reflection's client on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from google.protobuf import descriptor_pb2, descriptor_pool, text_format
from grpc_reflection.v1alpha import reflection_pb2 as grpcio_reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from trioserve.grpc._generated import _pool
from trioserve.grpc._reflection import (
    REFLECTION_V1,
    REFLECTION_V1ALPHA,
    REFLECTION_VERSIONS,
    ReflectionVersion,
    reflection_handler,
    serve_reflection,
    service_names,
)

TIMEOUT = 10  # seconds; nothing here waits on anything but the handler
SERVICES = [
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
    "inference.GRPCInferenceService",
]
NOT_FOUND = 5
INVALID_ARGUMENT = 3
versions = pytest.mark.parametrize("version", REFLECTION_VERSIONS, ids=lambda v: v.service)


class ChannelStream:
    """A MessageStream over trio memory channels, as a front end would present a call."""

    def __init__(
        self, requests: trio.MemoryReceiveChannel[Any], responses: trio.MemorySendChannel[Any]
    ):
        self._requests = requests
        self._responses = responses

    async def recv(self) -> Any | None:
        try:
            return await self._requests.receive()
        except trio.EndOfChannel:
            return None

    async def send(self, message: Any) -> None:
        await self._responses.send(message)


@asynccontextmanager
async def reflection_call(
    version: ReflectionVersion,
) -> AsyncIterator[Callable[..., Any]]:
    """One ServerReflectionInfo call; yields ``ask(**request_fields) -> response``."""
    send_request, requests = trio.open_memory_channel[Any](0)
    responses, receive_response = trio.open_memory_channel[Any](0)
    handler = reflection_handler(version, SERVICES)

    async def ask(**fields: Any) -> Any:
        await send_request.send(version.request_type(**fields))
        return await receive_response.receive()

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handler, ChannelStream(requests, responses), None)
            yield ask
            await send_request.aclose()  # the client half-closes: the handler returns


def _file_names(response: Any) -> list[str]:
    return [
        descriptor_pb2.FileDescriptorProto.FromString(blob).name
        for blob in response.file_descriptor_response.file_descriptor_proto
    ]


@versions
async def test_list_services(version):
    async with reflection_call(version) as ask:
        response = await ask(host="localhost:8001", list_services="")
    assert [s.name for s in response.list_services_response.service] == SERVICES
    assert response.valid_host == "localhost:8001"
    assert response.original_request.WhichOneof("message_request") == "list_services"
    assert type(response) is version.messages.ServerReflectionResponse


@versions
async def test_a_file_comes_with_its_dependencies(version):
    async with reflection_call(version) as ask:
        response = await ask(file_by_filename="grpc_service.proto")
    assert _file_names(response) == ["grpc_service.proto", "model_config.proto"]
    # What a tool does with them: build the types without any .proto source.
    pool = descriptor_pool.DescriptorPool()
    for blob in reversed(response.file_descriptor_response.file_descriptor_proto):
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(blob))
    infer = pool.FindMethodByName("inference.GRPCInferenceService.ModelInfer")
    assert infer.input_type.full_name == "inference.ModelInferRequest"
    config = pool.FindMessageTypeByName("inference.ModelConfig")
    assert config.fields_by_name["max_batch_size"].number == 4


@versions
@pytest.mark.parametrize(
    ("symbol", "files"),
    [
        ("inference.GRPCInferenceService", ["grpc_service.proto", "model_config.proto"]),
        ("inference.GRPCInferenceService.ModelInfer", ["grpc_service.proto", "model_config.proto"]),
        ("inference.ModelInferRequest", ["grpc_service.proto", "model_config.proto"]),
        (
            "inference.ModelInferRequest.InferInputTensor",
            ["grpc_service.proto", "model_config.proto"],
        ),
        ("inference.DataType", ["model_config.proto"]),
        ("grpc.health.v1.Health.Check", ["health.proto"]),
        ("grpc.reflection.v1.ServerReflection", ["reflection_v1.proto"]),
        ("grpc.reflection.v1alpha.ServerReflectionResponse", ["reflection_v1alpha.proto"]),
    ],
)
async def test_file_containing_symbol(version, symbol, files):
    async with reflection_call(version) as ask:
        response = await ask(file_containing_symbol=symbol)
    assert _file_names(response) == files


@versions
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"file_by_filename": "nope.proto"}, "no file named 'nope.proto'"),
        ({"file_containing_symbol": "inference.Nope"}, "no symbol named 'inference.Nope'"),
        (
            {"file_containing_symbol": "inference.GRPCInferenceService.Nope"},
            "no symbol named 'inference.GRPCInferenceService.Nope'",
        ),
        ({"file_containing_symbol": "Nope"}, "no symbol named 'Nope'"),
        ({"all_extension_numbers_of_type": "inference.Nope"}, "no message type named"),
    ],
)
async def test_unknown_names_are_not_found(version, fields, message):
    async with reflection_call(version) as ask:
        response = await ask(**fields)
    assert response.error_response.error_code == NOT_FOUND
    assert message in response.error_response.error_message
    assert response.original_request == version.request_type(**fields)


@versions
async def test_extensions(version):
    extension = version.messages.ExtensionRequest(
        containing_type="inference.ModelConfig", extension_number=100
    )
    async with reflection_call(version) as ask:
        no_extension = await ask(file_containing_extension=extension)
        numbers = await ask(all_extension_numbers_of_type="inference.ModelConfig")
    assert no_extension.error_response.error_code == NOT_FOUND
    assert (
        "no extension 100 of 'inference.ModelConfig'" in no_extension.error_response.error_message
    )
    assert numbers.WhichOneof("message_response") == "all_extension_numbers_response"
    assert numbers.all_extension_numbers_response.base_type_name == "inference.ModelConfig"
    assert list(numbers.all_extension_numbers_response.extension_number) == []


@versions
async def test_an_empty_request_is_an_invalid_argument(version):
    async with reflection_call(version) as ask:
        response = await ask(host="h")
        after = await ask(list_services="")  # the stream goes on
    assert response.error_response.error_code == INVALID_ARGUMENT
    assert len(after.list_services_response.service) == len(SERVICES)


async def test_serve_reflection_returns_when_the_client_half_closes():
    send_request, requests = trio.open_memory_channel[Any](3)
    responses, receive_response = trio.open_memory_channel[Any](3)
    for name in ("health.proto", "model_config.proto"):
        send_request.send_nowait(REFLECTION_V1.request_type(file_by_filename=name))
    send_request.close()
    with trio.fail_after(TIMEOUT):
        await serve_reflection(ChannelStream(requests, responses), SERVICES)
    answered = [_file_names(receive_response.receive_nowait()) for _ in range(2)]
    assert answered == [["health.proto"], ["model_config.proto"]]


def test_versions_match_their_descriptors():
    assert [v.path for v in REFLECTION_VERSIONS] == [
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ]
    for version in REFLECTION_VERSIONS:
        service = _pool.POOL.FindServiceByName(version.service)
        method = service.methods_by_name["ServerReflectionInfo"]
        assert method.client_streaming and method.server_streaming
        assert method.input_type is version.request_type.DESCRIPTOR
        assert method.output_type is version.messages.ServerReflectionResponse.DESCRIPTOR


def test_service_names_of_a_method_table():
    paths = [
        "/inference.GRPCInferenceService/ModelInfer",
        "/grpc.health.v1.Health/Check",
        "/inference.GRPCInferenceService/ServerLive",
        REFLECTION_V1ALPHA.path,
    ]
    assert service_names(paths) == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "inference.GRPCInferenceService",
    ]


# --------------------------------------------------------------------------- grpcio-reflection


def _schema(version_module: Any) -> str:
    """Messages and service of a generated module, as text, package spelled 'PKG'."""
    proto = descriptor_pb2.FileDescriptorProto()
    version_module.DESCRIPTOR.CopyToProto(proto)
    for field in ("name", "package", "options"):  # file-level facts that differ
        proto.ClearField(field)
    text = text_format.MessageToString(proto)
    return text.replace("grpc.reflection.v1alpha.", "PKG.").replace("grpc.reflection.v1.", "PKG.")


@pytest.mark.parametrize("version", REFLECTION_VERSIONS, ids=lambda v: v.service)
def test_schema_matches_grpcio_reflection(version):
    assert _schema(version.messages) == _schema(grpcio_reflection_pb2)


class InProcessChannel:
    """Just enough of ``grpc.Channel`` for grpcio-reflection's client: each call carries
    serialized requests to our handler on the trio side and serialized responses back."""

    def stream_stream(
        self, path: str, request_serializer: Any, response_deserializer: Any, **_: Any
    ) -> Callable[[Iterator[Any]], Iterator[Any]]:
        version = {v.path: v for v in REFLECTION_VERSIONS}[path]

        def call(requests: Iterator[Any]) -> Iterator[Any]:
            wire = [request_serializer(r) for r in requests]
            answers = trio.from_thread.run(self._exchange, version, wire)
            return iter([response_deserializer(blob) for blob in answers])

        return call

    @staticmethod
    async def _exchange(version: ReflectionVersion, wire: list[bytes]) -> list[bytes]:
        send_request, requests = trio.open_memory_channel[Any](len(wire))
        responses, receive_response = trio.open_memory_channel[Any](len(wire))
        for blob in wire:
            send_request.send_nowait(version.request_type.FromString(blob))
        send_request.close()
        await reflection_handler(version, SERVICES)(ChannelStream(requests, responses), None)
        responses.close()
        return [message.SerializeToString() async for message in receive_response]


async def test_grpcio_reflection_client_builds_our_types():
    def describe() -> tuple[list[str], Any, Any]:
        database = ProtoReflectionDescriptorDatabase(InProcessChannel())
        pool = descriptor_pool.DescriptorPool(database)
        infer = pool.FindServiceByName("inference.GRPCInferenceService").methods_by_name[
            "ModelStreamInfer"
        ]
        with pytest.raises(KeyError):  # the client accepts only NOT_FOUND here
            pool.FindMessageTypeByName("inference.Nope")
        return (
            list(database.get_services()),
            infer,
            pool.FindMessageTypeByName("inference.ModelConfig"),
        )

    with trio.fail_after(TIMEOUT):
        services, infer, config = await trio.to_thread.run_sync(describe)
    assert services == SERVICES
    assert infer.client_streaming and infer.server_streaming
    assert infer.output_type.full_name == "inference.ModelStreamInferResponse"
    ours = _pool.POOL.FindMessageTypeByName("inference.ModelConfig")
    assert [f.name for f in config.fields] == [f.name for f in ours.fields]
