"""The trace settings of a running server, who gets traced, and where traces go.

Triton's trace extension: settings are the server's, and a model may override any of
them; a setting a model does not override follows the server's, changes included.
Clearing a setting (null over REST, no value over gRPC) returns a model's to the
server's, and the server's to what the server started with (``--trace-config``).
``trace_count`` answers what is left of it: it counts down as traces are taken.

``sample`` is asked for each request only while some setting traces (``active``), so a
server that traces nothing spends one attribute read per request on tracing. A request
is traced when it is the ``trace_rate``-th since the last one, and ``trace_count`` is
not spent; in opentelemetry mode a request that carries a W3C ``traceparent`` is traced
whatever the rate and count, as Triton does, so that the client's trace continues.

``run`` is the server's task that writes trace files (in a worker thread) and, when it
stops, writes what is left and flushes the OpenTelemetry exporter.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import trio

from .._errors import InvalidArgumentError
from ._config import LEVELS, TraceConfig, check_level, traces_timestamps
from ._file import TraceFile, write_traces
from ._trace import Trace, TraceSink, trace_ids

Value = tuple[str, ...] | int | str
SettingsDocument = dict[str, list[str] | str]

# Setting name -> TraceConfig's field; trace_mode is read only (Triton's, too).
_FIELDS = {
    "trace_file": "file",
    "trace_level": "level",
    "trace_rate": "rate",
    "trace_count": "count",
    "trace_mode": "mode",
    "log_frequency": "log_frequency",
}
_TRITON_ONLY = ("trace_file", "log_frequency")  # not settings of opentelemetry mode
_MINIMUM = {"trace_rate": 0, "trace_count": -1, "log_frequency": 0}
EXPORT_GRACE_S = 5.0  # how long a stopping server waits for its last spans' export


class Exporter(TraceSink, Protocol):
    """The OpenTelemetry side (``_otel.OtelExporter``), imported only when chosen."""

    def context(self, headers: Mapping[Any, Any]) -> Mapping[str, str] | None: ...

    def shutdown(self) -> None: ...


class _Setting:
    """The resolved settings of the server or of one model that overrides some."""

    __slots__ = (
        "count", "file", "level", "log_frequency", "on", "rate", "sampled", "sink", "tensors",
    )  # fmt: skip

    def __init__(self, values: Mapping[str, Value]) -> None:
        self.level = cast(tuple[str, ...], values["trace_level"])
        self.rate = cast(int, values["trace_rate"])
        self.count = cast(int, values["trace_count"])
        self.file = cast(str, values["trace_file"])
        self.log_frequency = cast(int, values["log_frequency"])
        self.tensors = "TENSORS" in self.level
        self.sink: TraceSink | None = None  # set by TraceControl
        self.sampled = 0  # requests seen since the rate last took one
        self.on = traces_timestamps(self.level)  # the count is the rate's to check

    def take(self) -> bool:
        """Whether the request seen now is traced (rate and count)."""
        self.sampled += 1
        if not self.rate or self.sampled < self.rate or not self.count:
            return False
        self.sampled = 0
        if self.count > 0:
            self.count -= 1
        return True


class TraceControl:
    """A server's trace settings (Triton's trace extension) and its traces' sinks."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self.mode = config.mode
        self._startup: dict[str, Value] = {k: getattr(config, f) for k, f in _FIELDS.items()}
        self._server: dict[str, Value] = {}  # the server's settings updated since startup
        self._models: dict[str, dict[str, Value]] = {}  # each model's overrides
        self._ids = trace_ids()
        self._writes, self._to_write = trio.open_memory_channel[tuple[str, list[Trace]]](math.inf)
        self._files: dict[tuple[str, int], TraceFile] = {}
        self._exporter: Exporter | None = None
        if config.mode == "opentelemetry":
            from ._otel import OtelExporter  # the extra trioserve[tracing]

            self._exporter = OtelExporter(config)
        self._global = self._resolve({})
        self._by_model: dict[str, _Setting] = {}
        self.active = self._global.on

    # --- the extension's GET and POST ------------------------------------------------

    def settings(self, model: str = "") -> SettingsDocument:
        """The settings ``model`` is traced with (the server's for "")."""
        setting = self._by_model.get(model, self._global) if model else self._global
        document: SettingsDocument = {
            "trace_level": list(setting.level),
            "trace_rate": str(setting.rate),
            "trace_count": str(setting.count),
            "trace_mode": self.mode,
        }
        if self.mode == "triton":
            document["trace_file"] = setting.file
            document["log_frequency"] = str(setting.log_frequency)
        return document

    def update(self, model: str, changes: Mapping[str, Sequence[str] | None]) -> SettingsDocument:
        """Apply a POST's settings (None clears one). InvalidArgumentError leaves
        everything as it was."""
        parsed = {key: self._parse(key, values) for key, values in changes.items()}
        target = self._models.setdefault(model, {}) if model else self._server
        for key, value in parsed.items():
            if key == "trace_mode":
                continue  # the mode it already has, or a clear: nothing changes
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
        if model and not target:
            del self._models[model]
        self._rebuild()
        return self.settings(model)

    def _parse(self, key: str, values: Sequence[str] | None) -> Value | None:
        if key not in _FIELDS:
            raise InvalidArgumentError(f"unknown trace setting '{key}'")
        if values is None:
            return None
        if key in _TRITON_ONLY and self.mode != "triton":
            raise InvalidArgumentError(f"trace setting '{key}' is not used in {self.mode} mode")
        if key == "trace_level":
            try:
                levels = check_level(values)
            except ValueError:
                levels = ()
            if not levels:
                raise InvalidArgumentError(
                    f"trace_level must be one or more of {', '.join(LEVELS)}, got {list(values)}"
                )
            return levels
        if len(values) != 1:
            raise InvalidArgumentError(f"trace setting '{key}' takes one value")
        value = values[0]
        if key == "trace_mode":
            if value != self.mode:
                raise InvalidArgumentError(
                    f"trace_mode is {self.mode}; it is chosen when the server starts"
                )
            return value
        if key == "trace_file":
            return value
        try:
            number = int(value)
        except ValueError:
            number = _MINIMUM[key] - 1
        if number < _MINIMUM[key]:
            raise InvalidArgumentError(
                f"trace setting '{key}' must be an integer >= {_MINIMUM[key]}, got '{value}'"
            )
        return number

    def _rebuild(self) -> None:
        """Resolve every setting again after an update; what a setting has counted goes
        on while its rate and count stay the same."""
        previous = {"": self._global, **self._by_model}
        self._global = self._carry(self._resolve({}), previous[""])
        self._by_model = {
            model: self._carry(self._resolve(overrides), previous.get(model, self._global))
            for model, overrides in self._models.items()
        }
        in_use = {(s.file, s.log_frequency) for s in (self._global, *self._by_model.values())}
        for key in [k for k in self._files if k not in in_use]:
            self._files.pop(key).flush()  # Triton writes a file's traces when it changes
        self.active = any(s.on for s in (self._global, *self._by_model.values()))

    def _carry(self, new: _Setting, old: _Setting) -> _Setting:
        if new.rate == old.rate:
            new.sampled = old.sampled
        return new

    def _resolve(self, overrides: Mapping[str, Value]) -> _Setting:
        setting = _Setting({**self._startup, **self._server, **overrides})
        setting.sink = self._sink(setting.file, setting.log_frequency)
        return setting

    def _sink(self, file: str, log_frequency: int) -> TraceSink:
        if self._exporter is not None:
            return self._exporter
        key = (file, log_frequency)
        sink = self._files.get(key)
        if sink is None:
            sink = self._files[key] = TraceFile(*key, self._write)
        return sink

    def _write(self, path: str, traces: list[Trace]) -> None:
        # A request that ends after the server stopped writing: its trace is dropped.
        with contextlib.suppress(trio.ClosedResourceError):
            self._writes.send_nowait((path, traces))

    # --- the hot path ----------------------------------------------------------------

    def sample(
        self, model: str, version: str, headers: Mapping[Any, Any] | None = None
    ) -> Trace | None:
        """The trace of a request to ``model`` arriving now, if it is traced."""
        setting = self._by_model.get(model, self._global)
        if not setting.on:
            return None
        context = None
        if self._exporter is not None and headers is not None:
            context = self._exporter.context(headers)
        if context is None and not setting.take():
            return None
        assert setting.sink is not None
        return Trace(
            setting.sink, self._ids, model, version, trace_tensors=setting.tensors, context=context
        )

    # --- the server's task -----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write trace files as they fill; on the way out, write the rest and flush the
        exporter (in worker threads: neither blocks the event loop)."""
        task_status.started()
        try:
            async for path, traces in self._to_write:
                await trio.to_thread.run_sync(write_traces, path, traces)
        finally:
            with trio.CancelScope(shield=True):
                await self.close()

    async def close(self) -> None:
        for sink in self._files.values():
            sink.flush()
        self._writes.close()
        async for path, traces in self._to_write:
            await trio.to_thread.run_sync(write_traces, path, traces)
        if self._exporter is not None:
            # A collector that is down would hold the exporter in its retries: the server
            # stops after the grace period all the same, leaving the thread behind.
            with trio.move_on_after(EXPORT_GRACE_S):
                await trio.to_thread.run_sync(self._exporter.shutdown, abandon_on_cancel=True)
