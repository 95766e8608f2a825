"""The server's configuration: frozen and validated when built.

Names: ``http_*`` and ``grpc_*`` for what belongs to one front end, ``_s`` for seconds,
``"builtin"`` for each front end's own server. Older names are still accepted, with a
``DeprecationWarning`` (``_RENAMED``): the keywords ``tls_certfile``, ``tls_keyfile``,
``repository_poll_secs`` and ``grpc_max_message_bytes`` (now
``grpc_limits.max_message_bytes``, still readable here), and the values ``"stdlib"`` and
``"trio"`` of ``http_server`` and ``grpc_server`` (without a warning: they are
``trioserve run``'s flag values too).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._backend_config import onnxruntime_settings, python_settings
from ._limits import MAX_SHARED_MEMORY_REGIONS, GrpcLimits, HttpLimits
from ._log_settings import LogConfig
from ._metrics_config import MetricsConfig
from ._model import Model
from ._restricted import Restriction, check_restrictions
from .tracing import TraceConfig

PYTHON_INSTANCE_MODES = ("thread", "process")


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``serve`` needs. Ports of 0 bind a free port; ``None`` turns a front end off."""

    models: Sequence[Model] = ()
    host: str = "127.0.0.1"
    http_port: int | None = 8000
    grpc_port: int | None = 8001
    # "stdlib": the old name of "builtin", which it becomes
    http_server: Literal["builtin", "hypercorn", "stdlib"] = "builtin"
    http_tls_certfile: str | None = None  # hypercorn only
    http_tls_keyfile: str | None = None
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    # "trio": the old name of "builtin", which it becomes
    grpc_server: Literal["builtin", "grpclib", "trio"] = "builtin"
    grpc_limits: GrpcLimits = field(default_factory=GrpcLimits)
    grpc_tls_certfile: str | None = None  # the built-in gRPC server only
    grpc_tls_keyfile: str | None = None
    exit_timeout_s: float = 30.0  # graceful shutdown: how long in-flight requests may finish
    max_shared_memory_regions: int = MAX_SHARED_MEMORY_REGIONS  # system and CUDA together
    # --workers N: each worker's shared memory for the large bodies and tensors it has
    # sent the core and not yet had back (the core's answers are read from the core's)
    worker_arena_max_bytes: int = 1024 * 1024 * 1024
    # API group ("shared-memory", ...) -> the header its requests must carry, per transport
    http_restricted_apis: Mapping[str, Restriction] = field(default_factory=dict)
    grpc_restricted_apis: Mapping[str, Restriction] = field(default_factory=dict)
    # Show the deprecated vLLM metric families that release ("0.9") deprecated.
    show_hidden_metrics_for_version: str | None = None
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    response_cache_bytes: int = 0  # server-wide response cache size; 0: no cache
    # Triton model repositories (config.pbtxt, Python and ONNX Runtime backends)
    model_repositories: Sequence[Path] = ()
    model_control_mode: Literal["none", "poll", "explicit"] = "none"
    load_models: Sequence[str] = ()  # explicit mode: loaded at startup ("*": all)
    repository_poll_s: float = 15.0
    strict_model_config: bool = False  # no auto-complete: config.pbtxt says everything
    model_load_thread_count: int = 4  # models loading at once (Triton's default)
    # A load whose import or initialize takes longer fails (its thread is left behind);
    # 0: no limit.
    model_load_timeout_s: float = 600.0
    # --backend-config: backend -> its settings (``_backend_config``: onnxruntime, python)
    backend_config: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Where a Python-backend model's instances run (a model's config.pbtxt parameter
    # TRIOSERVE_INSTANCE_MODE chooses for itself): "thread", in worker threads of the
    # server (embedding and the testing kit: one process, exact); "process", each in a
    # process of its own, as Triton runs them (``trioserve run``'s default).
    python_instance_mode: str = "thread"
    # A model that fails to load at startup stops the server ("failed to load all
    # models"); ``trioserve run`` sets it, as Triton's --exit-on-error defaults to true.
    exit_on_error: bool = False
    # Readiness (REST /v2/health/ready, gRPC ServerReady) says no while a model that
    # should serve failed to load or is loading, as Triton's --strict-readiness.
    strict_readiness: bool = True
    status_page: bool = True  # GET / and /status on the HTTP port: the live status page
    trace: TraceConfig = field(default_factory=TraceConfig)  # the trace extension's startup
    # The logging extension's startup settings; None leaves logger "trioserve" as the
    # embedding application set it, until a client changes a setting.
    log: LogConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        for port in (self.http_port, self.grpc_port):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"invalid port {port}")
        object.__setattr__(
            self, "http_server", _OLD_SERVER_NAMES.get(self.http_server, self.http_server)
        )
        object.__setattr__(
            self, "grpc_server", _OLD_SERVER_NAMES.get(self.grpc_server, self.grpc_server)
        )
        if self.http_server not in ("builtin", "hypercorn"):
            raise ValueError(
                f"http_server must be 'builtin' or 'hypercorn', not {self.http_server!r}"
            )
        if self.grpc_server not in ("builtin", "grpclib"):
            raise ValueError(
                f"grpc_server must be 'builtin' or 'grpclib', not {self.grpc_server!r}"
            )
        if (self.grpc_tls_certfile is None) != (self.grpc_tls_keyfile is None):
            raise ValueError("gRPC TLS needs both a certificate and a key file")
        if self.grpc_tls_certfile is not None and self.grpc_server != "builtin":
            raise ValueError(
                "gRPC TLS is served by the built-in gRPC server (grpc_server='builtin')"
            )
        if (self.http_tls_certfile is None) != (self.http_tls_keyfile is None):
            raise ValueError("TLS needs both a certificate and a key file")
        if self.http_tls_certfile is not None and self.http_server != "hypercorn":
            raise ValueError("TLS is served by the hypercorn HTTP server (http_server='hypercorn')")
        if self.exit_timeout_s < 0:
            raise ValueError("exit_timeout_s must be >= 0")
        if self.max_shared_memory_regions < 0:
            raise ValueError("max_shared_memory_regions must be >= 0")
        if self.worker_arena_max_bytes <= 0:
            raise ValueError("worker_arena_max_bytes must be > 0")
        check_restrictions(self.http_restricted_apis)
        check_restrictions(self.grpc_restricted_apis)
        if self.response_cache_bytes < 0:
            raise ValueError("response_cache_bytes must be >= 0")
        onnxruntime_settings(self.backend_config)  # raises for an unknown or bad setting
        python_settings(self.backend_config)
        if self.python_instance_mode not in PYTHON_INSTANCE_MODES:
            raise ValueError(
                f"python_instance_mode must be one of {', '.join(PYTHON_INSTANCE_MODES)}"
            )
        object.__setattr__(self, "model_repositories", tuple(map(Path, self.model_repositories)))
        if self.model_control_mode not in ("none", "poll", "explicit"):
            raise ValueError("model_control_mode must be 'none', 'poll' or 'explicit'")
        if self.repository_poll_s <= 0:
            raise ValueError("repository_poll_s must be > 0")
        if self.model_load_thread_count < 1:
            raise ValueError("model_load_thread_count must be >= 1")
        if self.model_load_timeout_s < 0:
            raise ValueError("model_load_timeout_s must be >= 0 (0: no limit)")

    @property
    def grpc_max_message_bytes(self) -> int:
        """The largest gRPC message either way: ``grpc_limits.max_message_bytes``."""
        return self.grpc_limits.max_message_bytes


_OLD_SERVER_NAMES = {"stdlib": "builtin", "trio": "builtin"}
# Keywords ServerConfig took before they were renamed -> their names now.
_RENAMED = {
    "tls_certfile": "http_tls_certfile",
    "tls_keyfile": "http_tls_keyfile",
    "repository_poll_secs": "repository_poll_s",
}


def _taking_old_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """``ServerConfig.__init__`` that still takes the renamed keywords, with a warning."""

    @functools.wraps(init)
    def __init__(self: ServerConfig, *args: Any, **kwargs: Any) -> None:
        for old in kwargs.keys() & {*_RENAMED, "grpc_max_message_bytes"}:
            new = _RENAMED.get(old, "grpc_limits.max_message_bytes")
            warnings.warn(f"ServerConfig({old}=...) is now {new}", DeprecationWarning, stacklevel=2)
            if old in _RENAMED:
                kwargs[_RENAMED[old]] = kwargs.pop(old)
        if "grpc_max_message_bytes" in kwargs:
            limits = kwargs.get("grpc_limits", GrpcLimits())
            size = kwargs.pop("grpc_max_message_bytes")
            kwargs["grpc_limits"] = dataclasses.replace(limits, max_message_bytes=size)
        init(self, *args, **kwargs)

    return __init__


ServerConfig.__init__ = _taking_old_keywords(ServerConfig.__init__)  # type: ignore[method-assign]
