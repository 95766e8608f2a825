"""The TRT-LLM families that inference gateways read, for a generative model.

Gateways configured for Triton's TensorRT-LLM backend (the Kubernetes Gateway API
inference extension, llm-d) read the KV-cache fraction and the waiting and scheduled
request counts from these two gauges (labels ``model``, ``version``):

- ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max|free|used|tokens_per|
  reused|fraction}``: blocks in the cache, free, in use, tokens per block, blocks
  reused from the prefix cache (cumulative), and the fraction in use;
- ``nv_trt_llm_request_metrics{request_type=active|max|scheduled|context|waiting}``:
  requests in the engine, ``max_num_seqs``, sequences in the last step, those of them
  processing prompt tokens, and waiting requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Gauge
from prometheus_client.registry import Collector

from ..scheduler import IterationStats
from ._vllm import EngineShape

BLOCK_TYPES = ("max", "free", "used", "tokens_per", "reused", "fraction")
REQUEST_TYPES = ("active", "max", "scheduled", "context", "waiting")


class TrtLlmFamilies:
    """A server's two TRT-LLM families, shared by its generative model versions."""

    def __init__(self) -> None:
        self.blocks = Gauge(
            "nv_trt_llm_kv_cache_block_metrics",
            "TRT LLM KV cache block metrics",
            ["kv_cache_block_type", "model", "version"],
            registry=None,
        )
        self.requests = Gauge(
            "nv_trt_llm_request_metrics",
            "TRT LLM request metrics",
            ["request_type", "model", "version"],
            registry=None,
        )

    def collectors(self) -> Sequence[Collector]:
        return (self.blocks, self.requests)


class TrtLlmMetrics:
    """One generative model version's series (labelled with its model and version)."""

    def __init__(self, families: TrtLlmFamilies, shape: EngineShape) -> None:
        self.families = families
        labels = (shape.model_name, shape.version)
        self.blocks = {k: families.blocks.labels(k, *labels) for k in BLOCK_TYPES}
        self.requests = {k: families.requests.labels(k, *labels) for k in REQUEST_TYPES}
        self.blocks["max"].set(shape.num_blocks)
        self.blocks["free"].set(shape.num_blocks)
        self.blocks["tokens_per"].set(shape.block_size)
        self.requests["max"].set(shape.max_num_seqs)

    def record(self, s: IterationStats) -> None:
        self.blocks["used"].set(s.kv_used_blocks)
        self.blocks["free"].set(s.kv_total_blocks - s.kv_used_blocks)
        self.blocks["fraction"].set(s.kv_usage)
        self.blocks["reused"].inc(s.reused_blocks)
        self.requests["active"].set(s.num_running + s.num_waiting)
        self.requests["waiting"].set(s.num_waiting)
        if s.num_batched_tokens:  # a step, not an abort between steps
            self.requests["scheduled"].set(s.num_scheduled)
            self.requests["context"].set(s.num_prefilling)
