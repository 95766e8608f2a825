"""What a gRPC method is and what its handler sees of its call, whichever front end
carries it.

Apart from the method table (``_methods``) so that the modules its handlers live in
(``_stream``, ``_orca``) can name these types without importing the table back, and so
that the HTTP/2 core serves any table without importing the application.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from google.protobuf.message import Message


class Call(Protocol):
    """What a handler sees of its call, whichever front end carries it."""

    @property
    def metadata(self) -> Mapping[str, str]:
        """Request metadata by lower-case key; values of keys not ending in ``-bin`` as
        text (latin-1 decoded, never failing); ``-bin`` keys are left out."""
        ...

    def add_trailer(self, key: str, value: bytes) -> None:
        """Trailing metadata to send with the status; ``-bin`` keys carry raw bytes."""
        ...

    def cancel_with(self, withdraw: Callable[[], None] | None) -> None:
        """What to call if the client cancels the call while it waits (None: nothing).
        The built-in front end runs unary calls without a cancel scope of their own
        (one costs more than the rest of a small call), so a handler that waits on a
        model registers how to give up; grpclib's calls are cancelled as trio tasks."""
        ...


class MessageStream(Protocol):
    """A streaming call's messages, for trio code."""

    async def recv(self) -> Any | None:
        """The next request message (parsed); None once the client half-closed. Raises
        ``ClientGone``, or ``GrpcError`` for a message the front end could not take."""
        ...

    async def send(self, message: Reply) -> None:
        """Send one reply message. Raises ``ClientGone``."""
        ...


class ReplyInParts(Protocol):
    """A reply message already serialized as parts (a head, then raw tensor bytes), which
    a front end writes one after another and never joins (``_infer_wire.WireReply``).
    Whatever a handler returns that is not a protobuf ``Message`` is one of these."""

    parts: list[bytes | memoryview]

    def SerializeToString(self) -> bytes:
        """The parts joined, for a front end that needs one buffer."""
        ...


Reply: TypeAlias = "Message | ReplyInParts"


@dataclass(frozen=True)
class UnaryMethod:
    request_type: type[Message]  # the front end parses with ``FromString``
    handler: Callable[[Any, Call], Awaitable[Reply]]


@dataclass(frozen=True)
class StreamMethod:
    """Client- and server-streaming."""

    request_type: type[Message]
    handler: Callable[[MessageStream, Call], Awaitable[None]]


Method = UnaryMethod | StreamMethod
