"""Custom metrics of Python-backend models (``pb_utils.MetricFamily``) on ``/metrics``."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve import ServerConfig
from trioserve.testing import server_in_thread

from .._model_repository import write_model

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
"""

# Counts the values it sees, keeps their last total, and their histogram.
COUNTING_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        seen = pb_utils.MetricFamily(
            name="custom_values_seen", description="Values seen", kind=pb_utils.MetricFamily.COUNTER
        )
        self.seen = seen.Metric(labels={"model": args["model_name"]})
        again = pb_utils.MetricFamily("custom_values_seen", "Another text", pb_utils.COUNTER)
        assert again.Metric(labels={"model": args["model_name"]}) is self.seen
        self.total = pb_utils.MetricFamily(
            "custom_last_total", "The last total", pb_utils.MetricFamily.GAUGE
        ).Metric()
        self.sizes = pb_utils.MetricFamily(
            "custom_value_sizes", "Sizes of values", pb_utils.MetricFamily.HISTOGRAM
        ).Metric(labels={"model": args["model_name"]}, buckets=[1.0, 10.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            self.seen.increment(len(x))
            self.total.set(float(x.sum()))
            for value in x:
                self.sizes.observe(float(value))
            try:
                self.seen.increment(-1)
            except Exception as exc:
                assert "cannot decrease" in str(exc)
            else:
                raise pb_utils.TritonModelException("a counter went down")
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("Y", x * 0 + self.seen.value()),
            ]))
        return responses
"""

# Makes custom_values_seen again, as a gauge: its load fails, the first model's stays.
CLASHING_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        pb_utils.MetricFamily("custom_values_seen", "clash", pb_utils.MetricFamily.GAUGE)

    def execute(self, requests):
        return []
"""

# Its finalize waits on a FIFO (``go``), then changes its family and makes another, and
# says so through a second FIFO (``done``).
FINALIZING_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        family = pb_utils.MetricFamily("custom_finalized", "Finalized", pb_utils.COUNTER)
        self.finalized = family.Metric()
        self.finalized.increment(1)

    def execute(self, requests):
        return []

    def finalize(self):
        with open({go!r}, "rb") as go:
            go.read()
        self.finalized.increment(1)
        pb_utils.MetricFamily("custom_made_late", "Made late", pb_utils.GAUGE).Metric().set(1)
        with open({done!r}, "wb") as done:
            done.write(b"finalized")
"""


def samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of the custom_ series of an exposition."""
    return {
        match[1]: float(match[2])
        for match in re.finditer(r"^(custom_\S+) (\S+)$", text, re.MULTILINE)
    }


def test_custom_metrics_on_the_servers_metrics(tmp_path: Path, instance_mode: str) -> None:
    write_model(tmp_path, "counting", CONFIG.format(name="counting"), COUNTING_MODEL)
    write_model(tmp_path, "clashing", CONFIG.format(name="clashing"), CLASHING_MODEL)
    config = ServerConfig(
        model_repositories=[tmp_path],
        model_control_mode="explicit",
        load_models=["counting"],
        http_port=0,
        grpc_port=None,
        python_instance_mode=instance_mode,
    )
    with server_in_thread(config) as server:
        url = f"127.0.0.1:{server.http_port}"
        client = httpclient.InferenceServerClient(url)
        x = httpclient.InferInput("X", [3], "FP32")
        for values in ([0.5, 2.0, 20.0], [3.0, 4.0, 5.0]):
            x.set_data_from_numpy(np.array(values, np.float32))
            result = client.infer("counting", [x])
        assert result.as_numpy("Y").tolist() == [6.0, 6.0, 6.0]
        text = httpx.get(f"http://{url}/metrics").text
        assert "# TYPE custom_values_seen counter" in text
        assert "# HELP custom_values_seen Values seen" in text
        assert samples(text) == {
            'custom_values_seen{model="counting"}': 6.0,
            "custom_last_total": 12.0,
            'custom_value_sizes_bucket{le="1.0",model="counting"}': 1.0,
            'custom_value_sizes_bucket{le="10.0",model="counting"}': 5.0,
            'custom_value_sizes_bucket{le="+Inf",model="counting"}': 6.0,
            'custom_value_sizes_count{model="counting"}': 6.0,
            'custom_value_sizes_sum{model="counting"}': 34.5,
        }
        with pytest.raises(InferenceServerException, match="already exists as a counter"):
            client.load_model("clashing")
        client.unload_model("counting")  # its families go with it
        assert samples(httpx.get(f"http://{url}/metrics").text) == {}
        client.close()


def test_metric_misuse_is_refused() -> None:
    from trioserve.repository._pb_utils import MetricFamily

    gauge = MetricFamily("custom_gauge", "a gauge", MetricFamily.GAUGE)
    metric = gauge.Metric()
    metric.increment(-2.5)
    assert metric.value() == -2.5
    with pytest.raises(Exception, match="only histograms 'observe'"):
        metric.observe(1.0)
    histogram = MetricFamily("custom_histogram", "a histogram", MetricFamily.HISTOGRAM)
    with pytest.raises(Exception, match="increasing upper bounds"):
        histogram.Metric(buckets=[2.0, 1.0])
    with pytest.raises(Exception, match="not a valid Prometheus name"):
        MetricFamily("bad name", "", MetricFamily.COUNTER)
    with pytest.raises(Exception, match="only gauges 'set'"):
        MetricFamily("custom_counter", "", MetricFamily.COUNTER).Metric().set(1.0)


def test_a_models_families_go_as_it_stops_serving(tmp_path: Path, instance_mode: str) -> None:
    go, done = tmp_path / "go", tmp_path / "done"
    os.mkfifo(go)
    os.mkfifo(done)
    write_model(
        tmp_path / "models",
        "finalizing",
        CONFIG.format(name="finalizing"),
        FINALIZING_MODEL.format(go=str(go), done=str(done)),
    )
    config = ServerConfig(
        model_repositories=[tmp_path / "models"],
        model_control_mode="explicit",
        load_models=["finalizing"],
        http_port=0,
        grpc_port=None,
        python_instance_mode=instance_mode,
    )
    with server_in_thread(config) as server:
        url = f"http://127.0.0.1:{server.http_port}"
        assert samples(httpx.get(f"{url}/metrics").text) == {"custom_finalized": 1.0}
        httpx.post(f"{url}/v2/repository/models/finalizing/unload").raise_for_status()
        try:  # its finalize has not ended: it waits on ``go``
            during_finalize = samples(httpx.get(f"{url}/metrics").text)
        finally:  # let it end whatever happened (each open waits for the other end's)
            go.write_bytes(b"go")
            finalized = done.read_bytes()
        assert during_finalize == {}  # its family is gone already
        assert finalized == b"finalized"
        # What its finalize changed and made is not exported either.
        assert samples(httpx.get(f"{url}/metrics").text) == {}


def test_what_a_released_model_makes_is_not_exported() -> None:
    from trioserve.repository._pb_metrics import COUNTER
    from trioserve.repository._pb_metrics_export import CustomMetrics

    class Owner:
        pass

    metrics, stopped, serving = CustomMetrics(), Owner(), Owner()
    metrics.family("custom_shared", "", COUNTER, stopped).series((), []).increment(1)
    metrics.family("custom_shared", "", COUNTER, serving)
    metrics.release(stopped)
    # A change its instance process forwards late makes no family again...
    late = metrics.family("custom_late", "", COUNTER, stopped)
    late.series((), []).increment(2)
    # ...nor touches the family another model still holds.
    assert metrics.family("custom_shared", "", COUNTER, stopped) is not metrics.family(
        "custom_shared", "", COUNTER, serving
    )
    assert [family.name for family in metrics.collect()] == ["custom_shared"]
    assert [sample.value for sample in metrics.collect()[0].samples] == [1.0]
