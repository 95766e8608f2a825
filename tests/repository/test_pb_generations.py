"""An output of an instance process that is let go of after that process died and
before the next one starts (an answer still being sent, a reference cycle collected
late) goes back to nobody: its block lay in the dead process's arena, and handed to the
next process it would free memory that process never gave out (and that process would
end). In-process inference holds the output array itself; the test lets go of it from
the supervisor's own log line, between the death and the start."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import trioserve
from trioserve import InferenceServerError, Server, ServerConfig

from .._model_repository import write_model

MODEL = """
import os
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            if pb_utils.get_input_tensor_by_name(request, "DIE") is not None:
                os._exit(3)
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            y = np.full(1 << 16, x[0] + 1, np.float32)  # 256 KiB: in place, no frame of its own
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", y), pb_utils.Tensor("PID", np.array([os.getpid()]))
            ]))
        return responses
"""

CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] },
        { name: "DIE" data_type: TYPE_INT32 dims: [ 1 ] optional: true } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
parameters { key: "TRIOSERVE_INSTANCE_MODE" value { string_value: "process" } }
"""


class LetGoOnRestart(logging.Handler):
    """Drops the arrays it holds when the supervisor says the process starts again."""

    def __init__(self, held: list[Any]) -> None:
        super().__init__()
        self.held = held
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "starting it again" in record.getMessage():
            self.dropped += len(self.held)
            self.held.clear()


async def infer(server: Server, value: float) -> tuple[np.ndarray[Any, Any], int]:
    response = await server.infer("big", {"X": np.array([value], np.float32)})
    return response.as_numpy("Y"), int(response.as_numpy("PID")[0])


async def test_an_output_let_go_of_between_two_processes_is_given_to_neither(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    write_model(tmp_path, "big", CONFIG, MODEL)
    config = ServerConfig(model_repositories=[tmp_path], http_port=None, grpc_port=None)
    server: Server = await nursery.start(trioserve.serve, config)
    y, first_pid = await infer(server, 1.0)
    held = [y]
    del y
    handler = LetGoOnRestart(held)
    logger = logging.getLogger("trioserve.python_backend")
    logger.addHandler(handler)
    try:
        with pytest.raises(InferenceServerError, match="exited with status 3"):
            await server.infer("big", {"X": np.zeros(1, np.float32), "DIE": np.zeros(1, np.int32)})
        # The next process's outputs, held together, then let go of and asked for again:
        # none is overwritten, and the process serves on.
        outputs = [await infer(server, value) for value in (2.0, 3.0, 4.0)]
        for value, (y, _pid) in zip((2.0, 3.0, 4.0), outputs, strict=True):
            assert (y.shape, float(y.min()), float(y.max())) == ((1 << 16,), value + 1, value + 1)
        pids = {pid for _y, pid in outputs}
        del outputs
        outputs = [await infer(server, value) for value in (5.0, 6.0)]
        pids |= {pid for _y, pid in outputs}
        assert len(pids) == 1 and first_pid not in pids
    finally:
        logger.removeHandler(handler)
    assert handler.dropped == 1  # it was let go of in the window, by the handler
    assert server.repository.get("big", "").ready  # never marked down
