"""A real server on its own thread, for synchronous clients such as ``tritonclient``."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from .._config import ServerConfig
from .._server import Server, open_server


@contextmanager
def server_in_thread(config: ServerConfig, *, start_timeout_s: float = 60.0) -> Iterator[Server]:
    """Run ``config`` in ``trio.run`` on a thread; yields the running ``Server``.

    Leaving the block shuts the server down and joins the thread. Use ports of 0 and read
    ``server.http_port`` / ``server.grpc_port``.
    """
    handoff: queue.Queue[tuple[Server, trio.lowlevel.TrioToken, trio.Event] | BaseException]
    handoff = queue.Queue()

    async def main() -> None:
        async with open_server(config) as server:
            stop = trio.Event()
            handoff.put((server, trio.lowlevel.current_trio_token(), stop))
            await stop.wait()

    def target() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported to the caller, who is waiting on handoff
            handoff.put(exc)

    thread = threading.Thread(target=target, name="trioserve", daemon=True)
    thread.start()
    started = handoff.get(timeout=start_timeout_s)
    if isinstance(started, BaseException):
        raise RuntimeError("the server failed to start") from started
    server, token, stop = started
    try:
        yield server
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(timeout=start_timeout_s)
