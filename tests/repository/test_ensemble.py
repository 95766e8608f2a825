"""Ensembles of a Triton repository: a graph of Python-backend models served as one,
over HTTP and gRPC, with a step's failure named and statistics for every model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.utils import InferenceServerException

from trioserve import InferenceRequest, InputTensor, Server, ServerConfig, TensorSpec, model
from trioserve._served import ModelRepository
from trioserve._tensor import datatype
from trioserve.repository._config import complete_config, model_settings
from trioserve.repository._ensemble import EnsembleModel, ensemble_steps
from trioserve.repository._generated.model_config_pb2 import ModelConfig
from trioserve.scheduler._runner import ModelRunner
from trioserve.testing import server_in_thread

from .._model_repository import write_model

STEP_MODEL = """
import numpy as np
import trio
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                error = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x {op})]))
        return responses
"""

STEP_CONFIG = """
backend: "python"
max_batch_size: 8
dynamic_batching {{ }}
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 2 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 2 ] }} ]
"""

# OUT = IN * 2 + 1, and TWICE = IN * 2 on the way.
ENSEMBLE_CONFIG = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 2 ] } ]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 2 ] },
  { name: "TWICE" data_type: TYPE_INT32 dims: [ 2 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "add_one"
      model_version: -1
      input_map { key: "X" value: "twice" }
      output_map { key: "Y" value: "OUT" }
    },
    {
      model_name: "double"
      model_version: 1
      input_map { key: "X" value: "IN" }
      output_map { key: "Y" value: "twice" }
    },
    {
      model_name: "double"
      model_version: -1
      input_map { key: "X" value: "IN" }
      output_map { key: "Y" value: "TWICE" }
    }
  ]
}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, instance_mode: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("ensembles")
    write_model(root, "double", STEP_CONFIG.format(), STEP_MODEL.format(op="* 2"))
    write_model(root, "add_one", STEP_CONFIG.format(), STEP_MODEL.format(op="+ 1"))
    write_model(root, "pipeline", ENSEMBLE_CONFIG)
    broken = ENSEMBLE_CONFIG.replace(
        'value: "IN" }\n      output_map { key: "Y" value: "twice"',
        'value: "nowhere" }\n      output_map { key: "Y" value: "twice"',
    )
    write_model(root, "broken", broken)
    config = ServerConfig(
        model_repositories=[root], http_port=0, grpc_port=0, python_instance_mode=instance_mode
    )
    with server_in_thread(config) as running:
        yield running


def test_the_ensemble_runs_its_steps(server: Server) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    data = np.array([[1, 2], [3, 4]], dtype=np.int32)
    tensor = httpclient.InferInput("IN", [2, 2], "INT32")
    tensor.set_data_from_numpy(data)
    result = http.infer("pipeline", [tensor])
    assert result.as_numpy("OUT").tolist() == (data * 2 + 1).tolist()
    assert result.as_numpy("TWICE").tolist() == (data * 2).tolist()
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    grpc_tensor = grpcclient.InferInput("IN", [1, 2], "INT32")
    grpc_tensor.set_data_from_numpy(data[:1])
    result = grpc.infer("pipeline", [grpc_tensor], outputs=[grpcclient.InferRequestedOutput("OUT")])
    assert result.as_numpy("OUT").tolist() == [[3, 5]]
    assert result.as_numpy("TWICE") is None

    negative = httpclient.InferInput("IN", [1, 2], "INT32")
    negative.set_data_from_numpy(np.array([[-1, 0]], np.int32))
    with pytest.raises(InferenceServerException) as raised:
        http.infer("pipeline", [negative])
    assert raised.value.status() == "400"
    # Both steps reading IN fail; the first failure fails the request, add_one never runs.
    assert raised.value.message() == "in ensemble 'pipeline', step 'double': negative input"

    stats = {s["name"]: s for s in http.get_inference_statistics()["model_stats"]}
    assert stats["pipeline"]["inference_stats"]["success"]["count"] == 2
    assert stats["pipeline"]["inference_stats"]["fail"]["count"] == 1
    # Two steps of double ran per successful request: 4 requests, 5 batch elements.
    assert stats["double"]["inference_stats"]["success"]["count"] == 4
    assert stats["double"]["inference_count"] == 6
    assert stats["double"]["inference_stats"]["fail"]["count"] == 2  # failed or withdrawn
    assert stats["add_one"]["inference_stats"]["success"]["count"] == 2
    assert stats["add_one"]["inference_count"] == 3

    config = http.get_model_config("pipeline")
    assert config["platform"] == "ensemble"
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == [
        "add_one",
        "double",
        "double",
    ]
    http.close()
    grpc.close()


def test_a_graph_that_cannot_run_fails_to_load(server: Server) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    index = {entry["name"]: entry for entry in http.get_model_repository_index()}
    assert index["broken"]["state"] == "UNAVAILABLE"
    # "twice" comes from the step that reads "nowhere", which cannot run.
    assert index["broken"]["reason"].endswith(
        "broken/config.pbtxt: ensemble tensors ['nowhere', 'twice'] are read by a step but "
        "produced by none"
    )
    http.close()


DIAMOND_CONFIG = """
name: "diamond"
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "join" input_map { key: "A" value: "a" } input_map { key: "B" value: "b" }
      output_map { key: "S" value: "OUT" } },
    { model_name: "left" input_map { key: "X" value: "IN" } output_map { key: "Y" value: "a" } },
    { model_name: "right" input_map { key: "X" value: "IN" } output_map { key: "Y" value: "b" } }
  ]
}
"""


class Diamond:
    """left and right (10 ms each) read IN; join (10 ms) adds what they give."""

    def __init__(self, folder: Path) -> None:
        self.started: list[tuple[str, float]] = []
        spec = [TensorSpec("X", "INT32", [1])]

        def step(name: str, inputs: list[TensorSpec], output: str, function):
            async def run(**arrays):
                self.started.append((name, trio.current_time()))
                await trio.sleep(0.010)
                return {output: function(**arrays)}

            declared = model(
                name=name,
                inputs=inputs,
                outputs=[TensorSpec(output, "INT32", [1])],
                max_batch_size=4,
            )
            return ModelRunner(declared(run), "1")

        runners = [
            step("left", spec, "Y", lambda X: X * 10),
            step("right", spec, "Y", lambda X: X + 1),
            step(
                "join",
                [TensorSpec("A", "INT32", [1]), TensorSpec("B", "INT32", [1])],
                "S",
                lambda A, B: A + B,
            ),
        ]
        self.repository = ModelRepository(runners)
        config = text_format.Parse(DIAMOND_CONFIG, ModelConfig())
        (folder / "diamond").mkdir()
        complete_config(config, folder / "diamond")
        del config.instance_group[:]
        ensemble = EnsembleModel(
            ensemble_steps(config, folder),
            config,
            1,
            self.repository,
            {},
            **model_settings(config, folder),
        )
        self.runner = ModelRunner(ensemble, "1")


def diamond_request(value: int):
    data = np.full((1, 1), value, np.int32)
    return InferenceRequest(
        "diamond", "", {"IN": InputTensor("IN", datatype("INT32"), (1, 1), data)}
    )


async def test_steps_start_as_soon_as_their_inputs_exist(autojump_clock, tmp_path):
    diamond = Diamond(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(diamond.repository.run)
        await nursery.start(diamond.runner.run)
        response = await diamond.runner.infer(diamond_request(3))
        assert response.outputs[0].data.tolist() == [[3 * 10 + 3 + 1]]
        assert trio.current_time() == pytest.approx(0.020)
        assert sorted(diamond.started) == [("join", 0.010), ("left", 0.0), ("right", 0.0)]
        nursery.cancel_scope.cancel()


async def test_a_withdrawn_request_runs_no_further_step(autojump_clock, tmp_path):
    diamond = Diamond(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(diamond.repository.run)
        await nursery.start(diamond.runner.run)
        with trio.move_on_after(0.005):
            await diamond.runner.infer(diamond_request(3))
        await trio.sleep(0.050)
        assert sorted(name for name, _ in diamond.started) == ["left", "right"]  # no join
        stats = diamond.runner.inference_statistics()
        assert (stats.success.count, stats.fail.count) == (0, 1)
        nursery.cancel_scope.cancel()


DOUBLER_CONFIG = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 2 ] } ]
ensemble_scheduling {
  step [ { model_name: "double" input_map { key: "X" value: "IN" }
           output_map { key: "Y" value: "OUT" } } ]
}
"""


def test_unloading_an_ensemble_with_its_dependents(tmp_path: Path, instance_mode: str) -> None:
    write_model(tmp_path, "double", STEP_CONFIG.format(), STEP_MODEL.format(op="* 2"))
    write_model(tmp_path, "add_one", STEP_CONFIG.format(), STEP_MODEL.format(op="+ 1"))
    write_model(tmp_path, "pipeline", ENSEMBLE_CONFIG)
    write_model(tmp_path, "doubler", DOUBLER_CONFIG)
    config = ServerConfig(
        model_repositories=[tmp_path],
        http_port=0,
        grpc_port=None,
        model_control_mode="explicit",
        load_models=("*",),
        python_instance_mode=instance_mode,
    )
    with server_in_thread(config) as running:
        http = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        assert {m["name"] for m in http.get_model_repository_index() if m["state"] == "READY"} == {
            "add_one",
            "double",
            "doubler",
            "pipeline",
        }
        http.unload_model("pipeline", unload_dependents=True)
        # add_one goes with it; double stays for doubler, which still uses it.
        assert {m["name"] for m in http.get_model_repository_index() if m["state"] == "READY"} == {
            "double",
            "doubler",
        }
        http.close()
