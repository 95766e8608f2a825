"""The model repository RPCs: RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload.

Each is a function from the repository and the request message to the reply message,
in trio (load and unload start and stop models there). A load's ``config`` parameter is the JSON config override; its ``file:<path>``
parameters carry the model's files as bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .._errors import InvalidArgumentError, UnsupportedError
from .._served import ModelRepository, RepositoryControl
from ._generated import grpc_service_pb2 as pb

_Answer = Callable[[ModelRepository, Any], Awaitable[Any]]


def _control(repository: ModelRepository) -> RepositoryControl:
    if repository.control is None:
        raise UnsupportedError("this server has no model repository")
    return repository.control


async def _index(repository: ModelRepository, request: Any) -> Any:
    entries = _control(repository).index(request.ready)
    models = [pb.RepositoryIndexResponse.ModelIndex(**entry) for entry in entries]
    return pb.RepositoryIndexResponse(models=models)


async def _load(repository: ModelRepository, request: Any) -> Any:
    config: str | None = None
    files: dict[str, bytes] = {}
    for key, value in request.parameters.items():
        kind = value.WhichOneof("parameter_choice")
        if key == "config":
            if kind != "string_param":
                raise InvalidArgumentError("parameter 'config' must be a string")
            config = value.string_param
        elif key.startswith("file:"):
            if kind != "bytes_param":
                raise InvalidArgumentError(f"parameter '{key}' must be bytes")
            files[key.removeprefix("file:")] = value.bytes_param
    await _control(repository).load(request.model_name, config, files)
    return pb.RepositoryModelLoadResponse()


async def _unload(repository: ModelRepository, request: Any) -> Any:
    dependents = request.parameters.get("unload_dependents")
    unload_dependents = dependents is not None and dependents.bool_param
    await _control(repository).unload(request.model_name, unload_dependents)
    return pb.RepositoryModelUnloadResponse()


REPOSITORY_RPCS: dict[str, _Answer] = {
    "RepositoryIndex": _index,
    "RepositoryModelLoad": _load,
    "RepositoryModelUnload": _unload,
}
