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

CancelWith: TypeAlias = Callable[[Callable[[], None] | None], None]
"""``cancel_with(withdraw)``: call ``withdraw`` if the client leaves while the request
waits; ``cancel_with(None)``: the wait is over. gRPC's ``Call.cancel_with`` contract."""

CANCEL_WITH = "trioserve.cancel_with"
"""A scope extension of our HTTP/1.1 core: ``{"cancel_with": CancelWith}``, the core's
watch for the client's hangup (``_http11_hangups.py``), one per connection, cleared at
the end of each response. Servers without it give none; the app then learns the
disconnect through ``receive()`` (``rest/_disconnects.py``)."""

RECEIVE_WHOLE = "trioserve.receive_whole"
"""A scope extension of our HTTP/1.1 core: ``{"receive": ReceiveWhole}``, a ``receive``
that hands a Content-Length body not yet read over whole, in one buffer filled from the
socket in place (no pieces to join): ``into(length)``'s, a writable byte buffer of
exactly ``length`` bytes, where ``into`` is given and gives one, else a ``bytearray``
allocated once at its length. For an app that holds the whole body anyway; other
messages are ``receive()``'s."""

BodyInto: TypeAlias = Callable[[int], memoryview | None]
ReceiveWhole: TypeAlias = Callable[[BodyInto | None], Awaitable[Message]]

BODY_PARTS = "trioserve.body_parts"
"""A scope extension of our HTTP/1.1 core (``{}``), and the type of the message it
allows: ``{"type": BODY_PARTS, "parts": [buffer, ...]}``, a whole response body given as
byte buffers (bytes, or 1-D byte memoryviews such as a tensor's), written with
``sendmsg`` as they are rather than joined first. In place of ``http.response.body``."""

COMPRESSED_IN_FRONT = "trioserve.compressed_in_front"
"""A scope extension (``{}``) of the calls a front-end worker forwards to the core: the
worker compresses a response as its client accepts, so the app does not. It sends every
response uncompressed and marks one it would have compressed with ``COMPRESSIBLE: True``
in its ``http.response.start`` message (whose body then comes whole, in one message)."""

COMPRESSIBLE = "trioserve.compressible"


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Complete the lifespan protocol: trioserve starts and stops its models itself."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
