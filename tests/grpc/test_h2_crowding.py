"""Idle connections cannot lock new clients out: past ``idle_close_share`` of the
connection limit, each new connection closes the one idle the longest with
GOAWAY(NO_ERROR). And the hardening's flags and counters."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import trio

import trioserve
from trioserve import ServerConfig
from trioserve._limits import GrpcLimits
from trioserve.grpc import _h2_frames as frames
from trioserve.grpc._h2_guard import CoreStatistics

OPENING = frames.PREFACE + frames.settings_frame([])


async def idle_connection(port: int, h2c: Any) -> trio.SocketStream:
    """A connection that opened HTTP/2 and then says nothing."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(OPENING)
    assert await h2c.next_frame(stream, frames.SETTINGS) is not None  # it is served
    return stream


async def test_new_clients_push_out_the_longest_idle(h2c: Any) -> None:
    statistics = CoreStatistics()
    # 4 connections at most; past 3 open, a new one closes the longest idle.
    limits = {"max_connections": 4, "statistics": statistics}
    async with h2c.core_server(h2c.small_methods(), **limits) as port:
        idle = [await idle_connection(port, h2c) for _ in range(3)]
        with trio.fail_after(5):
            await h2c.probe(port)  # the fourth: the first idle one gives way
            goaway = await h2c.next_frame(idle[0], frames.GOAWAY)
            assert goaway is not None
            assert struct.unpack(">LL", goaway[1][:8])[1] == frames.NO_ERROR
            assert await h2c.next_frame(idle[0], None) is None  # then closed
            # Over and over: the connection limit never refuses a new client while
            # idle ones hold its slots.
            for _ in range(4):
                await h2c.probe(port)
        assert statistics.refused_connections == 0
        assert statistics.idle_evicted >= 1
        for stream in idle:
            await stream.aclose()


def _task_names() -> list[str]:
    """The qualified names of every task's coroutine in this run."""
    names: list[str] = []
    tasks = [trio.lowlevel.current_root_task()]
    while tasks:
        task = tasks.pop()
        assert task is not None
        names.append(task.coro.cr_code.co_qualname)  # type: ignore[attr-defined]
        tasks.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return names


async def test_an_idle_connection_holds_no_writer_task(h2c: Any) -> None:
    # What an idle connection holds, a full garbage collection walks, thousands of times
    # over: the writer task is made only once the socket refuses part of a write.
    async with h2c.core_server(h2c.small_methods()) as port:
        idle = [await idle_connection(port, h2c) for _ in range(5)]
        with trio.fail_after(5):
            await h2c.probe(port)  # a call answered on a connection of its own
        names = _task_names()
        assert names.count("_CoreServer._serve") >= 5  # a task per connection
        assert names.count("Outbox.write_forever") == 0
        for stream in idle:
            await stream.aclose()


HARDENING = {
    "--grpc-idle-close-share": ("idle_close_share", "0.5", 0.5),
    "--grpc-max-reset-burst": ("max_reset_burst", "10", 10),
    "--grpc-resets-per-sec": ("resets_per_s", "2.5", 2.5),
    "--grpc-max-continuation-frames": ("max_continuation_frames", "4", 4),
    "--grpc-hpack-cache-bytes": ("hpack_cache_bytes", "1000", 1000),
    "--grpc-max-outbox-bytes": ("max_outbox_bytes", "65536", 65536),
    "--grpc-max-pending-bytes": ("max_pending_bytes", "123456", 123456),
    "--grpc-max-header-list-bytes": ("max_header_list_bytes", "4096", 4096),
    "--grpc-max-frame-bytes": ("max_frame_bytes", "16384", 16384),
    "--grpc-stream-window-bytes": ("stream_window_bytes", "70000", 70000),
    "--grpc-connection-window-bytes": ("connection_window_bytes", "65535", 65535),
}


@pytest.mark.parametrize("flag", sorted(HARDENING))
def test_each_bound_has_a_flag(flag: str) -> None:
    from trioserve._cli import _parser, config_from_args

    field, text, value = HARDENING[flag]
    default = config_from_args(_parser().parse_args(["run"])).grpc_limits
    assert getattr(default, field) == getattr(GrpcLimits(), field)
    config = config_from_args(_parser().parse_args(["run", flag, text]))
    assert getattr(config.grpc_limits, field) == value


async def test_the_counters_are_on_metrics(nursery: trio.Nursery) -> None:
    config = ServerConfig(http_port=None, grpc_port=0)
    server = await nursery.start(trioserve.serve, config)
    assert server.registry is not None
    for name in ("idle_evicted", "continuation_floods", "hpack_cache_evictions",
                 "outbox_pauses", "pending_pauses", "calm_goaways"):  # fmt: skip
        assert server.registry.get_sample_value(f"trioserve_grpc_{name}_total") == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"idle_close_share": 0.0},
        {"idle_close_share": 1.5},
        {"max_pending_bytes": -1},
        {"max_frame_bytes": 16_383},
        {"max_frame_bytes": 2**24},
        {"stream_window_bytes": 0},
        {"stream_window_bytes": 2**31},
        {"connection_window_bytes": 65_534},
        {"max_header_list_bytes": 0},
    ],
)
def test_bounds_out_of_range_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        GrpcLimits(**bad)
