"""The Prometheus side: Triton's families and names, histograms, host metrics, registries.

Traffic runs through real runners under MockClock; the text each registry exposes is
read back with ``prometheus_client.parser``, as a scraper would.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import trio
import trio.testing
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from trioserve import DynamicBatching, InferenceRequest, InputTensor, MetricsConfig, TensorSpec
from trioserve import model as declare_model
from trioserve._served import ModelRepository
from trioserve._tensor import datatype
from trioserve.metrics import exposition, server_registry
from trioserve.metrics._system import CpuCollector, GpuCollector, gpu_collector
from trioserve.metrics._tasks import TaskCollector
from trioserve.scheduler._cache import ResponseCache
from trioserve.scheduler._runner import ModelRunner


@declare_model(
    name="sleepy",
    inputs=[TensorSpec("X", "FP32", [1])],
    outputs=[TensorSpec("Y", "FP32", [1])],
    max_batch_size=4,
    dynamic_batching=DynamicBatching(max_queue_delay_microseconds=1000),
)
async def sleepy(X):
    if (X < 0).any():
        raise ValueError("negative")
    await trio.sleep(0.002)
    return {"Y": X}


def request(value: float) -> InferenceRequest:
    data = np.full((1, 1), value, dtype=np.float32)
    return InferenceRequest("sleepy", "", {"X": InputTensor("X", datatype("FP32"), (1, 1), data)})


def families(text: bytes) -> dict[str, dict[tuple, float]]:
    """family name -> {(sample name, sorted labels): value}."""
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        samples = found.setdefault(family.name, {})
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


async def mixed_traffic(runner: ModelRunner) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        async with trio.open_nursery() as clients:
            for value in (1.0, 2.0, 3.0):
                clients.start_soon(runner.infer, request(value))
        with pytest.raises(Exception, match="negative"):
            await runner.infer(request(-1.0))
        await runner.infer(request(1.0))  # a cache hit where the cache is on
        nursery.cancel_scope.cancel()


async def test_triton_families_agree_with_the_statistics(autojump_clock):
    cached = ModelRunner(
        sleepy, "1", cache=ResponseCache(1 << 16), histogram_bounds_ns=(10**6, 5 * 10**6)
    )
    plain = ModelRunner(sleepy, "2", histogram_bounds_ns=(10**6, 5 * 10**6))
    repository = ModelRepository([cached, plain])
    await mixed_traffic(cached)
    await mixed_traffic(plain)
    text = exposition(server_registry(repository, MetricsConfig()))
    # Triton's counters carry no _total, and say they are counters.
    assert b"# TYPE nv_inference_count counter\n" in text
    names = {line.split(b"{")[0].split(b" ")[0] for line in text.splitlines()}
    assert not [n for n in names if n.startswith(b"nv_") and n.endswith(b"_total")]
    found = families(text)
    for runner in (cached, plain):
        s = runner.inference_statistics()
        labels = (("model", "sleepy"), ("version", s.version))

        def value(family, sample=None, extra=(), labels=labels):
            key = (sample or family + "_total", tuple(sorted(labels + extra)))
            return found[family][key]  # the parser adds _total to counter samples

        assert value("nv_inference_request_success") == s.success.count
        assert value("nv_inference_count") == s.inference_count
        assert value("nv_inference_exec_count") == s.execution_count
        assert value("nv_inference_request_duration_us") == s.success.ns / 1000
        assert value("nv_inference_queue_duration_us") == s.queue.ns / 1000
        assert value("nv_inference_compute_input_duration_us") == s.compute_input.ns / 1000
        assert value("nv_inference_compute_infer_duration_us") == s.compute_infer.ns / 1000
        assert value("nv_inference_compute_output_duration_us") == s.compute_output.ns / 1000
        for reason, count in s.failures.items():
            extra = (("reason", reason.value),)
            assert value("nv_inference_request_failure", extra=extra) == count
        pending = "nv_inference_pending_request_count"
        assert value(pending, pending) == 0
        hist = "trioserve_request_duration_seconds"
        assert value(hist, hist + "_count") == s.success.count
        assert value(hist, hist + "_sum") == pytest.approx(s.success.ns / 1e9)
        compute = "trioserve_compute_duration_seconds"
        assert value(compute, compute + "_bucket", (("le", "+Inf"),)) == s.compute_infer.count
    assert cached.inference_statistics().cache_hit.count == 1
    assert plain.inference_statistics().success.count == 4
    # 3 batched + 1 repeat: the plain version ran 1 failing + 2 more executions.
    assert plain.inference_statistics().execution_count == 2
    hits = found["nv_cache_num_hits_per_model"]
    assert hits == {
        ("nv_cache_num_hits_per_model_total", (("model", "sleepy"), ("version", "1"))): 1
    }
    queue = "trioserve_queue_duration_seconds"
    buckets = {
        dict(k[1])["le"]: v
        for k, v in found[queue].items()
        if k[0] == queue + "_bucket" and dict(k[1])["version"] == "2"
    }
    assert buckets == {"0.001": 4.0, "0.005": 4.0, "+Inf": 4.0}  # 1 ms delay, at most


async def test_other_collectors_keep_prometheus_clients_exposition(autojump_clock):
    repository = ModelRepository([ModelRunner(sleepy, "1")])
    registry = server_registry(repository, MetricsConfig(latency_histograms=False))
    tokens = Counter("custom_tokens", "Tokens", ["model_name"], registry=registry)
    tokens.labels(model_name="sleepy").inc(7)
    text = exposition(registry)
    # prometheus_client's own counters keep their usual exposition.
    assert b'custom_tokens_total{model_name="sleepy"} 7.0' in text
    assert b"# TYPE custom_tokens_total counter" in text
    assert b"trioserve_request_duration_seconds" not in text
    assert "nv_cpu_utilization" in families(text)


async def test_each_server_has_its_own_registry(autojump_clock):
    first, second = ModelRunner(sleepy, "1"), ModelRunner(sleepy, "1")
    registries = [server_registry(ModelRepository([r]), MetricsConfig()) for r in (first, second)]
    await mixed_traffic(first)
    counts = [
        families(exposition(r))["nv_inference_request_success"][
            ("nv_inference_request_success_total", (("model", "sleepy"), ("version", "1")))
        ]
        for r in registries
    ]
    assert counts == [4, 0]


def task_gauge() -> float:
    registry = server_registry(ModelRepository([]), MetricsConfig())
    return families(exposition(registry))["trioserve_tasks"][("trioserve_tasks", ())]


async def test_the_task_gauge_counts_every_task_of_the_run(autojump_clock):
    before = task_gauge()
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(3):  # one nested nursery deep, to count tasks below tasks
            nursery.start_soon(release.wait)
        async with trio.open_nursery() as inner:
            inner.start_soon(release.wait)
            await trio.testing.wait_all_tasks_blocked()  # the tasks start and park
            assert task_gauge() == before + 4
            release.set()
    assert task_gauge() == before


def test_no_task_gauge_outside_a_trio_run():
    assert list(TaskCollector().collect()) == []


def test_cpu_metrics_from_proc(tmp_path):
    stat = "cpu  {} 0 {} {} {} 0 0 0 0 0\ncpu0 1 2 3 4\n"
    (tmp_path / "stat").write_text(stat.format(100, 100, 700, 100))
    (tmp_path / "meminfo").write_text(
        "MemTotal:  1000 kB\nMemFree:  100 kB\nMemAvailable:  400 kB\n"
    )
    collector = CpuCollector(tmp_path)
    # Since the collector was made: 300 more busy jiffies out of 400.
    (tmp_path / "stat").write_text(stat.format(300, 200, 750, 150))
    values = {f.name: f.samples[0].value for f in collector.collect()}
    assert values == {
        "nv_cpu_utilization": 0.75,
        "nv_cpu_memory_total_bytes": 1000 * 1024,
        "nv_cpu_memory_used_bytes": 600 * 1024,
    }
    assert {f.name: f.samples[0].value for f in collector.collect()}["nv_cpu_utilization"] == 0.0
    assert list(CpuCollector(tmp_path / "missing").collect()) == []


def test_cpu_metrics_of_this_machine():
    collector = CpuCollector()
    sum(range(100_000))
    values = {f.name: f.samples[0].value for f in collector.collect()}
    assert 0.0 <= values["nv_cpu_utilization"] <= 1.0
    assert 0 < values["nv_cpu_memory_used_bytes"] <= values["nv_cpu_memory_total_bytes"]


def test_gpu_families_through_nvml():
    """NVML stands in for a GPU here: the families and labels Triton uses."""
    device = SimpleNamespace(uuid=b"GPU-1234", memory=SimpleNamespace(total=80, used=30))
    nvml = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda index: device,
        nvmlDeviceGetUUID=lambda d: d.uuid,
        nvmlDeviceGetMemoryInfo=lambda d: d.memory,
        nvmlDeviceGetUtilizationRates=lambda d: SimpleNamespace(gpu=42),
    )
    values = {
        (f.name, f.samples[0].labels["gpu_uuid"]): f.samples[0].value
        for f in GpuCollector(nvml).collect()
    }
    assert values == {
        ("nv_gpu_utilization", "GPU-1234"): 0.42,
        ("nv_gpu_memory_total_bytes", "GPU-1234"): 80,
        ("nv_gpu_memory_used_bytes", "GPU-1234"): 30,
    }


@pytest.mark.skipif(
    importlib.util.find_spec("pynvml") is not None, reason="NVML bindings installed"
)
def test_no_gpu_families_without_nvml():
    assert gpu_collector() is None


@pytest.mark.gpu
@pytest.mark.skipif(
    importlib.util.find_spec("pynvml") is None, reason="needs NVML bindings and a GPU"
)
def test_gpu_families_of_this_machine():
    collector = gpu_collector()
    if collector is None:
        pytest.skip("no GPU visible")
    names = {f.name for f in collector.collect()}
    assert names == {"nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes"}
