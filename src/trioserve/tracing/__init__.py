"""Triton's trace extension: settings, traces, the Triton trace file and the
OpenTelemetry exporter (``_otel``, imported only in opentelemetry mode)."""

from ._config import TraceConfig, trace_config_from_flags
from ._control import SettingsDocument, TraceControl
from ._trace import GenerationRecord, Trace, infer_child, now_ns

__all__ = [
    "GenerationRecord",
    "SettingsDocument",
    "Trace",
    "TraceConfig",
    "TraceControl",
    "infer_child",
    "now_ns",
    "trace_config_from_flags",
]
