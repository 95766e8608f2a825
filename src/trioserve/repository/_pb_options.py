"""How the server runs its Python-backend models: each instance in a process of its
own, or in a thread of the server, and the settings of those processes
(``--python-instance-mode``, ``--backend-config python,...``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._backend_config import PythonBackendSettings
from ._config import ConfigError

MODE_PARAMETER = "TRIOSERVE_INSTANCE_MODE"


@dataclass(frozen=True)
class PythonOptions:
    """How the server runs Python-backend models."""

    mode: str = "thread"
    settings: PythonBackendSettings = field(default_factory=PythonBackendSettings)

    def mode_of(self, parameters: dict[str, str], name: str) -> str:
        mode = parameters.get(MODE_PARAMETER, self.mode)
        if mode not in ("thread", "process"):
            raise ConfigError(f"model '{name}': {MODE_PARAMETER} must be 'thread' or 'process'")
        return mode
