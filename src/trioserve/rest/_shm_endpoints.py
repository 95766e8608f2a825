"""The shared-memory extension over REST: status, register and unregister, system and CUDA.

    GET  v2/{system,cuda}sharedmemory[/region/{name}]/status
    POST v2/{system,cuda}sharedmemory/region/{name}/register
    POST v2/{system,cuda}sharedmemory[/region/{name}]/unregister

When the "shared-memory" API group is restricted, a request without the expected header
answers 403 Forbidden (as Triton's restricted APIs do) and never reaches the registry.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from .._errors import InvalidArgumentError
from .._restricted import Restriction
from ..shm import SharedMemoryRegistry
from ._app import Endpoint, Request, Response
from ._errors import error_body
from ._json_body import COMPACT, json_object
from ._router import Router

_DONE = Response(200, content_type=None)
_FORBIDDEN = 403


class _SharedMemoryEndpoints:
    def __init__(self, registry: SharedMemoryRegistry) -> None:
        self.registry = registry

    async def system_status(self, request: Request) -> Response:
        return _json(self.registry.status("system", request.params.get("name", "")))

    async def system_register(self, request: Request) -> Response:
        body = json_object(request.body)
        self.registry.register_system(
            request.params["name"], body.get("key"), body.get("offset", 0), body.get("byte_size")
        )
        return _DONE

    async def system_unregister(self, request: Request) -> Response:
        self.registry.unregister("system", request.params.get("name", ""))
        return _DONE

    async def cuda_status(self, request: Request) -> Response:
        return _json(self.registry.status("cuda", request.params.get("name", "")))

    async def cuda_register(self, request: Request) -> Response:
        body = json_object(request.body)
        await self.registry.register_cuda(
            request.params["name"], _raw_handle(body.get("raw_handle")), body.get("device_id"),
            body.get("byte_size"),
        )  # fmt: skip
        return _DONE

    async def cuda_unregister(self, request: Request) -> Response:
        self.registry.unregister("cuda", request.params.get("name", ""))
        return _DONE


def add_shared_memory_routes(
    router: Router[Endpoint], registry: SharedMemoryRegistry, restriction: Restriction | None
) -> None:
    e = _SharedMemoryEndpoints(registry)
    for prefix, status, register, unregister in (
        ("/v2/systemsharedmemory", e.system_status, e.system_register, e.system_unregister),
        ("/v2/cudasharedmemory", e.cuda_status, e.cuda_register, e.cuda_unregister),
    ):
        region = f"{prefix}/region/{{name}}"
        for method, path, endpoint in (
            ("GET", f"{prefix}/status", status),
            ("GET", f"{region}/status", status),
            ("POST", f"{region}/register", register),
            ("POST", f"{prefix}/unregister", unregister),
            ("POST", f"{region}/unregister", unregister),
        ):
            router.add(method, path, _restricted(endpoint, restriction))


def _restricted(endpoint: Endpoint, restriction: Restriction | None) -> Endpoint:
    if restriction is None:
        return endpoint
    key = restriction.key.encode("latin-1")
    forbidden = Response(_FORBIDDEN, error_body(restriction.message()))

    async def guarded(request: Request) -> Response | None:
        value = request.headers.get(key)
        if not restriction.allows(None if value is None else value.decode("latin-1")):
            return forbidden
        return await endpoint(request)

    return guarded


def _json(document: Any) -> Response:
    return Response(200, COMPACT.encode(document).encode())


def _raw_handle(value: Any) -> bytes:
    """``{"b64": "<base64>"}`` -> the handle's bytes."""
    encoded = value.get("b64") if isinstance(value, dict) else None
    if not isinstance(encoded, str):
        raise InvalidArgumentError("'raw_handle' must be an object {\"b64\": <base64 string>}")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgumentError(f"'raw_handle' is not valid base64: {exc}") from None
