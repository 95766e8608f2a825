"""The model repository extension over REST.

    POST v2/repository/index                  {"ready": bool}? -> [{name, version, state, reason}]
    POST v2/repository/models/{model}/load    {"parameters": {"config": JSON, "file:<path>": b64}}
    POST v2/repository/models/{model}/unload  {"parameters": {"unload_dependents": bool}}

A restricted "model-repository" API group answers 403 without the expected header.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import trio

from .._errors import InvalidArgumentError, UnsupportedError
from .._limits import OFF_LOOP_BYTES
from .._restricted import Restriction
from .._served import ModelRepository, RepositoryControl
from ._app import BodyPieces, Endpoint, ReadsBody, Request, Response
from ._json_body import COMPACT, json_object_or_empty
from ._load_body import LoadBody
from ._router import Router
from ._shm_endpoints import _restricted

_DONE = Response(200, content_type=None)
_SLICE = 1024 * 1024  # body bytes parsed at a time: a few MiB of memory at most


class _RepositoryEndpoints:
    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository

    def _control(self) -> RepositoryControl:
        if self.repository.control is None:
            raise UnsupportedError("this server has no model repository")
        return self.repository.control

    async def index(self, request: Request) -> Response:
        ready = json_object_or_empty(request.body).get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgumentError("'ready' must be a boolean")
        return Response(200, COMPACT.encode(self._control().index(ready)).encode())

    async def load(self, request: Request) -> Response:
        """The body is parsed as it arrives (``_load_body``), its files decoded into a
        staging folder that goes with the request; the load moves them into place."""
        assert request.pieces is not None  # a ReadsBody endpoint
        staging = Path(tempfile.mkdtemp(prefix="trioserve-upload-"))
        try:
            body = LoadBody(staging)
            try:
                await _parse(body, request.pieces)
                config, files = body.finish()
            finally:
                body.close()
            await self._control().load(request.params["model"], config, files)
        finally:
            # What a failed load left there may be hundreds of MiB: removed in a worker
            # thread, and even when the request is cancelled.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, staging, True)
        return _DONE

    async def unload(self, request: Request) -> Response:
        dependents = _parameters(request.body).get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise InvalidArgumentError("parameter 'unload_dependents' must be a boolean")
        await self._control().unload(request.params["model"], dependents)
        return _DONE


def _parameters(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    parameters = json_object_or_empty(body).get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgumentError("'parameters' must be a JSON object")
    return parameters


async def _parse(body: LoadBody, pieces: BodyPieces) -> None:
    """Feed ``body`` what arrives, a slice at a time; large slices are parsed and decoded
    in a worker thread, so that the event loop never waits on them."""
    batch: list[bytes] = []
    size = 0
    while True:
        piece = await pieces.next()
        batch.append(piece)
        size += len(piece)
        if size >= _SLICE or not piece:
            data = b"".join(batch)
            batch.clear()
            size = 0
            if len(data) >= OFF_LOOP_BYTES:
                await trio.to_thread.run_sync(body.feed, data)
            else:
                body.feed(data)
        if not piece:
            return


def add_repository_routes(
    router: Router[Endpoint], repository: ModelRepository, restriction: Restriction | None
) -> None:
    e = _RepositoryEndpoints(repository)
    for path, endpoint, reads_body in (
        ("/v2/repository/index", e.index, False),
        ("/v2/repository/models/{model}/load", e.load, True),
        ("/v2/repository/models/{model}/unload", e.unload, False),
    ):
        restricted = _restricted(endpoint, restriction)
        router.add("POST", path, ReadsBody(restricted) if reads_body else restricted)
