"""Prometheus metrics (Triton's families, latency histograms, host metrics, vLLM and
TRT-LLM families), the periodic stat logger and ORCA load reports; one registry per
server instance."""

from ._counters import CountersCollector
from ._llm_telemetry import LLMMetricFamilies
from ._orca import FORMAT_HEADER, REPORT_HEADER, Counting, LoadReport, LoadReporter
from ._registry import CONTENT_TYPE, exposition, rendered, server_registry
from ._status import StatusReport

__all__ = [
    "CONTENT_TYPE",
    "FORMAT_HEADER",
    "REPORT_HEADER",
    "CountersCollector",
    "Counting",
    "LLMMetricFamilies",
    "LoadReport",
    "LoadReporter",
    "StatusReport",
    "exposition",
    "rendered",
    "server_registry",
]
