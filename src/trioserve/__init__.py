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
from ._generative import GenerativeModel, StepSequence
from ._limits import HttpLimits
from ._model import DynamicBatching, FunctionModel, Model, TensorSpec, model
from ._server import Server, open_server, serve
from ._types import (
    InferenceRequest,
    InferenceResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
)
from ._version import __version__

__all__ = [
    "AlreadyExistsError",
    "CancelledError",
    "DynamicBatching",
    "ErrorKind",
    "FunctionModel",
    "GenerativeModel",
    "HttpLimits",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceServerError",
    "InputTensor",
    "InternalError",
    "InvalidArgumentError",
    "Model",
    "NotFoundError",
    "OutputTensor",
    "RequestedOutput",
    "Server",
    "ServerConfig",
    "StepSequence",
    "TensorSpec",
    "UnavailableError",
    "UnsupportedError",
    "__version__",
    "model",
    "open_server",
    "serve",
]
