"""vLLM v1's Prometheus families for a generative model.

Names, types, buckets and the ``model_name`` label are vLLM's, so vLLM's Grafana
dashboards and the Kubernetes inference gateways work unchanged. Counters go through
prometheus_client, which exposes them with ``_total`` as vLLM's are.

Deprecated names (see ``_vllm_names``) exist only when shown.

A server has one set of families (``VllmFamilies``, never the default registry),
shared by all its generative model versions: each version binds its ``model_name``
children (``VllmMetrics``). Versions of one model add into the same series; the gauges
show their sum (running, waiting) or their blocks together (KV-cache usage). The
token-count histograms take their 1-2-5 buckets from the largest ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from ..scheduler import IterationStats
from ._vllm_names import DEPRECATED, FAMILIES, LENGTHS, buckets_1_2_5, minor_version


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


class VllmFamilies:
    """A server's vLLM families, shared by its generative model versions."""

    def __init__(
        self, *, max_model_len: int, show_hidden_metrics_for_version: str | None = None
    ) -> None:
        shown = minor_version(show_hidden_metrics_for_version or "")
        lengths = buckets_1_2_5(max_model_len)
        self.families: dict[str, Any] = {}
        for key, (kind, name, doc, buckets) in FAMILIES.items():
            deprecation = DEPRECATED.get(name)
            if deprecation is not None:
                if deprecation.version != shown:
                    continue
                doc = (
                    f"{doc} DEPRECATED in {deprecation.version}: use "
                    f"{deprecation.replacement} instead; shown only with "
                    f"--show-hidden-metrics-for-version={deprecation.version}."
                )
            if kind == "gauge":
                self.families[key] = Gauge(name, doc, ["model_name"], registry=None)
            elif kind == "counter":
                self.families[key] = Counter(name, doc, ["model_name"], registry=None)
            else:
                self.families[key] = Histogram(
                    name,
                    doc,
                    ["model_name"],
                    registry=None,
                    buckets=lengths if buckets is LENGTHS else buckets,
                )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=None,
        )
        self.cache_config_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["model_name", "block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"],
            registry=None,
        )
        # model name -> version -> (running, waiting, used blocks, total blocks), the
        # latest of each version, for the gauges that add versions up.
        self.engines: dict[str, dict[str, tuple[int, int, int, int]]] = {}

    def collectors(self) -> Sequence[Collector]:
        load = {"running": 0, "waiting": 1, "kv_usage": None}
        return (
            *(
                _ServerSeriesFirst(family, self.engines, load[key]) if key in load else family
                for key, family in self.families.items()
            ),
            self.success,
            self.cache_config_info,
        )


class _ServerSeriesFirst:
    """A load gauge with the whole server's series first when it serves several models.

    Endpoint pickers that read one series of a family (the Gateway API inference
    extension's takes the first when there are no timestamps) then score the server,
    not whichever model happens to come first. The server series has
    ``model_name=""``: running and waiting requests summed over every model, KV-cache
    usage as all their used blocks over all their blocks. With one model its series is
    already the server's, and no other is added.
    """

    def __init__(
        self,
        gauge: Gauge,
        engines: dict[str, dict[str, tuple[int, int, int, int]]],
        field: int | None,  # which figure of an engine's tuple; None: the KV-cache usage
    ) -> None:
        self._gauge = gauge
        self._engines = engines
        self._field = field

    def collect(self) -> Iterator[Metric]:
        for family in self._gauge.collect():
            if len(self._engines) > 1:
                figures = [f for versions in self._engines.values() for f in versions.values()]
                if self._field is None:
                    total = sum(f[3] for f in figures)
                    value = sum(f[2] for f in figures) / total if total else 0.0
                else:
                    value = float(sum(f[self._field] for f in figures))
                family.samples.insert(0, Sample(family.name, {"model_name": ""}, value))
            yield family


@dataclass
class VllmMetrics:
    """One generative model version's children of the server's vLLM families."""

    families: VllmFamilies
    shape: EngineShape
    children: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        name = self.shape.model_name
        self.children = {k: f.labels(name) for k, f in self.families.families.items()}
        self.success = {
            r: self.families.success.labels(name, r) for r in ("stop", "length", "abort")
        }
        self.families.cache_config_info.labels(
            name,
            str(self.shape.block_size),
            "auto",
            str(self.shape.prefix_caching),
            str(self.shape.num_blocks),
        ).set(1)
        self._engines = self.families.engines.setdefault(name, {})
        self._engines[self.shape.version] = (0, 0, 0, self.shape.num_blocks)

    def record(self, s: IterationStats) -> None:
        c = self.children
        self._engines[self.shape.version] = (
            s.num_running,
            s.num_waiting,
            s.kv_used_blocks,
            s.kv_total_blocks,
        )
        running, waiting, used, total = (sum(v) for v in zip(*self._engines.values(), strict=True))
        c["running"].set(running)
        c["waiting"].set(waiting)
        c["kv_usage"].set(used / total if total else 0.0)
        c["prompt_tokens"].inc(s.prompt_tokens)
        c["generation_tokens"].inc(s.generation_tokens)
        c["preemptions"].inc(s.preemptions)
        queried = sum(q for q, _ in s.prefix_lookups)
        hit = sum(h for _, h in s.prefix_lookups)
        c["prefix_queries"].inc(queried)
        c["prefix_hits"].inc(hit)
        if s.num_batched_tokens:  # a step, not an abort between steps
            c["iteration_tokens"].observe(s.num_batched_tokens)
        for ttft in s.time_to_first_token:
            c["ttft"].observe(ttft)
        for interval in s.inter_token:
            c["inter_token"].observe(interval)
        for f in s.finished:
            self.success[f.finish_reason].inc()
            c["e2e"].observe(f.e2e)
            c["queue"].observe(f.queue)
            c["prefill"].observe(f.prefill)
            c["decode"].observe(f.decode)
            c["inference"].observe(f.inference)
            c["prompt_len"].observe(f.prompt_tokens)
            c["generation_len"].observe(f.generation_tokens)
            c["max_generation"].observe(f.max_generation_tokens)
            c["params_n"].observe(f.n)
            c["params_max_tokens"].observe(f.max_tokens)
            if f.time_per_output_token is not None:
                c["per_output_token"].observe(f.time_per_output_token)
        self._record_deprecated(s, used / total if total else 0.0, queried, hit)

    def _record_deprecated(self, s: IterationStats, usage: float, queried: int, hit: int) -> None:
        """The deprecated families that are shown (most often none)."""
        c = self.children
        if "old_cache_usage" in c:
            c["old_cache_usage"].set(usage)
        if "old_queries" in c:
            c["old_queries"].inc(queried)
            c["old_hits"].inc(hit)
        if "old_per_output_token" in c:
            for interval in s.inter_token:
                c["old_per_output_token"].observe(interval)

    def set_prefix_hit_rate(self, rate: float) -> None:
        """The deprecated hit-rate gauge (when shown) reads the stat logger's window."""
        if "old_hit_rate" in self.children:
            self.children["old_hit_rate"].set(rate)
