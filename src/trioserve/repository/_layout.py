"""Triton's repository layout: model folders, numeric version folders, the backend.

    <repository>/<model>/config.pbtxt            optional where the backend can tell
    <repository>/<model>/<version>/<model file>  model.py (python), model.onnx (onnxruntime),
                                                 config.json (hf_checkpoint: a Hugging Face
                                                 checkpoint, which may also lie in <model>/)

Folders whose name is not a number are ignored as versions, as in Triton.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ._config import CONFIG_FILE, ConfigError
from ._generated.model_config_pb2 import ModelConfig

# backend name -> (its platform name, the default model file name)
BACKENDS = {
    "python": ("", "model.py"),
    "onnxruntime": ("onnxruntime_onnx", "model.onnx"),
    "hf_checkpoint": ("", "config.json"),
}
_BY_PLATFORM = {platform: name for name, (platform, _) in BACKENDS.items() if platform}


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


def detect_backend(config: ModelConfig, folder: Path) -> str:
    """Fill in ``backend`` and ``platform`` from the config or from the files present."""
    if config.backend:
        backend = config.backend
    elif config.platform:
        backend = _BY_PLATFORM.get(config.platform, "")
        if not backend:
            raise ConfigError(
                f"{folder / CONFIG_FILE}: field 'platform': '{config.platform}' is not supported"
                f" (supported: {', '.join(sorted(_BY_PLATFORM))})"
            )
    else:
        backend = _backend_from_files(config, folder)
    if backend not in BACKENDS:
        raise ConfigError(
            f"{folder / CONFIG_FILE}: field 'backend': '{backend}' is not supported "
            f"(supported: {', '.join(sorted(BACKENDS))})"
        )
    config.backend = backend
    if not config.platform:
        config.platform = BACKENDS[backend][0]
    return backend


def _backend_from_files(config: ModelConfig, folder: Path) -> str:
    for version in version_folders(folder).values():
        for backend, (_, default_file) in BACKENDS.items():
            name = config.default_model_filename or default_file
            if (version / name).exists():
                return backend
    if (folder / BACKENDS["hf_checkpoint"][1]).is_file():
        return "hf_checkpoint"
    raise ConfigError(
        f"{folder / CONFIG_FILE}: fields 'backend' and 'platform': neither is set and no "
        f"version folder holds a file that names the backend ({_default_files()})"
    )


def _default_files() -> str:
    return ", ".join(file for _, file in BACKENDS.values())


def model_file(config: ModelConfig, version: Path) -> Path:
    """The version's model file: ``default_model_filename`` or the backend's default."""
    path = version / (config.default_model_filename or BACKENDS[config.backend][1])
    if not path.exists():
        raise ConfigError(f"{version}: the model file '{path.name}' is missing")
    return path
