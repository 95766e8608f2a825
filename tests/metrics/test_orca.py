"""Load reports without a network: the figures, their windows and the header forms.

Time-dependent figures run under ``autojump_clock``: the values are exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import trio

import trioserve
from trioserve import InferenceRequest, InputTensor, InternalError, TensorSpec
from trioserve._load_facts import LoadFacts
from trioserve._tensor import DATATYPES
from trioserve.metrics._host_usage import (
    HostUsage,
    cpu_seconds_from_stat,
    memory_utilization,
    memory_utilization_from_meminfo,
    process_cpu_seconds,
)
from trioserve.metrics._orca import Counting, LoadReporter, _json_number
from trioserve.metrics._recent import RecentActivity, Totals
from trioserve.rest._load_report import load_report_header
from trioserve.scheduler._generation import KVCacheState
from trioserve.scheduler._runner import ModelRunner

JSON_ASKED = {b"endpoint-load-metrics-format": b"json"}
TEXT_ASKED = {b"endpoint-load-metrics-format": b"text"}


def no_host_figures() -> HostUsage:
    return HostUsage(cpu_seconds=lambda: None, memory=lambda: None, cpus=1)


def readings(*values: float) -> Callable[[], float]:
    """A reader returning ``values`` one per call (and failing the test if read more)."""
    it: Iterator[float] = iter(values)
    return lambda: next(it)


# --- number forms -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.75, "0.75"), (2.0, "2.0"), (0.0, "0.0"), (1 / 3, "0.3333333333333333"),
        (5e-05, "0.00005"), (1e-06, "0.000001"), (1e-07, "1e-7"), (1.5e-07, "1.5e-7"),
        (123456.789, "123456.789"), (1e21, "1e21"), (1e20, "100000000000000000000.0"),
        (8192, "8192"), (0, "0"),
    ],
)  # fmt: skip
def test_json_numbers_print_as_tritons_json_writer_prints_them(value: float, text: str) -> None:
    assert _json_number(value) == text


# --- the recent window --------------------------------------------------------------------


def test_recent_activity_rates_over_the_window() -> None:
    activity = RecentActivity(window_s=10)
    for _ in range(3):
        activity.add(100.0, arrived=99.5, failed=False)
    activity.add(101.25, arrived=100.25, failed=True)
    # Requests began arriving at 99.5: 2.5 s of requests, 0.5 + 0.5 + 0.5 + 1.0 s in flight.
    assert activity.totals(102.0) == Totals(requests=4, errors=1, busy_s=2.5, span_s=2.5)
    assert activity.totals(102.0).requests_per_second == 1.6
    assert activity.totals(102.0).errors_per_second == 0.4
    assert activity.totals(102.0).in_flight == 1.0
    # At 109.5 the window is seconds 100..109; at 110, second 100 has left it.
    assert activity.totals(109.5) == Totals(4, 1, 2.5, 9.5)
    assert activity.totals(110.0) == Totals(1, 1, 1.0, 9.0)
    # Second 110 reuses second 100's bucket: it starts from zero.
    activity.add(110.5, arrived=110.0, failed=False)
    assert activity.totals(110.5) == Totals(2, 1, 1.5, 9.5)
    assert activity.totals(121.0) == Totals(0, 0, 0.0, 9.0)


def test_a_coalesced_request_counts_as_each_of_its_requests() -> None:
    alone, coalesced = RecentActivity(window_s=10), RecentActivity(window_s=10)
    for _ in range(3):
        alone.add(100.0, arrived=99.5, failed=False)
    coalesced.add(100.0, arrived=99.5, failed=False, requests=3)
    assert coalesced.totals(101.0) == alone.totals(101.0) == Totals(3, 0, 1.5, 1.5)
    times = iter([101.0, 101.25, 102.0, 102.5])
    with Counting(coalesced, lambda: next(times), 4):
        pass  # arrived at 101.0, answered at 101.25
    with pytest.raises(ValueError), Counting(coalesced, lambda: next(times), 2):
        raise ValueError("failed")  # arrived at 102.0, failed at 102.5
    assert coalesced.totals(102.5) == Totals(9, 2, 3.5, 3.0)


def test_recent_activity_first_second_is_not_a_burst() -> None:
    activity = RecentActivity(window_s=10)
    activity.add(50.25, arrived=50.25, failed=False)
    assert activity.totals(50.5).requests_per_second == 1.0  # over one second, not 0.25
    assert RecentActivity().totals(7.0).requests_per_second == 0.0


# --- CPU and memory -----------------------------------------------------------------------


def test_host_usage_samples_at_most_once_per_refresh() -> None:
    usage = HostUsage(
        cpu_seconds=readings(10.0, 10.5, 11.5), memory=readings(0.5, 0.25, 0.75), cpus=2
    )
    assert usage.sample(0.0) == (None, 0.5)  # one CPU sample gives no rate yet
    assert usage.sample(0.9) == (None, 0.5)  # kept: the readers are not called
    assert usage.sample(1.0) == (0.25, 0.25)  # 0.5 CPU-s in 1 s on 2 CPUs
    assert usage.sample(3.0) == (0.25, 0.75)  # 1.0 CPU-s in 2 s on 2 CPUs


def test_proc_parsers() -> None:
    stat = "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0"
    assert cpu_seconds_from_stat(stat, ticks_per_second=100) == 3.0
    meminfo = "MemTotal:  1000 kB\nMemFree:  100 kB\nMemAvailable:  250 kB\n"
    assert memory_utilization_from_meminfo(meminfo) == 0.75
    assert memory_utilization_from_meminfo("MemTotal:  1000 kB\n") is None


def test_proc_readers_on_this_host() -> None:
    cpu = process_cpu_seconds()
    memory = memory_utilization()
    assert cpu is not None and cpu > 0
    assert memory is not None and 0 < memory < 1


# --- a tensor model -------------------------------------------------------------------------


def slow_model() -> trioserve.Model:
    @trioserve.model(
        name="slow",
        inputs=[TensorSpec("X", "FP32", [1])],
        outputs=[TensorSpec("Y", "FP32", [1])],
        instance_count=2,
    )
    async def slow(X: np.ndarray[Any, Any]) -> dict[str, Any]:
        await trio.sleep(1.0)
        return {"Y": X}

    return slow


def x_request() -> InferenceRequest:
    x = InputTensor("X", DATATYPES["FP32"], (1,), np.zeros(1, np.float32))
    return InferenceRequest("slow", "", {"X": x})


async def test_tensor_model_report(nursery: trio.Nursery, autojump_clock: Any) -> None:
    runner = ModelRunner(slow_model(), "1")
    await nursery.start(runner.run)
    load = LoadReporter(host=no_host_figures())
    start = trio.current_time()

    async def one() -> None:
        with load.counting(runner):
            await runner.infer(x_request())

    async with trio.open_nursery() as clients:
        for _ in range(4):  # two run at once; two wait a second for an instance
            clients.start_soon(one)
        await runner.wait_until(lambda s: s.queued == 2 and s.executing == 2)
        busy = load.report(runner)
        assert busy is not None
        assert (busy.waiting, busy.running, busy.rps_fractional) == (2, 2, 0.0)
    assert trio.current_time() - start == 2.0
    report = load.report(runner)
    assert report is not None
    # 1 + 1 + 2 + 2 request-seconds in two seconds: 3 in flight on 2 instances, capped at 1.
    assert report.application_utilization == 1.0
    assert report.rps_fractional == 2.0
    assert report.eps == 0.0
    await trio.sleep(2.0)
    # The same 6 request-seconds over four seconds: 1.5 in flight, 0.75 per instance.
    assert load_report_header(load, runner, JSON_ASKED) == (
        b"endpoint-load-metrics",
        b'JSON {"named_metrics":{"num_requests_waiting":0,"num_requests_running":0},'
        b'"application_utilization":0.75,"rps_fractional":1.0,"eps":0.0}',
    )
    assert load_report_header(load, runner, TEXT_ASKED) == (
        b"endpoint-load-metrics",
        b"TEXT named_metrics.num_requests_waiting=0, named_metrics.num_requests_running=0",
    )
    await trio.sleep(10.0)  # all four leave the ten-second window
    later = load.report(runner)
    assert later is not None
    assert (later.application_utilization, later.rps_fractional) == (0.0, 0.0)


async def test_errors_count_and_cancellations_do_not(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    runner = ModelRunner(slow_model(), "1")
    await nursery.start(runner.run)
    load = LoadReporter(host=no_host_figures())
    with pytest.raises(InternalError), load.counting(runner):
        raise InternalError("the model failed")
    with trio.move_on_after(0.5), load.counting(runner):
        await trio.sleep(1.0)  # cancelled: the client went away
    with load.counting(runner):
        pass
    report = load.report(runner)
    assert report is not None
    assert (report.rps_fractional, report.eps) == (2.0, 1.0)  # within the first second


async def test_a_count_can_be_marked_failed_or_left_out(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """``failed()``: an error already answered; ``uncounted()``: a request withdrawn for a
    client that left. Neither needs an exception to cross the count."""
    runner = ModelRunner(slow_model(), "1")
    await nursery.start(runner.run)
    load = LoadReporter(host=no_host_figures())
    with load.counting(runner) as counting:
        counting.failed()
    with load.counting(runner) as counting:
        counting.uncounted()
    with pytest.raises(InternalError), load.counting(runner) as counting:
        counting.uncounted()
        raise InternalError("nobody is told of this one")
    report = load.report(runner)
    assert report is not None
    assert (report.rps_fractional, report.eps) == (1.0, 1.0)


def test_another_clock_counts_without_trio() -> None:
    # No trio run here: the clock given is the only time the reporter reads.
    runner = ModelRunner(slow_model(), "1")
    load = LoadReporter(host=no_host_figures(), clock=readings(100.0, 100.5, 100.5))
    with load.counting(runner):  # arrives at 100.0, leaves at 100.5
        pass
    report = load.report(runner)  # read at 100.5
    assert report is not None
    # Half a request-second on two instances, one request, over the first second.
    assert (report.application_utilization, report.rps_fractional) == (0.25, 1.0)


# --- a model with a KV cache ---------------------------------------------------------------


async def test_kv_cache_report_in_both_forms(kv_engine: Any, autojump_clock: Any) -> None:
    engine = kv_engine(KVCacheState(total_blocks=512, used_blocks=384, block_size=16))
    host = HostUsage(cpu_seconds=readings(4.0, 4.5), memory=readings(0.5, 0.5), cpus=2)
    load = LoadReporter(host=host)
    with load.counting(engine):
        pass
    assert load_report_header(load, engine, JSON_ASKED) == (
        b"endpoint-load-metrics",
        b'JSON {"named_metrics":{"kv_cache_utilization":0.75,"max_token_capacity":8192},'
        b'"application_utilization":0.75,"rps_fractional":1.0,"eps":0.0,"mem_utilization":0.5}',
    )
    await trio.sleep(1.0)
    with load.counting(engine):
        pass
    assert load_report_header(load, engine, JSON_ASKED) == (
        b"endpoint-load-metrics",
        b'JSON {"named_metrics":{"kv_cache_utilization":0.75,"max_token_capacity":8192},'
        b'"application_utilization":0.75,"rps_fractional":2.0,"eps":0.0,'
        b'"cpu_utilization":0.25,"mem_utilization":0.5}',
    )
    assert load_report_header(load, engine, TEXT_ASKED) == (
        b"endpoint-load-metrics",
        b"TEXT named_metrics.kv_cache_utilization=0.750000, named_metrics.max_token_capacity=8192",
    )


@pytest.mark.parametrize(
    ("kv", "json", "text"),
    [
        (
            KVCacheState(total_blocks=3, used_blocks=1, block_size=64),
            b'{"kv_cache_utilization":0.3333333333333333,"max_token_capacity":192}',
            b"named_metrics.kv_cache_utilization=0.333333, named_metrics.max_token_capacity=192",
        ),
        (  # no blocks yet: Triton reports utilization 0, not a division by zero
            KVCacheState(total_blocks=0, used_blocks=0, block_size=16),
            b'{"kv_cache_utilization":0.0,"max_token_capacity":0}',
            b"named_metrics.kv_cache_utilization=0.000000, named_metrics.max_token_capacity=0",
        ),
    ],
)
async def test_kv_cache_figures(kv_engine: Any, kv: KVCacheState, json: bytes, text: bytes) -> None:
    engine = kv_engine(kv)
    load = LoadReporter(host=no_host_figures())
    json_header = load_report_header(load, engine, JSON_ASKED)
    assert json_header is not None
    assert json_header[1].startswith(b'JSON {"named_metrics":' + json + b",")
    assert load_report_header(load, engine, TEXT_ASKED) == (
        b"endpoint-load-metrics",
        b"TEXT " + text,
    )


@pytest.mark.parametrize(
    ("kv", "logged"),
    [
        (KVCacheState(total_blocks=512, used_blocks=-1, block_size=16), "negative"),
        (KVCacheState(total_blocks=-512, used_blocks=0, block_size=16), "negative"),
        (KVCacheState(total_blocks=512, used_blocks=0, block_size=-16), "negative"),
        (RuntimeError("the engine has not started"), "no KV-cache figures"),
        (None, "no KV-cache figures"),
    ],
)
async def test_missing_or_negative_kv_figures_send_no_report(
    kv_engine: Any, kv: Any, logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    load = LoadReporter(host=no_host_figures())
    engine = kv_engine(kv)
    with caplog.at_level(logging.ERROR, logger="trioserve.metrics"):
        assert load_report_header(load, engine, JSON_ASKED) is None
        assert load_report_header(load, engine, TEXT_ASKED) is None
        assert load.report(engine) is None
    assert len(caplog.records) == 3
    assert all(logged in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


async def test_unknown_format_logs_and_sends_nothing(
    kv_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    load = LoadReporter(host=no_host_figures())
    engine = kv_engine(KVCacheState(total_blocks=8, used_blocks=2, block_size=16))
    with caplog.at_level(logging.ERROR, logger="trioserve.http"):
        for unknown in (b"xml", b"JSON", b""):
            assert (
                load_report_header(load, engine, {b"endpoint-load-metrics-format": unknown}) is None
            )
        assert (
            load_report_header(load, engine, {}) is None
        )  # not asked: nothing, and nothing logged
    assert [r.getMessage() for r in caplog.records] == [
        f"unknown endpoint-load-metrics-format '{f}': no load report sent"
        for f in ("xml", "JSON", "")
    ]


class Unwell:
    """A served model whose queue figures cannot be read."""

    def __init__(self) -> None:
        self.model = slow_model()
        self.version = "1"

    def load_facts(self) -> LoadFacts:
        return LoadFacts(queue=self._queue)

    def _queue(self) -> Any:
        raise RuntimeError("statistics unavailable")


async def test_a_failing_report_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    load = LoadReporter(host=no_host_figures())
    with caplog.at_level(logging.ERROR, logger="trioserve.metrics"):
        assert load_report_header(load, Unwell(), JSON_ASKED) is None  # type: ignore[arg-type]
    assert caplog.records[0].getMessage() == "building the load report for model 'slow' failed"
    assert caplog.records[0].exc_info is not None
