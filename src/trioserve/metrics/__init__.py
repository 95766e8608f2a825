"""Prometheus metrics (Triton's families, latency histograms, host metrics, vLLM and
TRT-LLM families), the periodic stat logger and ORCA load reports; one registry per
server instance."""

from ._registry import CONTENT_TYPE, exposition, server_registry

__all__ = ["CONTENT_TYPE", "exposition", "server_registry"]
