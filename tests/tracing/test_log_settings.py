"""The logging extension through tritonclient (HTTP and gRPC): Triton's settings and
answers, each change applying to the very next record, Triton's log line formats, bad
values refused, and the logger given back as it was when the server stops."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import LogConfig, Server, ServerConfig
from trioserve._log_settings import TritonFormatter
from trioserve.models import reference_zoo
from trioserve.testing import server_in_thread

DEFAULTS = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "default",
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    logger = logging.getLogger("trioserve")
    before = (logger.propagate, logger.level)
    config = ServerConfig(
        models=reference_zoo(), http_port=0, grpc_port=0, model_control_mode="explicit"
    )
    with server_in_thread(config) as running:
        yield running
    assert (logger.propagate, logger.level) == before
    assert not [h for h in logger.handlers if isinstance(h.formatter, TritonFormatter)]


@pytest.fixture
def http(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield client
    client.update_log_settings(DEFAULTS)
    client.close()


@pytest.fixture
def grpc(server: Server) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield client
    client.close()


def test_the_settings_triton_answers(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    assert http.get_log_settings() == DEFAULTS
    assert grpc.get_log_settings(as_json=True) == {
        "settings": {
            "log_file": {"string_param": ""},
            "log_info": {"bool_param": True},
            "log_warning": {"bool_param": True},
            "log_error": {"bool_param": True},
            "log_verbose_level": {"uint32_param": 0},
            "log_format": {"string_param": "default"},
        }
    }
    answer = grpc.update_log_settings({"log_verbose_level": 2}, as_json=True)
    assert answer["settings"]["log_verbose_level"] == {"uint32_param": 2}
    assert http.get_log_settings()["log_verbose_level"] == 2


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_each_change_applies_to_the_next_record(
    http: httpclient.InferenceServerClient,
    grpc: grpcclient.InferenceServerClient,
    tmp_path: Path,
) -> None:
    log = tmp_path / "server.log"
    assert http.update_log_settings({"log_file": str(log), "log_info": False}) == {
        **DEFAULTS,
        "log_file": str(log),
        "log_info": False,
    }
    http.load_model("simple")  # logs "loaded model 'simple'" at INFO: dropped
    assert lines(log) == []
    grpc.update_log_settings({"log_info": True})
    http.unload_model("simple")
    [unloaded] = lines(log)
    assert re.fullmatch(
        r"I\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ _manager\.py:\d+\] unloaded model 'simple'", unloaded
    )

    # A model failure is a WARNING; verbose records are DEBUG.
    tensor = httpclient.InferInput("INPUT0", [1], "INT32")
    tensor.set_data_from_numpy(np.zeros(1, np.int32))
    http.update_log_settings({"log_warning": False, "log_format": "ISO8601"})
    http.load_model("fail")
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ I \d+ _manager\.py:\d+\] loaded model 'fail'",
        lines(log)[-1],
    )
    written = len(lines(log))
    with pytest.raises(InferenceServerException):
        http.infer("fail", [tensor])
    assert len(lines(log)) == written  # the WARNING was dropped
    http.update_log_settings({"log_warning": True})
    with pytest.raises(InferenceServerException):
        http.infer("fail", [tensor])
    [warning] = lines(log)[written:]
    assert " W " in warning
    assert warning.endswith("model 'fail' failed: RuntimeError(\"the 'fail' model always fails\")")

    with pytest.raises(InferenceServerException):
        grpc.get_model_metadata("nope")  # answered NOT_FOUND: a verbose record, dropped
    assert len(lines(log)) == written + 1
    http.update_log_settings({"log_verbose_level": 1})
    with pytest.raises(InferenceServerException):
        grpc.get_model_metadata("nope")
    [verbose] = lines(log)[written + 1 :]
    assert " V " in verbose and "gRPC call answered NOT_FOUND" in verbose
    http.unload_model("fail")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"log_verbose_level": -1}, "log verbose level must be >= 0"),
        ({"log_format": "xml"}, "log format must be one of default, ISO8601"),
        ({"log_info": "yes"}, "log setting 'log_info' takes a boolean, got 'yes'"),
        ({"log_colour": "red"}, "unknown log setting 'log_colour'"),
        ({"log_file": "/nonexistent/folder/x.log"}, "cannot open log file"),
    ],
)
def test_a_bad_setting_is_refused_and_changes_nothing(
    http: httpclient.InferenceServerClient, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(InferenceServerException, match=re.escape(message)):
        http.update_log_settings({"log_info": False, **settings})
    assert http.get_log_settings() == DEFAULTS


def test_grpc_refuses_a_value_of_the_wrong_kind(grpc: grpcclient.InferenceServerClient) -> None:
    import grpc as grpcio

    request = grpcclient.service_pb2.LogSettingsRequest()
    request.settings["log_info"].string_param = "yes"  # tritonclient would send a bool
    with pytest.raises(grpcio.RpcError) as raised:
        grpc._client_stub.LogSettings(request)
    assert raised.value.code() == grpcio.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "log setting 'log_info' takes a boolean, got 'yes'"


def test_a_server_started_with_log_settings_logs_by_them_from_the_start(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    config = ServerConfig(
        models=reference_zoo(),
        http_port=0,
        grpc_port=None,
        log=LogConfig(file=str(log), format="ISO8601", warning=False),
    )
    with server_in_thread(config) as running:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        assert client.get_log_settings() == {
            **DEFAULTS,
            "log_file": str(log),
            "log_format": "ISO8601",
            "log_warning": False,
        }
        client.close()
    loaded = [line for line in lines(log) if "loaded model 'simple' version 1" in line]
    assert len(loaded) == 1 and re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ I ", loaded[0])
