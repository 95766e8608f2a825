"""The server's gRPC front end on the HTTP/2 core: the method table (``_methods``) with
server reflection, served by ``_core.serve_methods``, its counters on ``/metrics``."""

from __future__ import annotations

import trio

from .._admission import Address, Departures
from .._context import ServerContext
from ..metrics import CountersCollector
from ._call import Method, StreamMethod
from ._core import serve_methods, tls_context
from ._h2_connection import H2Connection
from ._h2_guard import CoreStatistics, IdleRoster
from ._h2_transport import StreamTransport
from ._methods import grpc_methods
from ._reflection import REFLECTION_VERSIONS, reflection_handler, service_names


async def serve_grpc_core(
    context: ServerContext,
    *,
    task_status: trio.TaskStatus[list[Address]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The server's gRPC front end on its host and gRPC port, until cancelled or drained
    (``context.stop_accepting``)."""
    config = context.config
    assert config.grpc_port is not None
    tls = None
    if config.grpc_tls_certfile is not None and config.grpc_tls_keyfile is not None:
        tls = tls_context(config.grpc_tls_certfile, config.grpc_tls_keyfile)
    statistics = CoreStatistics()
    collector = CountersCollector("trioserve_grpc_", statistics, GRPC_COUNTERS)
    if context.registry is not None:
        context.registry.register(collector)
    try:
        await serve_methods(
            with_reflection(grpc_methods(context)),
            config.host,
            config.grpc_port,
            config.grpc_limits,
            max_message_bytes=config.grpc_max_message_bytes,
            tls=tls,
            statistics=statistics,
            shutdown_trigger=context.stop_accepting.wait,
            task_status=task_status,
        )
    finally:
        if context.registry is not None:
            context.registry.unregister(collector)


GRPC_COUNTERS = {
    "protocol_errors": "gRPC connections ended with GOAWAY for a protocol error",
    "stream_errors": "gRPC streams reset for a protocol error",
    "refused_streams": "gRPC streams refused (over the concurrency limit or after GOAWAY)",
    "calm_goaways": "gRPC connections ended for too many streams reset (by either side)",
    "idle_closed": "gRPC connections closed for being idle",
    "refused_connections": "gRPC connections closed at once for being over the connection limit",
    "idle_evicted": "idle gRPC connections closed to make room for new ones",
    "continuation_floods": "gRPC connections ended for too many CONTINUATION frames",
    "hpack_cache_evictions": "header blocks dropped from full HPACK caches (counted on close)",
    "outbox_pauses": "times a gRPC connection stopped reading while its client left bytes unread",
    "pending_pauses": (
        "times a streaming gRPC call waited for its connection's pending-bytes budget "
        "(counted on close)"
    ),
}


def with_reflection(methods: dict[str, Method]) -> dict[str, Method]:
    """``methods`` and server reflection (v1 and v1alpha), which lists them all."""
    names = service_names([*methods, *(version.path for version in REFLECTION_VERSIONS)])
    for version in REFLECTION_VERSIONS:
        handler = reflection_handler(version, names)
        methods[version.path] = StreamMethod(version.request_type, handler)
    return methods


async def serve_grpc_stream(context: ServerContext, stream: trio.abc.Stream) -> None:
    """Serve the server's gRPC methods on one connection over ``stream`` (HTTP/2 with
    prior knowledge, e.g. in memory: ``trioserve.testing.open_grpc_channel``) until the
    client leaves. Its counters are its own, on no ``/metrics``."""
    config = context.config
    methods = with_reflection(grpc_methods(context))
    connection = H2Connection(
        StreamTransport(stream), methods, config.grpc_limits, config.grpc_max_message_bytes,
        CoreStatistics(), IdleRoster(), Departures(),
    )  # fmt: skip
    await connection.run()
