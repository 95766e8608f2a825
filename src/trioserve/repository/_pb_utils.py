"""``triton_python_backend_utils``: what a Triton Python-backend ``model.py`` imports.

The python backend registers this module under that name, so ``import
triton_python_backend_utils as pb_utils`` works unchanged. It has every public name of
Triton's module (its Python file and the classes and functions Triton's stub adds to it):
tensors and errors (``_pb_tensors``), requests, responses and BLS (``_pb_requests``), the
model config of ``auto_complete_config`` (``_auto_complete``), custom metrics
(``_pb_metrics``), the logger and model control here. Tensors are numpy arrays on the
host. It imports neither trio nor protobuf nor prometheus_client: instance processes
import it as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ._auto_complete import ModelConfig as ModelConfig
from ._pb_metrics import COUNTER as COUNTER
from ._pb_metrics import GAUGE as GAUGE
from ._pb_metrics import HISTOGRAM as HISTOGRAM
from ._pb_metrics import Metric as Metric
from ._pb_metrics import MetricFamily as MetricFamily
from ._pb_requests import TRITONSERVER_MEMORY_CPU as TRITONSERVER_MEMORY_CPU
from ._pb_requests import TRITONSERVER_MEMORY_GPU as TRITONSERVER_MEMORY_GPU
from ._pb_requests import (
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END as TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
)
from ._pb_requests import (
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START as TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
)
from ._pb_requests import TRITONSERVER_REQUEST_RELEASE_ALL as TRITONSERVER_REQUEST_RELEASE_ALL
from ._pb_requests import (
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE as TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
)
from ._pb_requests import (
    TRITONSERVER_RESPONSE_COMPLETE_FINAL as TRITONSERVER_RESPONSE_COMPLETE_FINAL,
)
from ._pb_requests import InferenceRequest as InferenceRequest
from ._pb_requests import InferenceResponse as InferenceResponse
from ._pb_requests import InferenceResponseSender as InferenceResponseSender
from ._pb_requests import InferenceTrace as InferenceTrace
from ._pb_requests import PreferredMemory as PreferredMemory
from ._pb_requests import ResponseIterator as ResponseIterator
from ._pb_serving import current
from ._pb_tensors import TRITON_STRING_TO_NUMPY as TRITON_STRING_TO_NUMPY
from ._pb_tensors import Tensor as Tensor
from ._pb_tensors import TritonError as TritonError
from ._pb_tensors import TritonModelException as TritonModelException
from ._pb_tensors import deserialize_bytes_tensor as deserialize_bytes_tensor
from ._pb_tensors import numpy_to_triton_type as numpy_to_triton_type
from ._pb_tensors import serialize_byte_tensor as serialize_byte_tensor
from ._pb_tensors import server_error as server_error
from ._pb_tensors import triton_string_to_numpy as triton_string_to_numpy
from ._pb_tensors import triton_to_numpy_type as triton_to_numpy_type


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in request.inputs():  # a loop, not next(genexpr): called per input per request
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> Any:
    return next((t for t in model_config.get("input", ()) if t["name"] == name), None)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> Any:
    return next((t for t in model_config.get("output", ()) if t["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    """Whether the parsed ``model_config`` (``initialize``'s ``args``) is decoupled."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def get_model_dir() -> str:
    """The folder of the running model's model.py (its version folder)."""
    return str(current("get_model_dir").model_dir)


def load_model(model_name: str, config: str = "", files: Mapping[str, bytes] | None = None) -> None:
    """Load (or reload) a model, as the repository API's load does: explicit model
    control mode only. Blocks until it serves or failed."""
    link = current("load_model").link
    link.wait(lambda: link.load(model_name, config, files or {}))


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    link = current("unload_model").link
    link.wait(lambda: link.unload(model_name, unload_dependents))


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    link = current("is_model_ready").link
    return bool(link.wait(lambda: link.model_ready(model_name, model_version)))


class Logger:
    """Triton's model logger, on the ``trioserve.python_backend`` logger."""

    class LogLevel:
        INFO = logging.INFO
        WARNING = logging.WARNING
        ERROR = logging.ERROR
        VERBOSE = logging.DEBUG

    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    _logger = logging.getLogger("trioserve.python_backend")

    @classmethod
    def log(cls, message: str, level: int = INFO) -> None:
        cls._logger.log(level, "%s", message)

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.log(message, cls.INFO)

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.log(message, cls.WARNING)

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.log(message, cls.ERROR)

    @classmethod
    def log_verbose(cls, message: str) -> None:
        cls.log(message, cls.VERBOSE)
