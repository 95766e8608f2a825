"""The trace extension's settings through tritonclient, over HTTP and gRPC: the values
Triton answers (its L0_trace endpoint tests' shapes), a model's overrides following the
server's settings, clearing, errors, and the restricted "trace" group."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig
from trioserve._restricted import parse_restrictions
from trioserve.models import reference_zoo
from trioserve.testing import server_in_thread
from trioserve.tracing import TraceConfig

STARTUP = {
    "trace_file": "global_unittest.log",
    "trace_level": ["TIMESTAMPS"],
    "trace_rate": "1",
    "trace_count": "-1",
    "trace_mode": "triton",
    "log_frequency": "0",
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    config = ServerConfig(
        models=reference_zoo(),
        http_port=0,
        grpc_port=0,
        # These tests make no inference request: the file is never written.
        trace=TraceConfig(level=("TIMESTAMPS",), rate=1, file="global_unittest.log"),
    )
    with server_in_thread(config) as running:
        yield running


class _Http:
    def __init__(self, server: Server) -> None:
        self.client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")

    def get(self, model: str | None = None) -> dict[str, Any]:
        return dict(self.client.get_trace_settings(model_name=model))

    def update(self, settings: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        return dict(self.client.update_trace_settings(model_name=model, settings=settings))


class _Grpc:
    """tritonclient's gRPC answers, read back as the HTTP JSON shape."""

    def __init__(self, server: Server) -> None:
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

    @staticmethod
    def _document(reply: Any) -> dict[str, Any]:
        assert isinstance(reply, grpcclient.service_pb2.TraceSettingResponse)
        settings = json_format.MessageToDict(reply, preserving_proto_field_name=True)["settings"]
        return {
            key: value["value"] if key == "trace_level" else value["value"][0]
            for key, value in settings.items()
        }

    def get(self, model: str | None = None) -> dict[str, Any]:
        return self._document(self.client.get_trace_settings(model_name=model))

    def update(self, settings: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        return self._document(
            self.client.update_trace_settings(model_name=model, settings=settings)
        )


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, server: Server) -> Iterator[_Http | _Grpc]:
    made = _Http(server) if request.param == "http" else _Grpc(server)
    yield made
    # Back to the startup settings, as Triton's tests leave the server.
    clear = dict.fromkeys(
        ["trace_file", "trace_level", "trace_rate", "trace_count", "log_frequency"]
    )
    made.update(clear, "simple")
    made.update(clear)
    made.client.close()


def test_a_model_without_overrides_answers_the_servers_settings(client: _Http | _Grpc) -> None:
    assert client.get() == STARTUP
    assert client.get("simple") == STARTUP


def test_a_model_overrides_what_it_names_and_follows_the_server_in_the_rest(
    client: _Http | _Grpc,
) -> None:
    assert client.update({"trace_file": "model.log"}, "simple") == {
        **STARTUP,
        "trace_file": "model.log",
    }
    server_settings = {"trace_file": "another.log", "trace_level": ["TIMESTAMPS", "TENSORS"]}
    assert client.update(server_settings) == {**STARTUP, **server_settings}
    assert client.get("simple") == {
        **STARTUP,
        "trace_file": "model.log",
        "trace_level": ["TIMESTAMPS", "TENSORS"],
    }
    assert client.get("identity_fp32")["trace_file"] == "another.log"


def test_clearing_returns_a_model_to_the_server_and_the_server_to_its_startup(
    client: _Http | _Grpc,
) -> None:
    client.update({"trace_rate": "12", "log_frequency": "34"}, "simple")
    client.update({"trace_rate": "56", "trace_count": "78", "trace_level": ["OFF"]})
    cleared = {**STARTUP, "trace_level": ["OFF"]}
    assert client.update({"trace_rate": None, "trace_count": None}) == cleared
    assert client.get("simple") == {**cleared, "trace_rate": "12", "log_frequency": "34"}
    assert client.update({"trace_rate": None, "trace_level": None}, "simple") == {
        **cleared,
        "log_frequency": "34",
    }
    assert client.get() == cleared


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"trace_level": ["LOUD"]}, "trace_level must be one or more of OFF, TIMESTAMPS, TENSORS"),
        ({"trace_rate": "-1"}, "'trace_rate' must be an integer >= 0, got '-1'"),
        ({"trace_count": "many"}, "'trace_count' must be an integer >= -1, got 'many'"),
        ({"trace_mode": "opentelemetry"}, "trace_mode is triton; it is chosen when the server"),
        ({"trace_colour": "red"}, "unknown trace setting 'trace_colour'"),
    ],
)
def test_a_bad_setting_is_refused_and_changes_nothing(
    client: _Http | _Grpc, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(InferenceServerException, match=message):
        client.update({"trace_rate": "5", **settings})
    assert client.get() == STARTUP


def test_an_unknown_model_is_not_found(client: _Http | _Grpc) -> None:
    with pytest.raises(InferenceServerException, match="unknown model: 'nope'"):
        client.get("nope")
    with pytest.raises(InferenceServerException, match="unknown model: 'nope'"):
        client.update({"trace_rate": "3"}, "nope")


def test_a_post_with_no_setting_only_asks(server: Server) -> None:
    """What Triton's server answers, though its protocol document speaks of clearing."""
    http = _Http(server)
    http.update({"trace_rate": "7"}, "simple")
    assert http.update({}, "simple") == {**STARTUP, "trace_rate": "7"}
    assert http.update({}) == STARTUP
    http.update({"trace_rate": None}, "simple")
    http.client.close()


def test_the_server_lists_the_trace_and_logging_extensions(server: Server) -> None:
    http = _Http(server)
    extensions = http.client.get_server_metadata()["extensions"]
    assert {"trace", "logging"} <= set(extensions)
    http.client.close()


def test_restricted_trace_and_logging_groups_need_their_header() -> None:
    restrictions = parse_restrictions(["trace,logging:admin-key=secret"])
    config = ServerConfig(
        models=reference_zoo(),
        http_port=0,
        grpc_port=0,
        http_restricted_apis=restrictions,
        grpc_restricted_apis=restrictions,
    )
    key = {"admin-key": "secret"}
    with server_in_thread(config) as running:
        http = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{running.grpc_port}")
        for call in (
            http.get_trace_settings,
            http.get_log_settings,
            grpc.get_trace_settings,
            grpc.get_log_settings,
        ):
            with pytest.raises(InferenceServerException, match="expecting header 'admin-key'"):
                call()
            assert call(headers=key)
        with pytest.raises(InferenceServerException, match="expecting header 'admin-key'"):
            http.update_trace_settings(settings={"trace_rate": "2"})
        assert http.get_trace_settings(headers=key)["trace_rate"] == "1000"
        assert http.get_server_metadata()["name"] == "trioserve"  # the rest is open
        http.close()
        grpc.close()
