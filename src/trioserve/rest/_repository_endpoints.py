"""The model repository extension over REST.

    POST v2/repository/index                  {"ready": bool}? -> [{name, version, state, reason}]
    POST v2/repository/models/{model}/load    {"parameters": {"config": JSON, "file:<path>": b64}}
    POST v2/repository/models/{model}/unload  {"parameters": {"unload_dependents": bool}}

A restricted "model-repository" API group answers 403 without the expected header.
"""

from __future__ import annotations

from typing import Any

import trio

from .._errors import InvalidArgumentError, UnsupportedError
from .._limits import OFF_LOOP_BYTES
from .._restricted import Restriction
from .._served import ModelRepository, RepositoryControl, UploadedFile
from ..repository import decode_file_parameters
from ._app import Endpoint, Request, Response
from ._json_body import COMPACT, json_object
from ._router import Router
from ._shm_endpoints import _restricted

_DONE = Response(200, content_type=None)


class _RepositoryEndpoints:
    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository

    def _control(self) -> RepositoryControl:
        if self.repository.control is None:
            raise UnsupportedError("this server has no model repository")
        return self.repository.control

    async def index(self, request: Request) -> Response:
        ready = _body(request.body).get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgumentError("'ready' must be a boolean")
        return Response(200, COMPACT.encode(self._control().index(ready)).encode())

    async def load(self, request: Request) -> Response:
        if len(request.body) >= OFF_LOOP_BYTES:  # an upload: parse and decode off the loop
            config, files = await trio.to_thread.run_sync(_load_parameters, request.body)
        else:
            config, files = _load_parameters(request.body)
        await self._control().load(request.params["model"], config, files)
        return _DONE

    async def unload(self, request: Request) -> Response:
        dependents = _parameters(request.body).get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise InvalidArgumentError("parameter 'unload_dependents' must be a boolean")
        await self._control().unload(request.params["model"], dependents)
        return _DONE


def _body(body: bytes) -> dict[str, Any]:
    return json_object(body) if body.strip() else {}


def _parameters(body: bytes) -> dict[str, Any]:
    parameters = _body(body).get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgumentError("'parameters' must be a JSON object")
    return parameters


def _load_parameters(body: bytes) -> tuple[str | None, dict[str, bytes | UploadedFile]]:
    """A load request's config override and uploaded files."""
    parameters = _parameters(body)
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        raise InvalidArgumentError("parameter 'config' must be a JSON string")
    return config, decode_file_parameters(parameters)


def add_repository_routes(
    router: Router[Endpoint], repository: ModelRepository, restriction: Restriction | None
) -> None:
    e = _RepositoryEndpoints(repository)
    for path, endpoint in (
        ("/v2/repository/index", e.index),
        ("/v2/repository/models/{model}/load", e.load),
        ("/v2/repository/models/{model}/unload", e.unload),
    ):
        router.add("POST", path, _restricted(endpoint, restriction))
