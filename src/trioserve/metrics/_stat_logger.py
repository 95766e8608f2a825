"""The periodic engine log line.

Every ``interval_s`` (5 s) one line per generative model, at INFO, or at DEBUG when the
engine was idle for this interval and the one before (an idle server stays quiet)::

    tiny_lm: Avg prompt throughput: 12.8 tokens/s, Avg generation throughput: 409.6
    tokens/s, Running: 16 reqs, Waiting: 0 reqs, GPU KV cache usage: 7.4%, Prefix cache
    hit rate: 50.0%

Throughput is over the interval just ended; the prefix-cache hit rate is over the last
1000 queries (one query per admitted sequence, counted in tokens).
"""

from __future__ import annotations

import logging
from collections import deque

from ..scheduler import IterationStats

logger = logging.getLogger("trioserve.llm.stats")


class EngineStatLogger:
    def __init__(self, model_name: str, now: float, *, window: int = 1000) -> None:
        self.model_name = model_name
        self._since = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_busy = False
        self._latest: IterationStats | None = None
        self._queries: deque[tuple[int, int]] = deque(maxlen=window)

    def record(self, stats: IterationStats) -> None:
        self._prompt_tokens += stats.prompt_tokens
        self._generation_tokens += stats.generation_tokens
        self._queries.extend(stats.prefix_lookups)
        self._latest = stats

    @property
    def prefix_hit_rate(self) -> float:
        queried = sum(q for q, _ in self._queries)
        return sum(h for _, h in self._queries) / queried if queried else 0.0

    def log(self, now: float) -> None:
        elapsed = now - self._since
        prompt = self._prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation = self._generation_tokens / elapsed if elapsed > 0 else 0.0
        busy = bool(prompt or generation)
        level = logging.INFO if busy or self._last_busy else logging.DEBUG
        latest = self._latest
        logger.log(
            level,
            "%s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
            "tokens/s, Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            self.model_name,
            prompt,
            generation,
            latest.num_running if latest else 0,
            latest.num_waiting if latest else 0,
            100 * latest.kv_usage if latest else 0.0,
            100 * self.prefix_hit_rate,
        )
        self._last_busy = busy
        self._since = now
        self._prompt_tokens = self._generation_tokens = 0
