"""One model folder -> the ``Model`` of each version it serves.

    read config.pbtxt (or the load request's override)
    -> the backend, from the config or the files
    -> the versions the version_policy picks
    -> the backend completes the config from the model (unless strict)
    -> Triton's defaults and checks -> one Model per version

A folder in trioserve's own layout (a ``model.py`` defining ``model``, no config.pbtxt)
is read as before, by ``_own_layout`` (its models that ask for processes of their own
served by ``_own_processes``); any other by its backend's row of ``_backends``.
"""

from __future__ import annotations

from pathlib import Path

from .._model import Model
from .._served import ModelRepository
from ._backends import detect_backend
from ._config import (
    CONFIG_FILE,
    ConfigError,
    complete_config,
    config_document,
    model_settings,
    read_config,
)
from ._ensemble import PLATFORM as ENSEMBLE
from ._ensemble import EnsembleModel, ensemble_steps
from ._generated.model_config_pb2 import ModelConfig
from ._layout import CheckpointLoader, Reading, chosen_versions, version_folders
from ._own_layout import RepositoryError
from ._own_processes import read_own
from ._pb_metrics_export import CustomMetrics
from ._pb_options import PythonOptions


def read_model(
    folder: Path,
    repository: ModelRepository,
    *,
    override: str | None = None,
    strict: bool = False,
    metrics: CustomMetrics | None = None,
    checkpoint_loader: CheckpointLoader | None = None,
    python: PythonOptions | None = None,
) -> list[Model]:
    """The folder's models, one per version; ConfigError says why it cannot serve."""
    if override is None and _own_layout(folder):
        try:
            return read_own(folder, repository, python or PythonOptions())
        except RepositoryError as exc:
            raise ConfigError(str(exc)) from None
    if strict and override is None and not (folder / CONFIG_FILE).is_file():
        raise ConfigError(f"{folder / CONFIG_FILE}: missing (--strict-model-config)")
    config = read_config(folder, override)
    if config.platform == ENSEMBLE:
        return _read_ensemble(config, folder, repository)
    backend = detect_backend(config, folder)
    reading = Reading(
        config,
        folder,
        backend.default_file,
        repository,
        strict,
        metrics,
        checkpoint_loader,
        python,
    )
    return backend.read(reading)


def _read_ensemble(config: ModelConfig, folder: Path, repository: ModelRepository) -> list[Model]:
    versions = chosen_versions(config, folder)  # an ensemble's version folders are empty
    complete_config(config, folder)
    del config.instance_group[:]  # its steps' models have instances; it has none
    settings = model_settings(config, folder)
    steps = ensemble_steps(config, folder)
    document = config_document(config)
    return [EnsembleModel(steps, config, v, repository, document, **settings) for v in versions]


def _own_layout(folder: Path) -> bool:
    """trioserve's layout: no config.pbtxt, and a model.py defining ``model`` (not
    ``TritonPythonModel``) beside the version folders or in them."""
    if (folder / CONFIG_FILE).is_file():
        return False
    if (folder / "model.py").is_file():
        return True
    files = [v / "model.py" for v in version_folders(folder).values()]
    present = [f for f in files if f.is_file()]
    return bool(present) and all("TritonPythonModel" not in f.read_text() for f in present)
