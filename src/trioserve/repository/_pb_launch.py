"""How an instance process starts: which interpreter, which command, which environment.

The process runs ``python -m trioserve.repository._pb_stub FD`` with ``PYTHONPATH`` set
to a folder that holds only the modules the stub imports (``STUB_MODULES``, copied once
per server process into a temporary folder, removed at exit), so that it needs nothing
of the server's environment but numpy: a model's ``EXECUTION_ENV_PATH`` (a folder
holding a Python environment, a venv or an unpacked conda-pack archive, with
``bin/python``) runs it under that environment's interpreter and libraries. A trioserve
``Model``'s process imports trioserve itself (its model.py does): its ``PYTHONPATH``
names the server's own package first (``InstanceSpec.whole_package``). Here too:
what an instance starts with (``InstanceSpec``), when it is started again
(``RestartPolicy``), and how an ended process is told.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PACKAGE = Path(__file__).parents[1]  # trioserve/
STUB_MODULE = "trioserve.repository._pb_stub"
# What the stub imports of trioserve, relative to the package: no trio, no protobuf.
STUB_MODULES = (
    "_errors.py",
    "_model_import.py",
    "_tensor.py",
    "_types.py",
    "ipc/_arena.py",
    "ipc/_blocking.py",
    "ipc/_frames.py",
    "ipc/_windows.py",
    "repository/_auto_complete.py",
    "repository/_pb_execution.py",
    "repository/_pb_inspect.py",
    "repository/_pb_loop.py",
    "repository/_pb_metrics.py",
    "repository/_pb_remote.py",
    "repository/_pb_requests.py",
    "repository/_pb_serving.py",
    "repository/_pb_stub.py",
    "repository/_pb_tensors.py",
    "repository/_pb_turns.py",
    "repository/_pb_utils.py",
    "repository/_pb_windows.py",
    "repository/_pb_wire.py",
)
ENV_PARAMETER = "EXECUTION_ENV_PATH"

_lock = threading.Lock()
_folder: Path | None = None


def stub_path() -> Path:
    """The folder the stub's ``PYTHONPATH`` names (made on first use)."""
    global _folder
    with _lock:
        if _folder is None:
            folder = Path(tempfile.mkdtemp(prefix="trioserve-stub-"))
            for relative in STUB_MODULES:
                target = folder / "trioserve" / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(_PACKAGE / relative, target)
            for package in ("", "ipc", "repository"):
                (folder / "trioserve" / package / "__init__.py").write_text(
                    '"""What an instance process imports of trioserve."""\n'
                )
            atexit.register(shutil.rmtree, folder, True)
            _folder = folder
        return _folder


def interpreter(model_parameters: Mapping[str, str], model_dir: Path) -> str:
    """The Python that runs the model's instances: its ``EXECUTION_ENV_PATH``'s, or the
    server's own. A relative path is read from the model's folder, as Triton reads it
    (``$$TRITON_MODEL_DIRECTORY`` names that folder too)."""
    environment = model_parameters.get(ENV_PARAMETER)
    if not environment:
        return sys.executable
    environment = environment.replace("$$TRITON_MODEL_DIRECTORY", str(model_dir))
    path = model_dir / environment
    python = path / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{ENV_PARAMETER} '{environment}': no bin/python in {path}")
    return str(python)


def command(python: str, argument: str) -> list[str]:
    """The stub's command: ``argument`` is its end of the link (a descriptor number), or
    ``_pb_inspect.INSPECT``."""
    return [python, "-m", STUB_MODULE, argument]


def environment(gpu: int | None, whole_package: bool = False) -> dict[str, str]:
    """The server's environment, but the stub's path (or, ``whole_package``, the
    server's trioserve before the server's own path); ``CUDA_VISIBLE_DEVICES`` for a
    KIND_GPU instance's device."""
    env = dict(os.environ)
    if whole_package:
        paths = [str(_PACKAGE.parent), *filter(None, [env.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        env["PYTHONPATH"] = str(stub_path())
    env.pop("PYTHONHOME", None)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


@dataclass(frozen=True)
class RestartPolicy:
    deaths: int = 3  # deaths within the window that leave an instance down
    window_s: float = 60.0
    stop_timeout_s: float = 30.0  # finalize's time to end before the process is killed


@dataclass(frozen=True)
class InstanceSpec:
    """What an instance process is started with."""

    model: str
    instance: str
    python: str
    gpu: int | None
    default_bytes: int
    growth_bytes: int
    settings: dict[str, Any]  # the stub's ``init`` frame
    whole_package: bool = False  # a trioserve Model's: its process imports all of trioserve


def how_it_ended(status: int | None) -> str:
    if status is None:
        return "its process is gone"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"its process was killed by {name}"
    return f"its process exited with status {status}"
