"""trioserve: an inference server on trio, wire-compatible with NVIDIA Triton.

The public API, re-exported by name; everything else lives in private modules.
"""

from ._config import ServerConfig
from ._errors import (
    AlreadyExistsError,
    CancelledError,
    ErrorKind,
    InferenceServerError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
)
from ._generative import DeviceDraw, GenerativeModel, SampledTokens, StepSequence
from ._limits import GrpcLimits, HttpLimits
from ._log_settings import LogConfig
from ._metrics_config import MetricsConfig
from ._model import DynamicBatching, FunctionModel, Model, TensorSpec, model
from ._restricted import Restriction
from ._sequence_batching import SequenceBatching, SequenceControl, SequenceState
from ._server import Server, open_server, serve
from ._stats import MemoryUsage
from ._types import (
    InferenceRequest,
    InferenceResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
)
from ._version import __version__
from .tracing import TraceConfig

__all__ = [
    "AlreadyExistsError",
    "CancelledError",
    "DeviceDraw",
    "DynamicBatching",
    "ErrorKind",
    "FunctionModel",
    "GenerativeModel",
    "GrpcLimits",
    "HttpLimits",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceServerError",
    "InputTensor",
    "InternalError",
    "InvalidArgumentError",
    "LogConfig",
    "MemoryUsage",
    "MetricsConfig",
    "Model",
    "NotFoundError",
    "OutputTensor",
    "RequestedOutput",
    "Restriction",
    "SampledTokens",
    "SequenceBatching",
    "SequenceControl",
    "SequenceState",
    "Server",
    "ServerConfig",
    "StepSequence",
    "TensorSpec",
    "TraceConfig",
    "UnavailableError",
    "UnsupportedError",
    "__version__",
    "model",
    "open_server",
    "serve",
]
