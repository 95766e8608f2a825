"""Prometheus collectors (Triton and vLLM families), the periodic stat logger, ORCA."""
