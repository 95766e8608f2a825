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

HANGUP_FD = "trioserve.hangup_fd"
"""A scope extension of our HTTP/1.1 core: ``{"fd": n}``, the connection's socket, which
the app may poll (never read) for the client's hangup while it works on a request; the
disconnect itself is still learnt through ``receive()``. One dict per connection, the same
for each of its requests, so the app may keep per-connection state in it under keys of
its own. Servers without it give no hint."""


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Complete the lifespan protocol: trioserve starts and stops its models itself."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
