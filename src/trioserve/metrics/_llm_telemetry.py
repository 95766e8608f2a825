"""What a server's generative models report: metric families, and one stats task each.

    LLMMetricFamilies              one per server: the vLLM and TRT-LLM families (the
                                   token-count buckets fit the largest max_model_len of
                                   the models known at startup, else of the first loaded)
    └── LLMTelemetry               one per generative model version: its children of
                                   those families, its periodic log line, and the task
                                   that reads its engine's IterationStats

The server registers its ``LLMMetricFamilies`` in its registry once, at startup. They
yield nothing until the first generative model version is served (joins them), so a
server that never serves one shows none of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import trio
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .._generative import GenerativeModel
from .._model import Model
from ..scheduler import IterationStats
from ._stat_logger import EngineStatLogger
from ._trt_llm import TrtLlmFamilies, TrtLlmMetrics
from ._vllm import EngineShape, VllmFamilies, VllmMetrics


class LLMMetricFamilies(Collector):
    """A server's LLM families, sized for ``models`` (the generative ones among them);
    a collector of the server's registry."""

    def __init__(
        self,
        models: Sequence[Model] = (),
        *,
        show_hidden_metrics_for_version: str | None = None,
    ) -> None:
        self._show_hidden = show_hidden_metrics_for_version
        lengths = [m.max_model_len for m in models if isinstance(m, GenerativeModel)]
        self._vllm = self._vllm_families(max(lengths)) if lengths else None
        self.trt_llm = TrtLlmFamilies()
        self._joined = False  # a generative model version has been served

    def _vllm_families(self, max_model_len: int) -> VllmFamilies:
        return VllmFamilies(
            max_model_len=max_model_len, show_hidden_metrics_for_version=self._show_hidden
        )

    @property
    def vllm(self) -> VllmFamilies:
        if self._vllm is None:
            raise RuntimeError("the vLLM families are made with the first telemetry")
        return self._vllm

    def telemetry(
        self, model: GenerativeModel, version: str, *, interval_s: float = 5.0
    ) -> LLMTelemetry:
        if self._vllm is None:  # no generative model was known at first: size for this one
            self._vllm = self._vllm_families(model.max_model_len)
        self._joined = True
        return LLMTelemetry(self, model, version, interval_s=interval_s)

    def collect(self) -> Iterator[Metric]:
        if not self._joined:
            return
        for collector in (*self.vllm.collectors(), *self.trt_llm.collectors()):
            yield from collector.collect()


class LLMTelemetry:
    """The stats task of one generative model version: its vLLM and TRT-LLM metrics and
    the periodic log."""

    def __init__(
        self,
        families: LLMMetricFamilies,
        model: GenerativeModel,
        version: str,
        *,
        interval_s: float,
    ) -> None:
        shape = EngineShape(
            model.name,
            version,
            model.block_size,
            model.num_kv_blocks,
            model.enable_prefix_caching,
            model.max_model_len,
            model.max_num_seqs,
        )
        self.metrics = VllmMetrics(families.vllm, shape)
        self.trt_llm = TrtLlmMetrics(families.trt_llm, shape)
        self.model_name = model.name
        self.interval_s = interval_s
        self.stat_logger: EngineStatLogger | None = None

    async def consume(self, stats: trio.MemoryReceiveChannel[IterationStats]) -> None:
        """Record every IterationStats as it comes; log every ``interval_s``."""
        now = trio.current_time()
        self.stat_logger = log = EngineStatLogger(self.model_name, now)
        next_log = now + self.interval_s
        while True:
            with trio.move_on_at(next_log):
                async for item in stats:
                    self.metrics.record(item)
                    self.trt_llm.record(item)
                    log.record(item)
                return  # the engine closed its side
            log.log(next_log)
            self.metrics.set_prefix_hit_rate(log.prefix_hit_rate)
            next_log += self.interval_s
