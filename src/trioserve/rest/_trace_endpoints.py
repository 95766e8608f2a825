"""The trace and logging extensions over REST.

    GET|POST v2/trace/setting                  the server's trace settings
    GET|POST v2/models/{model}/trace/setting   a model's (its overrides over the server's)
    GET|POST v2/logging                        the log settings

A POST names only the settings it changes (none: it only asks, as Triton's server
answers it), and answers every setting as it is now. A trace setting's value is a
string, or a list of strings (``trace_level``); null clears it. Restricted API groups "trace" and "logging" answer 403 without their header.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import InvalidArgumentError
from .._log_settings import LogControl
from .._restricted import Restriction
from .._served import ModelRepository
from ..tracing import TraceControl
from ._app import Endpoint, Request, Response
from ._json_body import json_object, json_object_or_empty
from ._router import Router
from ._shm_endpoints import _json, _restricted


class _TraceEndpoints:
    def __init__(self, tracing: TraceControl, repository: ModelRepository) -> None:
        self.tracing = tracing
        self.repository = repository

    def _model(self, request: Request) -> str:
        model = request.params.get("model", "")
        if model:
            self.repository.get(model)  # an unknown model is NOT_FOUND, as Triton's
        return model

    async def get(self, request: Request) -> Response:
        return _json(self.tracing.settings(self._model(request)))

    async def update(self, request: Request) -> Response:
        model = self._model(request)
        body = json_object_or_empty(request.body)
        changes = {key: _values(key, value) for key, value in body.items()}
        return _json(self.tracing.update(model, changes))


def _values(key: str, value: Any) -> Sequence[str] | None:
    """A setting's JSON value as the strings it holds (None: clear it)."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, int) and not isinstance(value, bool):  # a number for a string
        return [str(value)]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise InvalidArgumentError(f"trace setting '{key}' must be a string or a list of strings")


class _LogEndpoints:
    def __init__(self, logs: LogControl) -> None:
        self.logs = logs

    async def get(self, request: Request) -> Response:
        return _json(self.logs.settings())

    async def update(self, request: Request) -> Response:
        return _json(self.logs.update(json_object(request.body)))


def add_trace_routes(
    router: Router[Endpoint],
    tracing: TraceControl,
    repository: ModelRepository,
    restriction: Restriction | None,
) -> None:
    e = _TraceEndpoints(tracing, repository)
    for path in ("/v2/trace/setting", "/v2/models/{model}/trace/setting"):
        router.add("GET", path, _restricted(e.get, restriction))
        router.add("POST", path, _restricted(e.update, restriction))


def add_logging_routes(
    router: Router[Endpoint], logs: LogControl, restriction: Restriction | None
) -> None:
    e = _LogEndpoints(logs)
    router.add("GET", "/v2/logging", _restricted(e.get, restriction))
    router.add("POST", "/v2/logging", _restricted(e.update, restriction))
