"""The vLLM and TRT-LLM families as exposed text: names, buckets, labels, deprecations."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trioserve.metrics._llm_telemetry import LLMMetricFamilies
from trioserve.metrics._stat_logger import EngineStatLogger
from trioserve.metrics._trt_llm import TrtLlmFamilies, TrtLlmMetrics
from trioserve.metrics._vllm import EngineShape, VllmFamilies, VllmMetrics
from trioserve.metrics._vllm_names import buckets_1_2_5
from trioserve.models import TinyLM
from trioserve.scheduler._llm_stats import FinishedRequest, IterationStats

SHAPE = EngineShape(
    "m", "1", block_size=16, num_blocks=100, prefix_caching=True, max_model_len=1024, max_num_seqs=8
)


def _vllm(show_hidden=None) -> VllmMetrics:
    families = VllmFamilies(max_model_len=1024, show_hidden_metrics_for_version=show_hidden)
    return VllmMetrics(families, SHAPE)


def _exposed(*sources) -> dict[str, object]:
    registry = CollectorRegistry()
    for source in sources:
        for collector in source.collectors():
            registry.register(collector)
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _samples(family, name):
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == name}


def test_vllm_v1_families_and_buckets():
    families = _exposed(_vllm().families)
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    ):
        assert families[gauge].type == "gauge"
    for counter in (
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:num_preemptions",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
    ):
        assert families[counter].type == "counter"
        assert any(s.name == f"{counter}_total" for s in families[counter].samples)
    ttft = families["vllm:time_to_first_token_seconds"]
    les = [s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket")]
    assert les == [
        "0.001",
        "0.005",
        "0.01",
        "0.02",
        "0.04",
        "0.06",
        "0.08",
        "0.1",
        "0.25",
        "0.5",
        "0.75",
        "1.0",
        "2.5",
        "5.0",
        "7.5",
        "10.0",
        "20.0",
        "40.0",
        "80.0",
        "160.0",
        "640.0",
        "2560.0",
        "+Inf",
    ]
    assert all(s.labels["model_name"] == "m" for s in ttft.samples)
    prompt = families["vllm:request_prompt_tokens"]
    assert [s.labels["le"] for s in prompt.samples if s.name.endswith("_bucket")] == [
        "1.0",
        "2.0",
        "5.0",
        "10.0",
        "20.0",
        "50.0",
        "100.0",
        "200.0",
        "500.0",
        "1000.0",
        "+Inf",
    ]
    e2e = families["vllm:e2e_request_latency_seconds"]
    assert len([s for s in e2e.samples if s.name.endswith("_bucket")]) == 22
    iteration = families["vllm:iteration_tokens_total"]
    assert len([s for s in iteration.samples if s.name.endswith("_bucket")]) == 14
    reasons = _samples(families["vllm:request_success"], "vllm:request_success_total")
    assert {dict(k)["finished_reason"] for k in reasons} == {"stop", "length", "abort"}
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "100"
    assert info.value == 1


def test_buckets_1_2_5():
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(1) == [1]


@pytest.mark.parametrize(
    ("version", "shown"),
    [
        (None, set()),
        (
            "0.9",
            {
                "vllm:gpu_cache_usage_perc",
                "vllm:gpu_prefix_cache_queries",
                "vllm:gpu_prefix_cache_hits",
            },
        ),
        ("0.11.2", {"vllm:time_per_output_token_seconds"}),
        ("0.8", {"vllm:gpu_prefix_cache_hit_rate"}),
        ("0.10", set()),
    ],
)
def test_deprecated_families_are_hidden_unless_their_version_is_named(version, shown):
    families = _exposed(_vllm(version).families)
    deprecated = {
        name
        for name, family in families.items()
        if "DEPRECATED" in family.documentation and not name.endswith("_created")
    }
    assert deprecated == shown
    for name in shown:
        assert "--show-hidden-metrics-for-version=" in families[name].documentation


def _finished(reason, e2e):
    return FinishedRequest(reason, e2e, 0.1, 0.2, 0.3, 0.5, 0.05, 7, 4, 4, 1, 16)


def test_record_updates_vllm_and_trt_llm_families():
    metrics = _vllm("0.9")
    trt_llm = TrtLlmMetrics(TrtLlmFamilies(), SHAPE)
    stats = IterationStats(
        time=1.0,
        num_running=3,
        num_waiting=2,
        kv_used_blocks=25,
        kv_total_blocks=100,
        num_scheduled=3,
        num_prefilling=1,
        num_batched_tokens=40,
        prompt_tokens=7,
        generation_tokens=3,
        preemptions=1,
        prefix_lookups=((20, 16), (7, 0)),
        reused_blocks=1,
        time_to_first_token=(0.03,),
        inter_token=(0.02, 0.3),
        finished=(_finished("stop", 0.4), _finished("length", 3.0)),
    )
    metrics.record(stats)
    trt_llm.record(stats)
    families = _exposed(metrics.families, trt_llm.families)

    def value(name, sample=None, **labels):
        found = _samples(families[name], sample or name)
        return found[tuple(sorted({"model_name": "m", **labels}.items()))]

    assert value("vllm:num_requests_running") == 3
    assert value("vllm:kv_cache_usage_perc") == 0.25
    assert value("vllm:gpu_cache_usage_perc") == 0.25
    assert value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 27
    assert value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 16
    assert value("vllm:num_preemptions", "vllm:num_preemptions_total") == 1
    assert (
        value("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 1
    )
    itl = "vllm:inter_token_latency_seconds"
    assert value(itl, f"{itl}_bucket", le="0.025") == 1
    assert value(itl, f"{itl}_bucket", le="0.3") == 2
    e2e = "vllm:e2e_request_latency_seconds"
    assert value(e2e, f"{e2e}_bucket", le="0.5") == 1
    assert value(e2e, f"{e2e}_bucket", le="2.5") == 1 and value(e2e, f"{e2e}_bucket", le="5.0") == 2
    blocks = _samples(
        families["nv_trt_llm_kv_cache_block_metrics"], "nv_trt_llm_kv_cache_block_metrics"
    )
    by_kind = {dict(k)["kv_cache_block_type"]: v for k, v in blocks.items()}
    assert by_kind == {
        "max": 100,
        "free": 75,
        "used": 25,
        "tokens_per": 16,
        "reused": 1,
        "fraction": 0.25,
    }
    requests = _samples(families["nv_trt_llm_request_metrics"], "nv_trt_llm_request_metrics")
    by_type = {dict(k)["request_type"]: v for k, v in requests.items()}
    assert by_type == {"active": 5, "max": 8, "scheduled": 3, "context": 1, "waiting": 2}
    assert all(dict(k)["model"] == "m" and dict(k)["version"] == "1" for k in requests)


def _lookups(*pairs):
    return IterationStats(
        time=0.0,
        num_running=0,
        num_waiting=0,
        kv_used_blocks=0,
        kv_total_blocks=1,
        prefix_lookups=pairs,
    )


def test_the_log_hit_rate_covers_the_last_1000_queries():
    log = EngineStatLogger("m", 0.0)
    log.record(_lookups(*[(10, 10)] * 500))
    assert log.prefix_hit_rate == 1.0
    log.record(_lookups(*[(10, 0)] * 750))  # pushes out 250 of the hits
    assert log.prefix_hit_rate == pytest.approx(250 / 1000)


def test_the_deprecated_hit_rate_gauge_reads_the_log_window():
    metrics = _vllm("0.8")
    metrics.set_prefix_hit_rate(0.25)
    families = _exposed(metrics.families)
    rate = families["vllm:gpu_prefix_cache_hit_rate"]
    assert rate.samples[0].value == 0.25 and "DEPRECATED in 0.8" in rate.documentation


def _engine(running, used):
    return IterationStats(
        time=0.0,
        num_running=running,
        num_waiting=1,
        kv_used_blocks=used,
        kv_total_blocks=100,
        num_scheduled=running,
        num_batched_tokens=running,
    )


def test_the_families_show_from_the_first_generative_model_on():
    lm = TinyLM(num_kv_blocks=100)
    families = LLMMetricFamilies([lm])  # sized at startup, before any model is served
    registry = CollectorRegistry()
    registry.register(families)
    assert list(registry.collect()) == []
    families.telemetry(lm, "1")
    names = [family.name for family in registry.collect()]
    assert "vllm:num_requests_running" in names and "nv_trt_llm_request_metrics" in names
    assert len(names) == len(set(names))


def test_a_servers_generative_models_share_one_set_of_families():
    lm, other = TinyLM(num_kv_blocks=100), TinyLM("other_lm", num_kv_blocks=100)
    families = LLMMetricFamilies([lm, other])
    v1, v2 = families.telemetry(lm, "1"), families.telemetry(lm, "2")
    third = families.telemetry(other, "1")
    registry = CollectorRegistry()
    registry.register(families)
    v1.metrics.record(_engine(running=3, used=10))
    v2.metrics.record(_engine(running=2, used=30))
    third.metrics.record(_engine(running=7, used=50))
    v1.trt_llm.record(_engine(running=3, used=10))

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    # Versions of one model add up under its model_name, as one vLLM instance would.
    assert value("vllm:num_requests_running", model_name="tiny_lm") == 5
    assert value("vllm:num_requests_waiting", model_name="tiny_lm") == 2
    assert value("vllm:kv_cache_usage_perc", model_name="tiny_lm") == 0.2
    assert value("vllm:num_requests_running", model_name="other_lm") == 7
    # TRT-LLM series carry the version.
    assert (
        value(
            "nv_trt_llm_kv_cache_block_metrics",
            kv_cache_block_type="used",
            model="tiny_lm",
            version="1",
        )
        == 10
    )
    assert (
        value(
            "nv_trt_llm_kv_cache_block_metrics",
            kv_cache_block_type="used",
            model="tiny_lm",
            version="2",
        )
        == 0
    )


@pytest.mark.parametrize("models", [1, 2])
def test_load_gauges_lead_with_the_whole_server(models):
    """An endpoint picker that reads a family's first series sees the server's load."""
    lms = [TinyLM(f"lm{i}", num_kv_blocks=100) for i in range(models)]
    families = LLMMetricFamilies(lms)
    telemetry = [families.telemetry(lm, "1") for lm in lms]
    registry = CollectorRegistry()
    registry.register(families)
    for i, t in enumerate(telemetry):
        t.metrics.record(_engine(running=3 + i, used=10 + 30 * i))
    scraped = {
        f.name: f.samples
        for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    first = {
        name: (samples[0].labels["model_name"], samples[0].value, len(samples))
        for name, samples in scraped.items()
        if name
        in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    }
    if models == 1:  # the model's series is the server's: nothing added
        assert first == {
            "vllm:num_requests_running": ("lm0", 3, 1),
            "vllm:num_requests_waiting": ("lm0", 1, 1),
            "vllm:kv_cache_usage_perc": ("lm0", 0.1, 1),
        }
    else:
        assert first == {
            "vllm:num_requests_running": ("", 7, 3),
            "vllm:num_requests_waiting": ("", 2, 3),
            "vllm:kv_cache_usage_perc": ("", 0.25, 3),  # (10 + 40) of 200 blocks
        }
    info = {s.labels["model_name"]: s.labels for s in scraped["vllm:cache_config_info"]}
    assert info["lm0"]["block_size"] == "16" and info["lm0"]["num_gpu_blocks"] == "100"
