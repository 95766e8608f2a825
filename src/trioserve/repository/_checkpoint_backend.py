"""Hugging Face checkpoint folders in a Triton repository, served as generative models.

    <repository>/<model>/config.pbtxt       backend: "hf_checkpoint" (optional: a
                                            config.json beside the version folders or
                                            in them names the backend too)
    <repository>/<model>/<version>/         config.json, *.safetensors, tokenizer.json...
    <repository>/<model>/                   ...or the checkpoint itself, served as version 1

The config's ``parameters`` size the engine (string values, as config.pbtxt holds them):
``max_model_len``, ``num_kv_blocks``, ``block_size``, ``max_num_seqs``,
``max_num_batched_tokens`` and ``enable_prefix_caching`` ("true" or "false"); what they
leave out takes the checkpoint model's defaults. A ``KIND_GPU`` instance group serves on
the GPU. The inputs and outputs are the engine's own (``text_input`` -> ``text_output``).

The repository builds on the core only: the server hands it the function that reads a
checkpoint folder (``CheckpointLoader``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._model import Model
from ._config import CONFIG_FILE, ConfigError, complete_config, model_settings
from ._generated.model_config_pb2 import ModelConfig
from ._layout import Reading, chosen_versions, version_folders

BACKEND = "hf_checkpoint"
CHECKPOINT_FILE = "config.json"  # what tells a checkpoint folder

_INT_SETTINGS = (
    "max_model_len",
    "num_kv_blocks",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
)
_BOOL_SETTINGS = ("enable_prefix_caching",)


def read_checkpoint(reading: Reading) -> list[Model]:
    """One generative model per version folder (or the model folder as version 1)."""
    config, folder, loader = reading.config, reading.folder, reading.checkpoint_loader
    where = folder / CONFIG_FILE
    if loader is None:
        raise ConfigError(f"{where}: field 'backend': '{BACKEND}' is not available here")
    if config.input or config.output:
        raise ConfigError(
            f"{where}: fields 'input' and 'output': a checkpoint model serves the engine's "
            "own (text_input -> text_output); leave them out"
        )
    if not version_folders(folder) and (folder / CHECKPOINT_FILE).is_file():
        paths = {1: folder}
    else:
        paths = {v: folder / str(v) for v in chosen_versions(config, folder)}
    complete_config(config, folder)
    engine = engine_settings(config, where)
    device = model_settings(config, folder)["device"]
    models: list[Model] = []
    for version, path in sorted(paths.items()):
        try:
            models.append(
                loader(path, config.name, versions=(str(version),), device=device, **engine)
            )
        except ImportError as exc:
            raise ConfigError(
                f"{where}: the '{BACKEND}' backend needs {exc.name}: "
                "pip install 'trioserve[checkpoints]'"
            ) from None
        except Exception as exc:  # a bad checkpoint folder or engine size
            raise ConfigError(f"{path}: {exc}") from None
    return models


def engine_settings(config: ModelConfig, where: Path) -> dict[str, Any]:
    """The engine's settings among the config's parameters; any other key is refused,
    so that a misspelt one does not go unnoticed."""
    settings: dict[str, Any] = {}
    for key, parameter in config.parameters.items():
        value = parameter.string_value.strip()
        if key in _INT_SETTINGS:
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(
                    f"{where}: parameter '{key}': '{value}' is not a positive integer"
                )
            settings[key] = int(value)
        elif key in _BOOL_SETTINGS:
            if value.lower() not in ("true", "false"):
                raise ConfigError(f"{where}: parameter '{key}': '{value}' is not true or false")
            settings[key] = value.lower() == "true"
        else:
            known = ", ".join((*_INT_SETTINGS, *_BOOL_SETTINGS))
            raise ConfigError(f"{where}: parameter '{key}' is not known (known: {known})")
    return settings
