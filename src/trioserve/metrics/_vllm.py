"""vLLM v1's Prometheus families for a generative model.

Names, types, buckets and the ``model_name`` label are vLLM's, so vLLM's Grafana
dashboards and the Kubernetes inference gateways work unchanged. Counters go through
prometheus_client, which exposes them with ``_total`` as vLLM's are.

Deprecated names follow vLLM's policy: hidden unless ``--show-hidden-metrics-for-version``
names the (vLLM) release that deprecated them, and marked so in their help text. The
versions are vLLM's because the flag's values are meant to read the same as on vLLM.

All metric objects belong to this instance (never the default registry); the server
registers ``collectors()`` in its own registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from ..scheduler._llm_stats import IterationStats

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class Deprecated:
    """A deprecated family: the vLLM release that deprecated it and what replaces it."""

    version: str
    replacement: str


# name -> deprecation; each is created only when its version is asked for.
DEPRECATED = {
    "vllm:gpu_prefix_cache_hit_rate": Deprecated("0.8", "vllm:prefix_cache_hits / queries"),
    "vllm:gpu_cache_usage_perc": Deprecated("0.9", "vllm:kv_cache_usage_perc"),
    "vllm:gpu_prefix_cache_queries": Deprecated("0.9", "vllm:prefix_cache_queries"),
    "vllm:gpu_prefix_cache_hits": Deprecated("0.9", "vllm:prefix_cache_hits"),
    "vllm:time_per_output_token_seconds": Deprecated("0.11", "vllm:inter_token_latency_seconds"),
}


def minor_version(version: str) -> str:
    """ "0.9.2" -> "0.9": deprecations are named by major.minor release."""
    return ".".join(version.lstrip("v").split(".")[:2])


@dataclass(frozen=True)
class EngineShape:
    """The engine's fixed settings that metrics describe."""

    model_name: str
    version: str
    block_size: int
    num_blocks: int
    prefix_caching: bool
    max_model_len: int
    max_num_seqs: int


class VllmMetrics:
    """One generative model version's families; ``record`` takes each IterationStats."""

    def __init__(
        self, shape: EngineShape, *, show_hidden_metrics_for_version: str | None = None
    ) -> None:
        self._collectors: list[Collector] = []
        shown = minor_version(show_hidden_metrics_for_version or "")
        self._hidden_shown = {n for n, d in DEPRECATED.items() if d.version == shown}
        name = shape.model_name
        lengths = buckets_1_2_5(shape.max_model_len)
        self.running = self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", name
        )
        self.waiting = self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", name
        )
        self.kv_usage = self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", name
        )
        self.prompt_tokens = self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", name
        )
        self.generation_tokens = self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", name
        )
        self.preemptions = self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", name
        )
        self.prefix_queries = self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            name,
        )
        self.prefix_hits = self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            name,
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=None,
        )
        self._collectors.append(success)
        self.success = {r: success.labels(name, r) for r in ("stop", "length", "abort")}
        self.prompt_len = self._histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", name, lengths
        )
        self.generation_len = self._histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            name,
            lengths,
        )
        self.iteration_tokens = self._histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            name,
            ITERATION_TOKEN_BUCKETS,
        )
        self.max_generation = self._histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            name,
            lengths,
        )
        self.params_n = self._histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", name, N_BUCKETS
        )
        self.params_max_tokens = self._histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            name,
            lengths,
        )
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            name,
            TTFT_BUCKETS,
        )
        self.inter_token = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            name,
            TOKEN_LATENCY_BUCKETS,
        )
        self.per_output_token = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            name,
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            name,
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = self._histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            name,
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = self._histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            name,
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = self._histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            name,
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = self._histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            name,
            REQUEST_LATENCY_BUCKETS,
        )
        self._deprecated(shape)
        self._cache_config_info(shape)

    def collectors(self) -> Sequence[Collector]:
        return tuple(self._collectors)

    def record(self, s: IterationStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_usage)
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.generation_tokens)
        self.preemptions.inc(s.preemptions)
        queried = sum(q for q, _ in s.prefix_lookups)
        hit = sum(h for _, h in s.prefix_lookups)
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)
        if s.num_batched_tokens:  # a step, not an abort between steps
            self.iteration_tokens.observe(s.num_batched_tokens)
        for ttft in s.time_to_first_token:
            self.ttft.observe(ttft)
        for interval in s.inter_token:
            self.inter_token.observe(interval)
            if self.old_per_output_token is not None:
                self.old_per_output_token.observe(interval)
        for f in s.finished:
            self.success[f.finish_reason].inc()
            self.e2e.observe(f.e2e)
            self.queue.observe(f.queue)
            self.prefill.observe(f.prefill)
            self.decode.observe(f.decode)
            self.inference.observe(f.inference)
            self.prompt_len.observe(f.prompt_tokens)
            self.generation_len.observe(f.generation_tokens)
            self.max_generation.observe(f.max_generation_tokens)
            self.params_n.observe(f.n)
            self.params_max_tokens.observe(f.max_tokens)
            if f.time_per_output_token is not None:
                self.per_output_token.observe(f.time_per_output_token)
        if self.old_cache_usage is not None:
            self.old_cache_usage.set(s.kv_usage)
        if self.old_queries is not None and self.old_hits is not None:
            self.old_queries.inc(queried)
            self.old_hits.inc(hit)

    def set_prefix_hit_rate(self, rate: float) -> None:
        """The deprecated hit-rate gauge (when shown) reads the stat logger's window."""
        if self.old_hit_rate is not None:
            self.old_hit_rate.set(rate)

    def _deprecated(self, shape: EngineShape) -> None:
        name = shape.model_name
        self.old_hit_rate = self._hidden_gauge(
            "vllm:gpu_prefix_cache_hit_rate", "GPU prefix cache block hit rate.", name
        )
        self.old_cache_usage = self._hidden_gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", name
        )
        self.old_queries = self._hidden_counter(
            "vllm:gpu_prefix_cache_queries",
            "GPU prefix cache queries, in terms of number of queried tokens.",
            name,
        )
        self.old_hits = self._hidden_counter(
            "vllm:gpu_prefix_cache_hits",
            "GPU prefix cache hits, in terms of number of cached tokens.",
            name,
        )
        self.old_per_output_token = None
        if "vllm:time_per_output_token_seconds" in self._hidden_shown:
            self.old_per_output_token = self._histogram(
                "vllm:time_per_output_token_seconds",
                _deprecated_help(
                    "vllm:time_per_output_token_seconds",
                    "Histogram of time per output token in seconds.",
                ),
                name,
                TOKEN_LATENCY_BUCKETS,
            )

    def _cache_config_info(self, shape: EngineShape) -> None:
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["model_name", "block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"],
            registry=None,
        )
        info.labels(
            shape.model_name,
            str(shape.block_size),
            "auto",
            str(shape.prefix_caching),
            str(shape.num_blocks),
        ).set(1)
        self._collectors.append(info)

    def _gauge(self, name: str, doc: str, model_name: str) -> Gauge:
        gauge = Gauge(name, doc, ["model_name"], registry=None)
        self._collectors.append(gauge)
        return gauge.labels(model_name)

    def _counter(self, name: str, doc: str, model_name: str) -> Counter:
        counter = Counter(name, doc, ["model_name"], registry=None)
        self._collectors.append(counter)
        return counter.labels(model_name)

    def _histogram(
        self, name: str, doc: str, model_name: str, buckets: Sequence[float]
    ) -> Histogram:
        histogram = Histogram(name, doc, ["model_name"], buckets=buckets, registry=None)
        self._collectors.append(histogram)
        return histogram.labels(model_name)

    def _hidden_gauge(self, name: str, doc: str, model_name: str) -> Gauge | None:
        if name not in self._hidden_shown:
            return None
        return self._gauge(name, _deprecated_help(name, doc), model_name)

    def _hidden_counter(self, name: str, doc: str, model_name: str) -> Counter | None:
        if name not in self._hidden_shown:
            return None
        return self._counter(name, _deprecated_help(name, doc), model_name)


def _deprecated_help(name: str, doc: str) -> str:
    d = DEPRECATED[name]
    return (
        f"{doc} DEPRECATED in {d.version}: use {d.replacement} instead; shown only with "
        f"--show-hidden-metrics-for-version={d.version}."
    )
