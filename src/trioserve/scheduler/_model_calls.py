"""Calling user model code without blocking the event loop."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

import trio


async def call_hook(hook: Callable[[], Awaitable[None] | None]) -> None:
    """Run a load/unload hook: ``async`` ones in trio, plain ones in a worker thread."""
    if inspect.iscoroutinefunction(hook):
        await hook()
    else:
        await trio.to_thread.run_sync(hook)
