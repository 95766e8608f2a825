"""vLLM's v1 families as a table: names, types, help, buckets, and deprecations.

Deprecated names follow vLLM's policy: hidden unless ``--show-hidden-metrics-for-version``
names the (vLLM) release that deprecated them, and marked so in their help text. The
versions are vLLM's because the flag's values are meant to read the same as on vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


LENGTHS = "1-2-5 up to max_model_len"  # the buckets of the token-count histograms

# key: (type, name, help, buckets); counters get "_total" when exposed.
FAMILIES: dict[str, tuple[str, str, str, Any]] = {
    "running": (
        "gauge",
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        None,
    ),
    "waiting": (
        "gauge",
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        None,
    ),
    "kv_usage": (
        "gauge",
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        None,
    ),
    "prompt_tokens": ("counter", "vllm:prompt_tokens", "Number of prefill tokens processed.", None),
    "generation_tokens": (
        "counter",
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        None,
    ),
    "preemptions": (
        "counter",
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        None,
    ),
    "prefix_queries": (
        "counter",
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        None,
    ),
    "prefix_hits": (
        "counter",
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        None,
    ),
    "prompt_len": (
        "histogram",
        "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.",
        LENGTHS,
    ),
    "generation_len": (
        "histogram",
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        LENGTHS,
    ),
    "iteration_tokens": (
        "histogram",
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        ITERATION_TOKEN_BUCKETS,
    ),
    "max_generation": (
        "histogram",
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        LENGTHS,
    ),
    "params_n": (
        "histogram",
        "vllm:request_params_n",
        "Histogram of the n request parameter.",
        N_BUCKETS,
    ),
    "params_max_tokens": (
        "histogram",
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        LENGTHS,
    ),
    "ttft": (
        "histogram",
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        TTFT_BUCKETS,
    ),
    "inter_token": (
        "histogram",
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        TOKEN_LATENCY_BUCKETS,
    ),
    "per_output_token": (
        "histogram",
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        TOKEN_LATENCY_BUCKETS,
    ),
    "e2e": (
        "histogram",
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "queue": (
        "histogram",
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "inference": (
        "histogram",
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "prefill": (
        "histogram",
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "decode": (
        "histogram",
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    # Deprecated (see DEPRECATED): created only when shown.
    "old_hit_rate": (
        "gauge",
        "vllm:gpu_prefix_cache_hit_rate",
        "GPU prefix cache block hit rate.",
        None,
    ),
    "old_cache_usage": (
        "gauge",
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage.",
        None,
    ),
    "old_queries": (
        "counter",
        "vllm:gpu_prefix_cache_queries",
        "GPU prefix cache queries, in terms of number of queried tokens.",
        None,
    ),
    "old_hits": (
        "counter",
        "vllm:gpu_prefix_cache_hits",
        "GPU prefix cache hits, in terms of number of cached tokens.",
        None,
    ),
    "old_per_output_token": (
        "histogram",
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.",
        TOKEN_LATENCY_BUCKETS,
    ),
}
