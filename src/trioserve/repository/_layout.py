"""Triton's repository layout: model folders, numeric version folders, the backend.

    <repository>/<model>/config.pbtxt            optional where the backend can tell
    <repository>/<model>/<version>/<model file>  model.py (python), model.onnx (onnxruntime),
                                                 config.json (hf_checkpoint: a Hugging Face
                                                 checkpoint, which may also lie in <model>/)

Folders whose name is not a number are ignored as versions, as in Triton. Which backend
a folder names, and what each one's model file is, is ``_backends``' table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._generative import GenerativeModel
from .._served import ModelRepository
from ._config import CONFIG_FILE, ConfigError
from ._generated.model_config_pb2 import ModelConfig
from ._pb_metrics_export import CustomMetrics
from ._pb_options import PythonOptions

# (path, name, *, versions, device, engine settings...) -> the served model
CheckpointLoader = Callable[..., GenerativeModel]


@dataclass(frozen=True)
class Reading:
    """One model folder as its backend's ``read`` gets it: the config (read, with its
    backend and platform settled) and what the server lends the models it makes."""

    config: ModelConfig
    folder: Path
    default_file: str  # the backend's model file, when the config names none
    repository: ModelRepository  # what BLS and ensembles call
    strict: bool  # --strict-model-config: the config says everything, no auto-complete
    metrics: CustomMetrics | None  # the registry of the python backend's custom metrics
    checkpoint_loader: CheckpointLoader | None  # what makes an hf_checkpoint model
    python: PythonOptions | None = None  # python-backend instances: processes or threads

    def model_file(self, version: Path) -> Path:
        """The version's model file: ``default_model_filename`` or the backend's default."""
        path = version / (self.config.default_model_filename or self.default_file)
        if not path.exists():
            raise ConfigError(f"{version}: the model file '{path.name}' is missing")
        return path


def model_folders(roots: Sequence[Path]) -> dict[str, Path]:
    """Every model folder of the repositories by model name; a name found in two
    repositories is an error, as in Triton."""
    found: dict[str, Path] = {}
    for root in roots:
        if not root.is_dir():
            raise ConfigError(f"model repository '{root}' is not a directory")
        for folder in sorted(root.iterdir()):
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            if folder.name in found:
                raise ConfigError(
                    f"model '{folder.name}' appears in two repositories: "
                    f"'{found[folder.name].parent}' and '{root}'"
                )
            found[folder.name] = folder
    return found


def version_folders(folder: Path) -> dict[int, Path]:
    return {
        int(child.name): child
        for child in folder.iterdir()
        if child.is_dir() and child.name.isdigit()
    }


def chosen_versions(config: ModelConfig, folder: Path) -> list[int]:
    """The versions the config's version_policy serves, oldest first."""
    available = sorted(version_folders(folder))
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        chosen = available
    elif choice == "specific":
        missing = sorted(set(policy.specific.versions) - set(available))
        if missing:
            raise ConfigError(
                f"{folder / CONFIG_FILE}: field 'version_policy.specific': version "
                f"{missing[0]} has no folder"
            )
        chosen = sorted(policy.specific.versions)
    else:
        count = policy.latest.num_versions or 1
        chosen = available[-count:]
    if not chosen:
        raise ConfigError(f"{folder}: no version folder to serve (numeric folders hold versions)")
    return chosen
