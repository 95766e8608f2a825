"""What a served model can tell about its own load (``ServedModel.load_facts``).

Load reports (``metrics/_orca.py``) ask every served model the same question and read
what it answers; they never look at what kind of model it is. A tensor model's runner
tells its queue, a generative model's engine its KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueState:
    """A runner's queue at one moment."""

    queued: int  # waiting in the queue
    executing: int  # model instances busy


@dataclass(frozen=True, slots=True)
class KVCacheState:
    """An engine's KV cache at one moment (what load reports and gauges show)."""

    total_blocks: int
    used_blocks: int
    block_size: int  # tokens per block

    @property
    def utilization(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def max_token_capacity(self) -> int:
        return self.total_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class LoadFacts:
    """What a model can tell, each as a function that reads it at the moment it is
    called; None: the model has no such thing to tell.

    A model with a KV cache whose figures are not known at the moment (its cache is not
    sized yet) answers None from ``kv_cache``: no load report goes out then, and the
    reason is logged.
    """

    queue: Callable[[], QueueState] | None = None
    kv_cache: Callable[[], KVCacheState | None] | None = None
    running: Callable[[], int] | None = None  # sequences a generative engine runs now
