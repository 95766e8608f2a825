"""A gRPC call's handler run on its HTTP/2 stream, and the stream ended with the
handler's status. The connection (``CallHost``) sends the replies and ends the stream.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import trio

from ._call import UnaryMethod
from ._errors import ClientGone, GrpcError, GrpcStatus, parse_message, status_of
from ._h2_stream import H2Stream


class CallHost(Protocol):
    async def send_reply(self, stream: H2Stream, message: Any) -> None: ...

    def finish_now(self, stream: H2Stream, status: GrpcStatus, message: str) -> None:
        """End the call with ``status`` (trailers), unless it ended already."""


async def run_call(host: CallHost, stream: H2Stream) -> None:
    """Run one call's handler and end the stream with its status.

    A unary call without a deadline runs with no cancel scope of its own: entering
    and leaving one costs about a fifth of a small call. A client's reset reaches
    it through ``Call.cancel_with`` (a model's ticket is withdrawn) or, at the
    latest, when its reply finds the stream reset. Streaming calls and calls with a
    deadline get a scope, which a reset cancels.
    """
    if stream.reset:
        return
    method = stream.method
    status, message = GrpcStatus.OK, ""
    try:
        if isinstance(method, UnaryMethod) and stream.deadline is None:
            await _answer_unary(host, stream, method)
        else:
            deadline = math.inf if stream.deadline is None else stream.deadline
            with trio.CancelScope(deadline=deadline) as scope:
                stream.scope = scope
                if isinstance(method, UnaryMethod):
                    await _answer_unary(host, stream, method)
                else:
                    await method.handler(stream, stream)
            if scope.cancelled_caught:
                if stream.reset:
                    return
                status, message = GrpcStatus.DEADLINE_EXCEEDED, "Deadline Exceeded"
    except ClientGone:
        return
    except Exception as exc:
        status, message = status_of(exc)
    if not stream.reset:
        host.finish_now(stream, status, message)


async def _answer_unary(host: CallHost, stream: H2Stream, method: UnaryMethod) -> None:
    data = stream.take()
    if data is None:
        raise GrpcError(GrpcStatus.INVALID_ARGUMENT, "the call carried no request message")
    reply = await method.handler(parse_message(method.request_type, data), stream)
    await host.send_reply(stream, reply)
