"""trioserve's own repository layout: models defined in Python, no config.pbtxt.

Layout (Triton's, with ``model.py`` in place of ``config.pbtxt`` + backend)::

    DIR/<model name>/model.py            one model; its versions as it declares them
    DIR/<model name>/<version>/model.py  one model.py per numeric version

Each ``model.py`` defines a module-level ``model``: a ``trioserve.Model`` (for example one
made with ``@trioserve.model``). The folder names the model, as in Triton. A model whose
``parameters`` ask for ``TRIOSERVE_INSTANCE_MODE: process`` is served by
``_own_processes`` (the server reads its files with ``model_files``; each instance's
process imports its model.py again with ``load_model_file``).
"""

from __future__ import annotations

from pathlib import Path

from .._model import Model
from .._model_import import import_model_code


class RepositoryError(Exception):
    """The repository folder does not describe servable models."""


def load_repository(root: Path) -> list[Model]:
    if not root.is_dir():
        raise RepositoryError(f"model repository {str(root)!r} is not a directory")
    models = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        models.extend(load_model_folder(folder))
    if not models:
        raise RepositoryError(f"model repository {str(root)!r} holds no models")
    return models


def load_model_folder(folder: Path) -> list[Model]:
    """One model folder's models: its model.py, or one per numeric version folder."""
    return [load_model_file(path, folder.name, version) for path, version in model_files(folder)]


def model_files(folder: Path) -> list[tuple[Path, str | None]]:
    """Each model.py of a model folder, with the version folder it lies in (None: the
    one model.py beside them)."""
    if (folder / "model.py").is_file():
        return [(folder / "model.py", None)]
    versions = sorted(
        (v for v in folder.iterdir() if v.is_dir() and v.name.isdigit()),
        key=lambda v: int(v.name),
    )
    if not versions:
        raise RepositoryError(f"{folder}: no model.py and no numeric version folders")
    for version in versions:
        if not (version / "model.py").is_file():
            raise RepositoryError(f"{version}: missing model.py")
    return [(version / "model.py", version.name) for version in versions]


def load_model_file(path: Path, name: str, version: str | None) -> Model:
    """The ``model`` of one model.py, named after its folder; ``version``: the version
    folder it lies in (None: beside them, serving the versions it declares)."""
    module_name = f"trioserve_repository.{name}.v{version or 'default'}"
    module = import_model_code(path, module_name, name, RepositoryError)
    loaded = getattr(module, "model", None)
    if not isinstance(loaded, Model):
        raise RepositoryError(f"{path}: defines no module-level 'model' that is a trioserve.Model")
    loaded.name = name
    if version is not None:
        loaded.versions = (version,)
    return loaded
