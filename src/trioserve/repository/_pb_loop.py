"""The asyncio event loop of one Python-backend model instance.

Triton runs a model's ``async def execute`` on an asyncio loop of the model's own
process, so model code may use asyncio as it likes (``asyncio.gather`` over BLS calls,
``asyncio.sleep``, asyncio libraries). Here each instance gets one loop, in a thread of
its own, started the first time the instance hands it a coroutine: the instance's worker
thread submits the coroutine and waits for it, as Triton's stub does, while the loop
stays free for everything the coroutine starts. One loop per instance rather than
``asyncio.run`` per call keeps what a model creates on its loop (clients, tasks,
connections) alive from one call to the next, and lets a decoupled model's ``execute``
run on after the batch was handed back.
"""

from __future__ import annotations

import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported at a loop's start, not with the server
    import asyncio

_STOP_WAIT_S = 5.0  # how long an unload waits for the loop's thread to end


class InstanceLoop:
    """An asyncio loop in a daemon thread, started on first use."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> Future[Any]:
        """Run ``coroutine`` on the loop; the future is its outcome. The coroutine runs in
        a copy of the caller's context (``asyncio.run_coroutine_threadsafe`` takes it)."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self._started())

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coroutine`` on the loop and wait for its result (from another thread)."""
        return self.submit(coroutine).result()

    def _started(self) -> asyncio.AbstractEventLoop:
        import asyncio

        with self._lock:
            if self._loop is None:
                # A plain loop whatever the policy: trio-asyncio (the grpclib front end)
                # installs one whose loops belong to trio's thread.
                loop = asyncio.SelectorEventLoop()
                thread = threading.Thread(
                    target=self._run, args=(loop,), name=f"asyncio {self._name}", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        import asyncio

        while True:
            try:
                loop.run_forever()
                break  # stopped
            except (SystemExit, KeyboardInterrupt):
                # Model code raised it in a task: asyncio lets it out of the loop after
                # failing that task's future, whose caller reports it. The loop goes on.
                continue
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    def stop(self) -> None:
        """Stop the loop: tasks still running are cancelled. Waits a while for its thread."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_STOP_WAIT_S)
