"""TraceControl's own duties: a stopping server waits for its last spans' export only so
long, and traces that end after it stopped writing are dropped, not raised."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from trioserve.tracing import Trace, TraceConfig, TraceControl
from trioserve.tracing._control import EXPORT_GRACE_S


class StuckExporter:
    """An exporter whose collector never answers: shutdown blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.collected: list[Trace] = []

    def context(self, headers: Mapping[Any, Any]) -> Mapping[str, str] | None:
        return None

    def collect(self, trace: Trace) -> None:
        self.collected.append(trace)

    def shutdown(self) -> None:
        self.release.wait()


async def test_a_stuck_export_holds_the_stop_for_the_grace_period_only(
    autojump_clock: Any,
) -> None:
    control = TraceControl(TraceConfig(level=("TIMESTAMPS",), rate=1))
    exporter = control._exporter = StuckExporter()
    try:
        start = trio.current_time()
        await control.close()
        assert trio.current_time() - start == EXPORT_GRACE_S
    finally:
        exporter.release.set()  # the abandoned thread ends


async def test_a_trace_ending_after_the_writer_stopped_is_dropped(
    autojump_clock: Any, tmp_path: Path
) -> None:
    path = tmp_path / "trace.json"
    config = TraceConfig(level=("TIMESTAMPS",), rate=1, file=str(path), log_frequency=1)
    control = TraceControl(config)
    late = control.sample("simple", "1")
    assert late is not None
    await control.close()
    assert not path.exists()  # nothing had ended
    late.end()  # the request finished after the server stopped writing: its file is not
    assert not (tmp_path / "trace.json.0").exists()
