"""How the server runs its Python-backend models: each instance in a process of its
own, or in a thread of the server, and the settings of those processes
(``--python-instance-mode``, ``--backend-config python,...``). A trioserve ``Model`` of
the own layout opts in by its ``parameters`` alone (``instance_mode``): the server's
mode does not apply to it, since its code may share state with the server or use the
server's trio loop."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .._backend_config import PythonBackendSettings
from ._config import ConfigError

MODE_PARAMETER = "TRIOSERVE_INSTANCE_MODE"


@dataclass(frozen=True)
class PythonOptions:
    """How the server runs Python-backend models."""

    mode: str = "thread"
    settings: PythonBackendSettings = field(default_factory=PythonBackendSettings)

    def mode_of(self, parameters: Mapping[str, str], name: str) -> str:
        return instance_mode(parameters, name, self.mode)


def instance_mode(parameters: Mapping[str, str], name: str, default: str = "thread") -> str:
    """The model's ``TRIOSERVE_INSTANCE_MODE``, else ``default``."""
    mode = parameters.get(MODE_PARAMETER, default)
    if mode not in ("thread", "process"):
        raise ConfigError(f"model '{name}': {MODE_PARAMETER} must be 'thread' or 'process'")
    return mode
