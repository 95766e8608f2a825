"""Triton model repositories: config.pbtxt, the Python and ONNX Runtime backends,
``triton_python_backend_utils``, and the repository API's load, unload and poll."""

from ._config import ConfigError as ConfigError
from ._manager import ControlMode as ControlMode
from ._manager import RepositoryManager as RepositoryManager
from ._onnx_options import configure as configure_onnxruntime
from ._own_layout import RepositoryError as RepositoryError
from ._own_layout import load_repository as load_repository

__all__ = [
    "ConfigError",
    "ControlMode",
    "RepositoryError",
    "RepositoryManager",
    "configure_onnxruntime",
    "load_repository",
]
from ._pb_options import PythonOptions as PythonOptions
