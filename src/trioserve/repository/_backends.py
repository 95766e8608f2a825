"""The backends a Triton model folder may name, as one table.

A backend is a module whose ``read`` makes a folder's models from its ``Reading``, and a
row of ``BACKENDS``: config.pbtxt's ``backend`` name, its ``platform`` ("" where Triton
names none), the model file a version folder holds when ``default_model_filename``
names none, and the ``read``. ``detect_backend`` settles which row a folder takes: from
the config's ``backend`` or ``platform``, else from the files the folder holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .._model import Model
from ._checkpoint_backend import BACKEND as CHECKPOINT_BACKEND
from ._checkpoint_backend import CHECKPOINT_FILE, read_checkpoint
from ._config import CONFIG_FILE, ConfigError
from ._generated.model_config_pb2 import ModelConfig
from ._layout import Reading, version_folders
from ._pb_processes import read_python


@dataclass(frozen=True)
class Backend:
    name: str  # config.pbtxt's ``backend``
    platform: str  # config.pbtxt's ``platform``; "" when Triton has none for it
    default_file: str  # a version folder's model file
    read: Callable[[Reading], list[Model]]


def _read_onnx(reading: Reading) -> list[Model]:
    from ._onnx_backend import read_onnx  # onnxruntime only once a model needs it

    return read_onnx(reading)


BACKENDS = {
    backend.name: backend
    for backend in (
        Backend("python", "", "model.py", read_python),
        Backend("onnxruntime", "onnxruntime_onnx", "model.onnx", _read_onnx),
        Backend(CHECKPOINT_BACKEND, "", CHECKPOINT_FILE, read_checkpoint),
    )
}
_BY_PLATFORM = {backend.platform: backend for backend in BACKENDS.values() if backend.platform}


def detect_backend(config: ModelConfig, folder: Path) -> Backend:
    """The folder's backend, from the config or from the files present; fills in the
    config's ``backend`` and ``platform``."""
    if config.backend:
        name = config.backend
    elif config.platform:
        found = _BY_PLATFORM.get(config.platform)
        if found is None:
            raise ConfigError(
                f"{folder / CONFIG_FILE}: field 'platform': '{config.platform}' is not supported"
                f" (supported: {', '.join(sorted(_BY_PLATFORM))})"
            )
        name = found.name
    else:
        name = _backend_from_files(config, folder)
    backend = BACKENDS.get(name)
    if backend is None:
        raise ConfigError(
            f"{folder / CONFIG_FILE}: field 'backend': '{name}' is not supported "
            f"(supported: {', '.join(sorted(BACKENDS))})"
        )
    config.backend = name
    if not config.platform:
        config.platform = backend.platform
    return backend


def _backend_from_files(config: ModelConfig, folder: Path) -> str:
    for version in version_folders(folder).values():
        for backend in BACKENDS.values():
            if (version / (config.default_model_filename or backend.default_file)).exists():
                return backend.name
    if (folder / CHECKPOINT_FILE).is_file():
        return CHECKPOINT_BACKEND  # a checkpoint may lie in the model folder itself
    files = ", ".join(backend.default_file for backend in BACKENDS.values())
    raise ConfigError(
        f"{folder / CONFIG_FILE}: fields 'backend' and 'platform': neither is set and no "
        f"version folder holds a file that names the backend ({files})"
    )
