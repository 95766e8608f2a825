"""The statistics accumulators and their wire document, driven with explicit timestamps."""

from __future__ import annotations

import json

import pytest
from google.protobuf.json_format import ParseDict

from trioserve import MemoryUsage, MetricsConfig
from trioserve._cli import _parser, config_from_args
from trioserve._metrics_config import DEFAULT_HISTOGRAM_BUCKETS_S, metrics_config_from_flags
from trioserve._stats import ExecutionTimes, FailureReason, ModelStats, statistics_document
from trioserve.grpc._generated import grpc_service_pb2 as pb

US = 1000


def _busy_stats() -> ModelStats:
    stats = ModelStats("m", "3", histogram_bounds_ns=(10 * US, 100 * US))
    stats.memory_usage = (MemoryUsage("GPU", 1, 2048),)
    times = ExecutionTimes(dequeued_ns=50 * US, input_ready_ns=55 * US, executed_ns=85 * US,
                           output_ready_ns=87 * US)  # fmt: skip
    stats.executed(3, times)  # one batch of two requests, 1 + 2 rows
    stats.succeeded(0, 90 * US, 1, times)
    stats.succeeded(20 * US, 90 * US, 2, times)
    stats.cache_miss(4 * US)
    stats.cache_hit(100 * US, 103 * US, 2 * US)
    stats.failed(200 * US, 260 * US, FailureReason.CANCELED)
    return stats


def test_snapshot_follows_tritons_rules():
    s = _busy_stats().statistics(pending=7, response_cache=True)
    assert (s.inference_count, s.execution_count) == (3, 1)  # the cache hit is in neither
    assert (s.success.count, s.success.ns) == (3, 90 * US + 70 * US + 3 * US)
    assert (s.queue.count, s.queue.ns) == (3, 50 * US + 30 * US + 0)  # includes the hit
    assert (s.compute_input.count, s.compute_input.ns) == (2, 2 * 5 * US)
    assert (s.compute_infer.count, s.compute_infer.ns) == (2, 2 * 30 * US)
    assert (s.compute_output.count, s.compute_output.ns) == (2, 2 * 2 * US)
    assert (s.cache_hit.count, s.cache_hit.ns) == (1, 2 * US)
    assert (s.cache_miss.count, s.cache_miss.ns) == (1, 4 * US)
    assert (s.fail.count, s.fail.ns) == (1, 60 * US)
    assert s.failures[FailureReason.CANCELED] == 1 and sum(s.failures.values()) == 1
    assert [(b.batch_size, b.compute_infer.count, b.compute_infer.ns) for b in s.batch_stats] == [
        (3, 1, 30 * US)
    ]
    assert s.pending == 7 and s.response_cache
    # request durations 90, 70, 3 µs: one at or below 10 µs, two at or below 100 µs.
    assert s.histograms["request"].counts == (1, 2, 0)
    assert s.histograms["queue"].counts == (1, 2, 0)  # 50, 30 and the hit's 0 µs
    assert s.histograms["compute"].counts == (0, 2, 0)  # 37 µs each


def test_document_is_tritons_json_and_parses_as_the_proto():
    document = statistics_document([_busy_stats().statistics()])
    (stat,) = document["model_stats"]
    assert stat["name"] == "m" and stat["version"] == "3"
    assert set(stat) == {
        "name", "version", "last_inference", "inference_count", "execution_count",
        "inference_stats", "batch_stats", "memory_usage",
    }  # fmt: skip
    assert set(stat["inference_stats"]) == {
        "success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
        "cache_hit", "cache_miss",
    }  # fmt: skip
    assert stat["memory_usage"] == [{"type": "GPU", "id": 1, "byte_size": 2048}]
    assert stat["batch_stats"][0]["batch_size"] == 3
    # perf_analyzer reads every value with GetUint64: numbers, never strings.
    text = json.dumps(document)

    def numbers(value):
        if isinstance(value, dict):
            return all(numbers(v) for k, v in value.items() if k not in ("name", "version", "type"))
        if isinstance(value, list):
            return all(numbers(v) for v in value)
        return type(value) is int

    assert numbers(json.loads(text))
    message = ParseDict(document, pb.ModelStatisticsResponse())
    assert message.model_stats[0].inference_stats.compute_infer.ns == 60 * US
    assert message.model_stats[0].memory_usage[0].type == "GPU"


def test_a_value_on_a_bound_falls_in_that_bucket():
    stats = ModelStats("m", "1", histogram_bounds_ns=(10, 20))
    times = ExecutionTimes(10, 10, 20, 20)
    stats.executed(1, times)
    stats.succeeded(0, 30, 1, times)
    h = stats.statistics().histograms
    assert h["queue"].counts == (1, 0, 0)  # 10 ns <= 10
    assert h["compute"].counts == (1, 0, 0)  # 10 ns
    assert h["request"].counts == (0, 0, 1)  # 30 ns > 20: +Inf only
    assert ModelStats("m", "1").statistics().histograms == {}


def test_a_batch_recorded_together_adds_up_as_its_requests_one_by_one():
    bounds = (10 * US, 40 * US, 100 * US)
    times = ExecutionTimes(dequeued_ns=50 * US, input_ready_ns=52 * US, executed_ns=80 * US,
                           output_ready_ns=81 * US)  # fmt: skip
    arrivals = (0, 15 * US, 45 * US, 49 * US)
    sizes = (1, 2, 1, 4)
    one_by_one = ModelStats("m", "1", histogram_bounds_ns=bounds)
    for arrival, size in zip(arrivals, sizes, strict=True):
        one_by_one.succeeded(arrival, 81 * US, size, times)
    together = ModelStats("m", "1", histogram_bounds_ns=bounds)
    together.batch_succeeded(arrivals, 81 * US, sum(sizes), times)
    expected = one_by_one.statistics()
    assert together.statistics() == expected
    assert (expected.success.count, expected.success.ns) == (4, 4 * 81 * US - 109 * US)
    assert expected.histograms["queue"].counts == (2, 1, 1, 0)  # 1, 5, 35, 50 µs


def test_memory_usage_is_checked():
    with pytest.raises(ValueError, match="CPU, CPU_PINNED, GPU"):
        MemoryUsage("DISK", 0, 1)
    with pytest.raises(ValueError, match="byte_size"):
        MemoryUsage("CPU", 0, -1)


def test_metrics_config_and_flags():
    assert MetricsConfig().histogram_bounds_ns()[0] == 100_000
    assert len(MetricsConfig().histogram_bounds_ns()) == len(DEFAULT_HISTOGRAM_BUCKETS_S)
    assert MetricsConfig(latency_histograms=False).histogram_bounds_ns() == ()
    assert MetricsConfig(enabled=False).histogram_bounds_ns() == ()
    config = metrics_config_from_flags(
        allow=True, port=8002, options=["histogram_buckets=0.001,0.5", "histogram_latencies=true"]
    )
    assert config.port == 8002 and config.histogram_bounds_ns() == (1_000_000, 500_000_000)
    off = metrics_config_from_flags(allow=True, port=None, options=["histogram_latencies=false"])
    assert not off.latency_histograms
    for bad, message in [
        (["histogram_buckets=0.5,0.1"], "ascending"),
        (["histogram_buckets=0,1"], "positive"),
        (["histogram_buckets=a"], "numbers"),
        (["histogram_latencies=maybe"], "true or false"),
        (["summary_latencies=true"], "unknown"),
        (["histogram_buckets"], "KEY=VALUE"),
    ]:
        with pytest.raises(ValueError, match=message):
            metrics_config_from_flags(allow=True, port=None, options=bad)
    with pytest.raises(ValueError, match="port"):
        MetricsConfig(port=70000)


def test_cli_flags_for_metrics_and_the_cache():
    args = _parser().parse_args(
        [
            "run", "--metrics-port", "8002", "--metrics-config", "histogram_buckets=0.01,1",
            "--cache-config", "local,size=4096",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.metrics == MetricsConfig(port=8002, histogram_buckets_s=(0.01, 1.0))
    assert config.response_cache_bytes == 4096
    defaults = config_from_args(_parser().parse_args(["run"]))
    assert defaults.metrics == MetricsConfig() and defaults.response_cache_bytes == 0
    off = config_from_args(_parser().parse_args(["run", "--allow-metrics", "false"]))
    assert not off.metrics.enabled
    with pytest.raises(ValueError, match="local"):
        config_from_args(_parser().parse_args(["run", "--cache-config", "redis,size=1"]))
