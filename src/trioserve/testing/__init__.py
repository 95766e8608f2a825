"""Helpers for testing against trioserve.

- ``open_test_server``: a server with no listeners, for in-process clients
  (``Server.infer``, ``Server.generate``, ``Server.rest_app``); exact under
  ``trio.testing.MockClock(autojump_threshold=0)``, pytest-trio's ``autojump_clock``.
- ``timed(model, cost)`` and ``TimedLM``: models whose executions and steps take a
  declared time on trio's clock, and record what they ran.
- ``gated(model)``: a model whose executions wait until the test releases them.
- ``model_statistics`` and ``batch_size_counts``: snapshots of a model's statistics.
- ``server_in_thread``: a real server on a background thread, for synchronous clients.
- ``open_grpc_channel(server)``: a gRPC client over HTTP/2 in memory, served by the same
  core as the gRPC port, exact under the mock clock too.
"""

from .._stats import BatchStat, DurationStat, FailureReason, ModelStatistics
from ..grpc import GrpcCallError, GrpcChannel, StreamingCall
from ._gated import GatedModel, gated
from ._grpc_channel import open_grpc_channel
from ._server import batch_size_counts, model_statistics, open_test_server
from ._thread import server_in_thread
from ._timed import ExecutedBatch, TimedModel, timed
from ._timed_lm import ExecutedStep, TimedLM

__all__ = [
    "BatchStat",
    "DurationStat",
    "ExecutedBatch",
    "ExecutedStep",
    "FailureReason",
    "GatedModel",
    "GrpcCallError",
    "GrpcChannel",
    "ModelStatistics",
    "StreamingCall",
    "TimedLM",
    "TimedModel",
    "batch_size_counts",
    "gated",
    "model_statistics",
    "open_grpc_channel",
    "open_test_server",
    "server_in_thread",
    "timed",
]
