"""``--trace-config`` and the log flags, spelled as tritonserver's."""

from __future__ import annotations

import pytest

from trioserve._cli import _parser, log_config_from_args
from trioserve._log_settings import LogConfig
from trioserve.tracing import TraceConfig, trace_config_from_flags


def test_trace_config_flags() -> None:
    config = trace_config_from_flags(
        [
            "level=TIMESTAMPS",
            "level=TENSORS",
            "rate=100",
            "count=10",
            "mode=opentelemetry",
            "triton,file=/tmp/trace.json",
            "triton,log-frequency=50",
            "opentelemetry,url=http://collector:4318/v1/traces",
            "opentelemetry,resource=service.name=inference",
            "opentelemetry,resource=deployment=blue",
            "opentelemetry,bsp_max_queue_size=4096",
            "opentelemetry,bsp_schedule_delay=100",
            "opentelemetry,bsp_max_export_batch_size=256",
        ]
    )
    assert config == TraceConfig(
        level=("TIMESTAMPS", "TENSORS"),
        rate=100,
        count=10,
        mode="opentelemetry",
        file="/tmp/trace.json",
        log_frequency=50,
        url="http://collector:4318/v1/traces",
        resource={"service.name": "inference", "deployment": "blue"},
        bsp_max_queue_size=4096,
        bsp_schedule_delay_ms=100,
        bsp_max_export_batch_size=256,
    )
    # Triton's defaults; level OFF drops the levels given before it.
    assert trace_config_from_flags(["level=TIMESTAMPS", "level=OFF"]) == TraceConfig()
    assert TraceConfig().rate == 1000 and TraceConfig().url == "http://localhost:4318/v1/traces"


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("level=LOUD", "unknown trace level 'LOUD'"),
        ("rate=often", "rate takes an integer"),
        ("rate=-1", "trace rate must be >= 0"),
        ("mode=zipkin", "trace mode must be one of triton, opentelemetry"),
        ("zipkin,url=x", "unknown trace mode 'zipkin'"),
        ("triton,url=x", "unknown setting 'url'"),
        ("opentelemetry,resource=novalue", "resource takes <key>=<value>"),
        ("opentelemetry,bsp_max_export_batch_size=4096", "must be <= bsp_max_queue_size"),
        ("level", "is not [<mode>,]<setting>=<value>"),
    ],
)
def test_a_bad_trace_flag_says_what_is_wrong(flag: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        trace_config_from_flags([flag])


def _log(*flags: str) -> LogConfig:
    return log_config_from_args(_parser().parse_args(["run", *flags]))


def test_log_flags() -> None:
    assert _log() == LogConfig()
    assert _log("--log-level", "debug") == LogConfig(verbose_level=1)
    assert _log("--log-level", "error") == LogConfig(info=False, warning=False)
    # Triton's own flags win over --log-level.
    assert _log("--log-level", "error", "--log-warning", "true", "--log-verbose", "3") == (
        LogConfig(info=False, verbose_level=3)
    )
    assert _log("--log-file", "/tmp/server.log", "--log-format", "ISO8601") == LogConfig(
        file="/tmp/server.log", format="ISO8601"
    )


def test_opentelemetry_mode_without_the_extra_is_refused_up_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name.startswith("opentelemetry.exporter") else found(name),
    )
    with pytest.raises(ValueError, match=r"needs the extra trioserve\[tracing\]"):
        trace_config_from_flags(["mode=opentelemetry"])
