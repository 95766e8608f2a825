"""ASGI 3 type aliases shared by the HTTP servers and the application.

Mappings rather than ``TypedDict``s: the servers build plain dicts, and applications written
against other ASGI servers' typing (Starlette uses the same shape) type-check unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeAlias

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Complete the lifespan protocol: trioserve starts and stops its models itself."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
