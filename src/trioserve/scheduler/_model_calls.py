"""Calling user model code without blocking the event loop, and without letting what it
raises stop the server.

Model code may raise any ``BaseException`` (``sys.exit``, ``KeyboardInterrupt``...):
each call here turns it into the ``Exception`` its caller fails the call with
(``_model_code.model_failure``), and every function here that runs model code on the
event loop is KI-protected, so that a real Ctrl-C is delivered to the main task rather
than raised inside the model's call (``_model_code`` says why that tells them apart).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import cast

import trio

from .._model import Model
from .._model_code import raise_failure

logger = logging.getLogger("trioserve.scheduler")


@trio.lowlevel.enable_ki_protection
async def call_hook(
    hook: Callable[[], Awaitable[None] | None],
    model: str,
    where: str,
    *,
    abandon_on_cancel: bool = False,
) -> None:
    """Run a load/unload hook: ``async`` ones in trio, plain ones in a worker thread.

    With ``abandon_on_cancel`` (a load), a cancelled call returns at once and leaves its
    thread to finish on its own: Python cannot stop a thread. Such threads run beside
    the default thread limiter (a limiter of their own each), so that hung loads never
    take the worker threads inference needs."""
    try:
        if inspect.iscoroutinefunction(hook):
            await hook()
        else:
            await trio.to_thread.run_sync(
                hook,
                abandon_on_cancel=abandon_on_cancel,
                limiter=trio.CapacityLimiter(1) if abandon_on_cancel else None,
            )
    except BaseException as exc:
        raise_failure(exc, model, where)


async def unload(model: Model, version: str) -> None:
    """Unload a version that stopped serving. A failing unload is logged and the server
    goes on: the version is out of service whatever its ``unload`` does."""
    try:
        await call_hook(model.unload, model.name, "in unload")
    except Exception as exc:
        logger.error("model '%s' version %s failed to unload: %s", model.name, version, exc)


Tokenizer = Callable[[str], list[int] | Awaitable[list[int]]]


@trio.lowlevel.enable_ki_protection
async def call_tokenizer(encode: Tokenizer, text: str, model: str) -> list[int]:
    """The tokens of ``text``: an ``async`` tokenizer runs in trio, a plain one in a worker
    thread, so that a slow one holds up only its own request. Cancelled, the call returns
    at once; the thread is left to finish and its tokens are dropped."""
    try:
        if inspect.iscoroutinefunction(encode):
            return list(await cast(Callable[[str], Awaitable[list[int]]], encode)(text))
        tokens = await trio.to_thread.run_sync(encode, text, abandon_on_cancel=True)
        return list(cast(list[int], tokens))
    except BaseException as exc:
        raise_failure(exc, model, "in its tokenizer")
