"""The responses of one request to a decoupled model, from the model to the front end.

A decoupled model answers a request with any number of responses and then the final
flag, from ``execute`` or later, from its worker thread or from any thread it started.
``DecoupledResponses`` is the request's ``response_sender``: each ``send`` is handed to
the trio thread (``run_sync_soon``, which keeps the order of the sends), where the
runner turns the outputs into a response and the front end reads it from ``receive``.

The request's outcome (for statistics and the load report) is known once both the
final flag has arrived and ``execute`` has returned (the execution's times are then
known), or as soon as the request fails or its client cancels it: later sends are
dropped, and ``cancelled`` tells the model to stop.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import trio

from .._errors import InferenceServerError, InvalidArgumentError
from .._served import Answer

Deliver = Callable[[Mapping[str, Any] | Exception | None, bool], None]


class DecoupledResponses:
    """One request's responses (implements ``ResponseSender``)."""

    def __init__(self, deliver: Deliver) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._deliver: Deliver | None = deliver  # the runner's, called in the trio thread
        self._send, self.receive = trio.open_memory_channel[tuple[Answer, bool]](math.inf)
        self.final_sent = False  # set by the sender's thread, so that a second final fails
        self.final_delivered = False  # set in the trio thread
        self._closed = False

    @property
    def cancelled(self) -> bool:
        return self._closed

    def send(
        self, outputs: Mapping[str, Any] | Exception | None = None, *, final: bool = False
    ) -> None:
        if self.final_sent:
            raise InvalidArgumentError("the final response of this request was already sent")
        if final:
            self.final_sent = True
        # Once the server stopped there is nobody to answer.
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._handle, outputs, final)

    def _handle(self, outputs: Mapping[str, Any] | Exception | None, final: bool) -> None:
        if self._deliver is not None:
            self._deliver(outputs, final)

    def put(self, answer: Answer, final: bool) -> None:
        """Hand an answer to the reader (trio thread); dropped once closed."""
        if self._closed:
            return
        self._send.send_nowait((answer, final))
        if final:
            self.final_delivered = True
            self.close()

    def end(self, error: InferenceServerError | None) -> None:
        """The request has its outcome: end the stream (with ``error``, if it failed)."""
        if error is not None and not self._closed:
            self.put(error, True)
        self.close()

    def close(self) -> None:
        self._closed = True
        self._deliver = None  # it refers to the runner's ticket, which refers to this
        self._send.close()
