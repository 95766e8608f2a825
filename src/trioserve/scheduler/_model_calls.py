"""Calling user model code without blocking the event loop."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import cast

import trio


async def call_hook(hook: Callable[[], Awaitable[None] | None]) -> None:
    """Run a load/unload hook: ``async`` ones in trio, plain ones in a worker thread."""
    if inspect.iscoroutinefunction(hook):
        await hook()
    else:
        await trio.to_thread.run_sync(hook)


Tokenizer = Callable[[str], list[int] | Awaitable[list[int]]]


async def call_tokenizer(encode: Tokenizer, text: str) -> list[int]:
    """The tokens of ``text``: an ``async`` tokenizer runs in trio, a plain one in a worker
    thread, so that a slow one holds up only its own request. Cancelled, the call returns
    at once; the thread is left to finish and its tokens are dropped."""
    if inspect.iscoroutinefunction(encode):
        return list(await cast(Callable[[str], Awaitable[list[int]]], encode)(text))
    tokens = await trio.to_thread.run_sync(encode, text, abandon_on_cancel=True)
    return list(cast(list[int], tokens))
