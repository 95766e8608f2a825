"""A model's dynamic batching settings as its batcher's policy (``_batching``, which
stays free of the model's code)."""

from __future__ import annotations

from .._model import Model
from ._batching import BatchingPolicy


def policy_for(model: Model) -> BatchingPolicy:
    """The policy of ``model``'s dynamic batcher, from its settings."""
    batching = model.dynamic_batching
    if batching is None:
        return BatchingPolicy(batching=False)
    if not model.batches:  # the queue settings still apply, one request per execution
        return BatchingPolicy(
            batching=False,
            max_queue_size=batching.max_queue_size,
            default_timeout_ns=batching.default_timeout_microseconds * 1000,
        )
    levels = max(batching.priority_levels, 1)
    return BatchingPolicy(
        batching=True,
        max_batch_size=model.max_batch_size,
        preferred_batch_sizes=tuple(batching.preferred_batch_size),
        max_queue_delay_ns=batching.max_queue_delay_microseconds * 1000,
        max_queue_size=batching.max_queue_size,
        default_timeout_ns=batching.default_timeout_microseconds * 1000,
        priority_levels=levels,
        default_priority_level=batching.default_priority_level or levels,
    )
