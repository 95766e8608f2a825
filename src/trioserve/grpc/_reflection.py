"""gRPC server reflection (``grpc.reflection.v1`` and ``v1alpha``), for any front end.

Tools such as grpcurl ask a server over one bidirectional stream which services it
offers and which file describes a service, method, message or enum; the answer is the
serialized ``FileDescriptorProto`` of that file and of every file it depends on, so the
tool can build the types without the ``.proto`` sources. The descriptors come from the
private pool of the generated code (tools/gen_proto.py), which holds every schema this
server speaks. The two versions are the same schema under two packages: one handler
serves both, given the version's message classes.

The handler is trio code and knows nothing of the transport: it reads requests from a
``MessageStream`` and writes one response per request, in order.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from google.protobuf import descriptor_pb2

from ._generated import _pool, reflection_v1_pb2, reflection_v1alpha_pb2

# gRPC status codes, carried in ErrorResponse.error_code: the call itself stays OK.
_INVALID_ARGUMENT = 3
_NOT_FOUND = 5


class MessageStream(Protocol):
    """A streaming call's messages (the front end parses and serializes)."""

    async def recv(self) -> Any | None: ...  # None once the client half-closed

    async def send(self, message: Any) -> None: ...


@dataclass(frozen=True)
class ReflectionVersion:
    """One version of the reflection service: its method's path and message classes."""

    service: str
    messages: ModuleType  # the generated ``*_pb2`` module

    @property
    def path(self) -> str:
        """The HTTP/2 path of ServerReflectionInfo."""
        return f"/{self.service}/ServerReflectionInfo"

    @property
    def request_type(self) -> Any:
        return self.messages.ServerReflectionRequest


REFLECTION_V1 = ReflectionVersion("grpc.reflection.v1.ServerReflection", reflection_v1_pb2)
REFLECTION_V1ALPHA = ReflectionVersion(
    "grpc.reflection.v1alpha.ServerReflection", reflection_v1alpha_pb2
)
REFLECTION_VERSIONS = (REFLECTION_V1, REFLECTION_V1ALPHA)


def service_names(paths: Iterable[str]) -> list[str]:
    """The services of a method table, sorted: ``/pkg.Service/Method`` gives ``pkg.Service``."""
    return sorted({path.split("/")[1] for path in paths})


def reflection_handler(
    version: ReflectionVersion, services: Sequence[str]
) -> Callable[[MessageStream, object], Awaitable[None]]:
    """The stream handler of ``version.path``, listing ``services`` (a method table's)."""
    names = tuple(sorted(services))

    async def server_reflection_info(stream: MessageStream, call: object) -> None:
        await serve_reflection(stream, names, version)

    return server_reflection_info


async def serve_reflection(
    stream: MessageStream,
    services: Sequence[str],
    version: ReflectionVersion = REFLECTION_V1,
) -> None:
    """Answer each request of ``stream`` until the client half-closes it."""
    while (request := await stream.recv()) is not None:
        await stream.send(_answer(version.messages, request, services))


def _answer(messages: ModuleType, request: Any, services: Sequence[str]) -> Any:
    """The response to one ``ServerReflectionRequest`` of the version in ``messages``."""
    response = messages.ServerReflectionResponse(valid_host=request.host, original_request=request)
    kind = request.WhichOneof("message_request")
    if kind == "list_services":
        listed = response.list_services_response.service
        listed.extend(messages.ServiceResponse(name=name) for name in services)
    elif kind == "file_by_filename":
        found = _file_by_name(request.file_by_filename)
        _fill(response, found, f"no file named {request.file_by_filename!r}")
    elif kind == "file_containing_symbol":
        found = _file_defining(request.file_containing_symbol)
        _fill(response, found, f"no symbol named {request.file_containing_symbol!r}")
    elif kind == "file_containing_extension":
        # None of this server's schemas declares extensions (proto3 has none).
        extension = request.file_containing_extension
        message = f"no extension {extension.extension_number} of {extension.containing_type!r}"
        _fill(response, None, message)
    elif kind == "all_extension_numbers_of_type":
        name = request.all_extension_numbers_of_type
        if _is_message_type(name):
            response.all_extension_numbers_response.base_type_name = name
        else:
            _fill(response, None, f"no message type named {name!r}")
    else:
        response.error_response.error_code = _INVALID_ARGUMENT
        response.error_response.error_message = "the request asks for nothing"
    return response


def _fill(response: Any, files: tuple[bytes, ...] | None, not_found: str) -> None:
    if files is None:
        response.error_response.error_code = _NOT_FOUND
        response.error_response.error_message = not_found
    else:
        response.file_descriptor_response.file_descriptor_proto.extend(files)


@functools.cache
def _file_by_name(name: str) -> tuple[bytes, ...] | None:
    """The serialized file and its transitive dependencies, the file first."""
    try:
        file = _pool.POOL.FindFileByName(name)
    except KeyError:
        return None
    ordered: dict[str, Any] = {}
    pending = [file]
    while pending:
        current = pending.pop()
        if current.name not in ordered:
            ordered[current.name] = current
            pending.extend(reversed(current.dependencies))
    serialized = []
    for each in ordered.values():
        proto = descriptor_pb2.FileDescriptorProto()
        each.CopyToProto(proto)
        serialized.append(proto.SerializeToString())
    return tuple(serialized)


def _file_defining(symbol: str) -> tuple[bytes, ...] | None:
    """The file of a service, method, message, field, enum or enum value."""
    pool = _pool.POOL
    try:
        return _file_by_name(pool.FindFileContainingSymbol(symbol).name)
    except KeyError:
        pass
    # The pool does not index methods: look the service up instead.
    service_name, _, method = symbol.rpartition(".")
    try:
        service = pool.FindServiceByName(service_name)
    except KeyError:
        return None
    if method not in service.methods_by_name:
        return None
    return _file_by_name(service.file.name)


def _is_message_type(name: str) -> bool:
    try:
        _pool.POOL.FindMessageTypeByName(name)
    except KeyError:
        return False
    return True
