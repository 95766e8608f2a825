"""A request's model version string, read as Triton reads it: a whole number (leading
zeros and a sign allowed); anything else is INVALID_ARG before the model is looked up."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import Server, ServerConfig
from trioserve.models import reference_zoo
from trioserve.testing import server_in_thread

CASES = [
    ("wrong_specification", "failed to get model version from specified version string"),
    ("-1", "invalid model version specified '-1'"),
    ("7", "'simple' version 7 is not found"),
]


@pytest.fixture
def server(grpc_server: str) -> Iterator[Server]:
    config = ServerConfig(models=reference_zoo(), http_port=0, grpc_port=0, grpc_server=grpc_server)
    with server_in_thread(config) as running:
        yield running


def _inputs(module: object) -> list[object]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(np.ones((1, 16), np.int32))
        inputs.append(tensor)
    return inputs


@pytest.mark.parametrize(("version", "message"), CASES)
def test_bad_version_strings_over_both_protocols(
    server: Server, version: str, message: str
) -> None:
    rest = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    clients = [(httpclient, rest, "400"), (grpcclient, grpc, "StatusCode.INVALID_ARGUMENT")]
    for module, client, status in clients:
        with pytest.raises(InferenceServerException, match=message) as failed:
            client.infer("simple", _inputs(module), model_version=version)
        if version != "7":  # the others are malformed, not missing
            assert failed.value.status() == status
        assert not client.is_model_ready("simple", version)
    rest.close()
    grpc.close()


def test_leading_zeros_name_the_same_version(server: Server) -> None:
    with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        result = client.infer("simple", _inputs(httpclient), model_version="01")
        assert result.get_response()["model_version"] == "1"
        assert client.is_model_ready("simple", "001")
