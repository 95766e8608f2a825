"""Model folders in Triton's repository layout, for the tests that serve a repository.

A module of its own rather than a conftest.py fixture: pytest imports this folder as the
namespace package ``tests`` (importlib mode), so test modules import it relatively, as
``from ._model_repository import write_model`` here and ``from .._model_repository
import write_model`` one folder down. The folders with an ``__init__.py`` (workers, ipc)
are imported as packages of their own, with no way up to this module.
"""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_model(
    root: Path, name: str, config: str, code: str | None = None, *, version: str = "1"
) -> Path:
    """Write model ``name`` into the repository ``root``; its folder.

    ``root/name/config.pbtxt`` holds ``config`` and, where ``code`` is given,
    ``root/name/<version>/model.py`` holds ``code``; both are dedented, so either may be
    an indented triple-quoted string. The version folder is made even without code, as an
    ensemble needs. Writing a model again replaces its files, for the tests that change a
    model between loads.
    """
    folder = root / name
    (folder / version).mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(textwrap.dedent(config))
    if code is not None:
        (folder / version / "model.py").write_text(textwrap.dedent(code))
    return folder


def write_files(root: Path, files: dict[str, str]) -> Path:
    """Write each of ``files`` (a path under ``root``: its text, dedented) into ``root``,
    for layouts ``write_model`` does not make; ``root``."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root
