"""Which server the running model code reaches, and through what.

Model code finds its ``Link`` (``_pb_link.ServerLink`` in the server's own process, the
stub's ``_pb_remote.RemoteLink`` in an instance process) through the ``serving``
context variable, set around each ``initialize``, ``execute`` and ``finalize``. This
module imports nothing but the standard library: instance processes import it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ._pb_tensors import TritonModelException


class Link(Protocol):
    """What ``pb_utils`` asks of the server. ``infer``, ``stream``, ``load``, ``unload``
    and ``model_ready`` describe a call; ``start`` runs one, handing its outcome to
    ``deliver`` (from another thread); ``wait`` runs one and blocks for its outcome."""

    def start(self, work: Callable[[], Any], deliver: Callable[[Any], None]) -> Callable[[], None]:
        """Run ``work()``'s call; returns a function that cancels it."""
        ...

    def wait(self, work: Callable[[], Any]) -> Any: ...

    def infer(self, request: Any, trace: Any) -> Any: ...

    def stream(self, request: Any, push: Callable[[Any, bool], None]) -> Any: ...

    def load(self, name: str, config: str, files: Mapping[str, bytes]) -> Any: ...

    def unload(self, name: str, unload_dependents: bool) -> Any: ...

    def model_ready(self, name: str, version: str) -> Any: ...


class Waiting:
    """``Link.wait`` made of ``start``: a thread blocks on an event the outcome sets."""

    def start(self, work: Callable[[], Any], deliver: Callable[[Any], None]) -> Callable[[], None]:
        raise NotImplementedError

    def wait(self, work: Callable[[], Any]) -> Any:
        """``work``'s result, from a thread that may block (never the event loop's)."""
        done = threading.Event()
        box: list[Any] = []

        def deliver(outcome: Any) -> None:
            box.append(outcome)
            done.set()

        self.start(work, deliver)
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]


@dataclass(frozen=True, slots=True)
class Serving:
    """The model whose code runs: the server it reaches and the folder of its model.py."""

    link: Link
    model_dir: Path


# The model running on this thread, on its asyncio loop, or in a thread it started with a
# copy of its context: where its BLS requests go.
serving: contextvars.ContextVar[Serving] = contextvars.ContextVar("serving")


def current(what: str) -> Serving:
    found = serving.get(None)
    if found is None:
        raise TritonModelException(
            f"{what} reaches the server only from a model's initialize, execute or finalize "
            "(or code they run with their context)"
        )
    return found
