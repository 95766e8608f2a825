"""What the fuzz tests share: the examples' profile (a few derandomized ones in the
test run, many random ones under ``tools/fuzz.py``), JSON values of every shape, the
ERROR records a server logs, and the check that a gRPC call got no server fault."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from trioserve import Server

_LONG_RUN = "TRIOSERVE_FUZZ_EXAMPLES" in os.environ


def fuzz_settings(examples: int) -> settings:
    """``examples`` in the normal run (derandomized, so CI is deterministic); the long run's
    count, with fresh randomness, under ``tools/fuzz.py``."""
    if _LONG_RUN:
        return settings(
            max_examples=int(os.environ["TRIOSERVE_FUZZ_EXAMPLES"]),
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)


class ErrorRecords(logging.Handler):
    """Every ERROR record any logger emits while installed (the servers run in threads of
    this process, so their records arrive here)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def take(self) -> list[str]:
        taken, self.records = self.records, []
        return [f"{r.name}: {r.getMessage()}" for r in taken]


_E = TypeVar("_E", bound=BaseException)


def refusal(expected: type[_E], call: Callable[[], object]) -> _E | None:
    """The ``expected`` error ``call`` raised, if any (any other error propagates)."""
    try:
        call()
    except expected as exc:
        return exc
    return None


SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def check_grpc(
    server: Server, payload: bytes, error_records: ErrorRecords, method: str = "ModelInfer"
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call: Callable[..., bytes] = channel.unary_unary(
            f"/inference.GRPCInferenceService/{method}"
        )
        error: Any = refusal(grpc.RpcError, lambda: call(payload, timeout=10))
    if error is not None:
        assert error.code() not in SERVER_FAULTS, (error.code(), error.details())
        assert error.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the server did not answer"
    assert error_records.take() == []
