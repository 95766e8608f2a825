"""The trace settings a server starts with: ``--trace-config`` as tritonserver spells it.

    --trace-config level=TIMESTAMPS        OFF, TIMESTAMPS or TENSORS; repeat for both
    --trace-config rate=100                trace one request in every 100
    --trace-config count=10                stop after 10 traces (-1: never)
    --trace-config mode=triton             or opentelemetry
    --trace-config triton,file=/tmp/t.json
    --trace-config triton,log-frequency=50 write every 50 traces to file.0, file.1, ...
    --trace-config opentelemetry,url=http://collector:4318/v1/traces
    --trace-config opentelemetry,resource=service.name=inference
    --trace-config opentelemetry,bsp_max_queue_size=2048   (and bsp_schedule_delay in
                                           ms, bsp_max_export_batch_size)

The defaults are Triton's, but for the resource's ``service.name`` (``trioserve``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
DEFAULT_URL = "http://localhost:4318/v1/traces"


@dataclass(frozen=True)
class TraceConfig:
    level: tuple[str, ...] = ("OFF",)
    rate: int = 1000
    count: int = -1
    mode: Literal["triton", "opentelemetry"] = "triton"
    file: str = ""  # triton mode: where the traces go ("": nowhere)
    log_frequency: int = 0  # triton mode: traces per file; 0: one file, at shutdown
    url: str = DEFAULT_URL  # opentelemetry mode: the OTLP/HTTP receiver
    resource: Mapping[str, str] = field(default_factory=lambda: {"service.name": "trioserve"})
    bsp_max_queue_size: int = 2048
    bsp_schedule_delay_ms: int = 5000
    bsp_max_export_batch_size: int = 512

    def __post_init__(self) -> None:
        check_level(self.level)
        if self.mode not in MODES:
            raise ValueError(f"trace mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.rate < 0:
            raise ValueError("trace rate must be >= 0")
        if self.count < -1:
            raise ValueError("trace count must be >= -1")
        if self.log_frequency < 0:
            raise ValueError("trace log frequency must be >= 0")
        if self.bsp_max_queue_size < 1 or self.bsp_max_export_batch_size < 1:
            raise ValueError("bsp_max_queue_size and bsp_max_export_batch_size must be >= 1")
        if self.bsp_max_export_batch_size > self.bsp_max_queue_size:
            raise ValueError("bsp_max_export_batch_size must be <= bsp_max_queue_size")
        if self.bsp_schedule_delay_ms < 0:
            raise ValueError("bsp_schedule_delay must be >= 0")
        if self.mode == "opentelemetry" and not _exporter_installed():
            raise ValueError(
                "--trace-config mode=opentelemetry needs the extra trioserve[tracing] "
                "(opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"
            )


def _exporter_installed() -> bool:
    """Whether the OpenTelemetry SDK and its OTLP/HTTP exporter can be imported (found,
    not imported: they load only when a server starts in opentelemetry mode)."""
    try:
        return all(
            importlib.util.find_spec(name) is not None
            for name in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
        )
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_level(level: Iterable[str]) -> tuple[str, ...]:
    """The levels as given, checked: ValueError names an unknown one."""
    levels = tuple(level)
    for name in levels:
        if name not in LEVELS:
            raise ValueError(f"unknown trace level {name!r}; one of {', '.join(LEVELS)}")
    return levels


def traces_timestamps(level: tuple[str, ...]) -> bool:
    """Whether ``level`` traces anything (TENSORS traces timestamps too)."""
    return any(name != "OFF" for name in level)


# --trace-config's setting names -> TraceConfig's fields, by mode ("" for the global ones).
_INTEGERS = {
    ("", "rate"): "rate",
    ("", "count"): "count",
    ("triton", "log-frequency"): "log_frequency",
    ("opentelemetry", "bsp_max_queue_size"): "bsp_max_queue_size",
    ("opentelemetry", "bsp_schedule_delay"): "bsp_schedule_delay_ms",
    ("opentelemetry", "bsp_max_export_batch_size"): "bsp_max_export_batch_size",
}
_STRINGS = {("", "mode"): "mode", ("triton", "file"): "file", ("opentelemetry", "url"): "url"}


def trace_config_from_flags(flags: Iterable[str]) -> TraceConfig:
    """``--trace-config`` values, in order, over the defaults; ValueError if one is bad."""
    config = TraceConfig()
    changes: dict[str, Any] = {}
    levels: list[str] | None = None
    resource = dict(config.resource)
    for flag in flags:
        mode, comma, setting = flag.partition(",")
        if not comma:
            mode, setting = "", flag
        elif mode not in MODES:
            raise ValueError(f"--trace-config {flag!r}: unknown trace mode {mode!r}")
        key, equals, value = setting.partition("=")
        if not equals:
            raise ValueError(f"--trace-config {flag!r} is not [<mode>,]<setting>=<value>")
        if (mode, key) == ("", "level"):
            levels = [] if levels is None or value == "OFF" else levels
            levels.append(value)
        elif (mode, key) == ("opentelemetry", "resource"):
            name, equals, attribute = value.partition("=")
            if not name or not equals:
                raise ValueError(f"--trace-config {flag!r}: resource takes <key>=<value>")
            resource[name] = attribute
        elif (mode, key) in _INTEGERS:
            try:
                changes[_INTEGERS[mode, key]] = int(value)
            except ValueError:
                raise ValueError(f"--trace-config {flag!r}: {key} takes an integer") from None
        elif (mode, key) in _STRINGS:
            changes[_STRINGS[mode, key]] = value
        else:
            raise ValueError(f"--trace-config {flag!r}: unknown setting {key!r}")
    if levels is not None:
        changes["level"] = tuple(levels)
    return replace(config, resource=resource, **changes)
