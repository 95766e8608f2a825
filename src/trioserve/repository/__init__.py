"""Triton model repositories: config.pbtxt, the Python and ONNX Runtime backends,
``triton_python_backend_utils``, and the repository API's load, unload and poll."""

from ._config import ConfigError as ConfigError
from ._manager import ControlMode as ControlMode
from ._manager import RepositoryManager as RepositoryManager
from ._manager import decode_file_parameters as decode_file_parameters
from ._onnx_options import configure as configure_onnxruntime

__all__ = [
    "ConfigError",
    "ControlMode",
    "RepositoryManager",
    "configure_onnxruntime",
    "decode_file_parameters",
]
from ._pb_processes import PythonOptions as PythonOptions
