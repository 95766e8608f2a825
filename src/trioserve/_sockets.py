"""Listening sockets for the front ends that drive sockets themselves (the HTTP/1.1 core
and the HTTP/2 core): binding every address of a host name, and the task tree both serve
in. Accepting (fairly, whatever crowd arrives) is ``_admission.py``'s."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from functools import partial

import trio
from trio.lowlevel import notify_closing

from ._admission import Accepted, Address, Greeting, accept_forever

_BACKLOG = 4096  # the listen queue asked for; the kernel caps it (net.core.somaxconn)


async def bind_tcp(host: str, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """Non-blocking listening sockets on every address ``host`` names, one port for all
    (port 0 picks a free one). ``reuse_port``: with ``SO_REUSEPORT``, so that several
    sets bound to the same port share its connections (the kernel spreads them)."""
    infos = await trio.socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    seen: set[object] = set()
    try:
        for family, type_, proto, _, addr in infos:
            if addr in seen:
                continue
            seen.add(addr)
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                # One ephemeral port for every address of the host name, not one each.
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        close_all(sockets)
        raise
    return sockets


def bound_addresses(listeners: list[socket.socket]) -> list[Address]:
    return [(s.getsockname()[0], s.getsockname()[1]) for s in listeners]


def close_all(listeners: list[socket.socket]) -> None:
    for listener in listeners:
        if listener.fileno() != -1:
            notify_closing(listener)
            listener.close()


async def serve_tcp(
    host: str,
    port: int,
    accepted: Callable[[trio.Nursery], Accepted],
    sweep: Callable[[], Awaitable[object]],
    begin_shutdown: Callable[[], None],
    *,
    greeting: Greeting | None = None,
    max_pending: int,
    evicted: Callable[[], object],
    shutdown_trigger: Callable[[], Awaitable[object]] | None,
    listeners: list[socket.socket] | None = None,
    task_status: trio.TaskStatus[list[Address]],
) -> None:
    """Accept on ``host:port`` until cancelled or shut down; a core's task tree.

    ``accepted(connections)`` gives what starts each connection in ``connections``;
    ``greeting`` greets each socket as it is accepted, and at most ``max_pending`` wait
    to start (``_admission.accept_forever``; ``evicted`` counts the quiet ones closed
    to make room). ``sweep`` runs beside them (the core's timeouts). When ``shutdown_trigger`` returns:
    the listeners close, ``begin_shutdown`` tells the connections, and this returns once
    every connection has ended. ``listeners``: sockets bound already (a front-end worker
    process's, handed over by the process that bound them), used instead of binding.
    """
    if listeners is None:
        listeners = await bind_tcp(host, port)
    try:
        async with trio.open_nursery() as sweeper:
            sweeper.start_soon(sweep)
            async with trio.open_nursery() as connections:
                start = accepted(connections)
                async with trio.open_nursery() as acceptors:
                    for listener in listeners:
                        accept = partial(
                            accept_forever, greeting=greeting, max_pending=max_pending,
                            evicted=evicted,
                        )  # fmt: skip
                        acceptors.start_soon(accept, listener, start)
                    task_status.started(bound_addresses(listeners))
                    if shutdown_trigger is not None:
                        await shutdown_trigger()
                        acceptors.cancel_scope.cancel()
                close_all(listeners)
                begin_shutdown()
            sweeper.cancel_scope.cancel()  # every connection has ended
    finally:
        close_all(listeners)
