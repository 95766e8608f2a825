"""``--backend-config BACKEND,KEY=VALUE``: server-wide settings of a backend, as Triton
takes them. The ``onnxruntime`` backend's:

    enable-global-threadpool   1: every ONNX Runtime session shares one intra-op and one
                               inter-op thread pool (a model's own thread counts are then
                               ignored, as in Triton); 0 (the default): a pool per session
    intra_op_thread_count      the shared intra-op pool's size (0: ONNX Runtime's default,
    inter_op_thread_count      one thread per physical core); likewise the inter-op pool
    default-max-batch-size     the max_batch_size auto-complete gives a batching model (4)

The ``python`` backend's, for instances in processes of their own:

    shm-default-byte-size      each instance's shared-memory arena at first (1 MiB)
    shm-growth-byte-size       what it grows by when full (1 MiB; more for a larger tensor)
    stub-timeout-seconds       how long an unloading instance's finalize may take before
                               its process is killed (30)
    instance-restart-limit     deaths within the window that leave an instance down,
                               the model UNAVAILABLE (3)
    instance-restart-window-seconds   that window (60)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class OnnxRuntimeSettings:
    global_thread_pools: bool = False
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    default_max_batch_size: int = 4


_ONNXRUNTIME_KEYS = ("enable-global-threadpool", "intra_op_thread_count",
                     "inter_op_thread_count", "default-max-batch-size")  # fmt: skip


@dataclass(frozen=True)
class PythonBackendSettings:
    shm_default_bytes: int = 1 << 20
    shm_growth_bytes: int = 1 << 20
    stub_timeout_s: float = 30.0
    restart_limit: int = 3
    restart_window_s: float = 60.0


_PYTHON_KEYS = ("shm-default-byte-size", "shm-growth-byte-size", "stub-timeout-seconds",
                "instance-restart-limit", "instance-restart-window-seconds")  # fmt: skip


def parse_backend_setting(text: str) -> tuple[str, str, str]:
    """``BACKEND,KEY=VALUE`` -> (backend, key, value); ValueError says what is wrong."""
    backend, _, setting = text.partition(",")
    key, equals, value = setting.partition("=")
    if not backend or not key or not equals:
        raise ValueError(f"--backend-config {text!r}: expected BACKEND,KEY=VALUE")
    return backend.strip(), key.strip(), value.strip()


def onnxruntime_settings(config: Mapping[str, Mapping[str, str]]) -> OnnxRuntimeSettings:
    """The ``onnxruntime`` settings of a backend config; ValueError for anything else."""
    for backend in config:
        if backend not in ("onnxruntime", "python"):
            raise ValueError(f"backend_config: backend '{backend}' has no settings here")
    settings = config.get("onnxruntime", {})
    for key in settings:
        if key not in _ONNXRUNTIME_KEYS:
            raise ValueError(
                f"backend_config: onnxruntime has no setting '{key}' "
                f"(it has {', '.join(_ONNXRUNTIME_KEYS)})"
            )
    pools = settings.get("enable-global-threadpool", "0")
    if pools not in ("0", "1"):
        raise ValueError("backend_config: onnxruntime,enable-global-threadpool must be 0 or 1")
    return OnnxRuntimeSettings(
        global_thread_pools=pools == "1",
        intra_op_threads=_count(settings, "intra_op_thread_count", 0),
        inter_op_threads=_count(settings, "inter_op_thread_count", 0),
        default_max_batch_size=_count(settings, "default-max-batch-size", 4),
    )


def python_settings(config: Mapping[str, Mapping[str, str]]) -> PythonBackendSettings:
    """The ``python`` settings of a backend config; ValueError for a bad one."""
    settings = config.get("python", {})
    for key in settings:
        if key not in _PYTHON_KEYS:
            raise ValueError(
                f"backend_config: python has no setting '{key}' (it has {', '.join(_PYTHON_KEYS)})"
            )
    defaults = PythonBackendSettings()
    return PythonBackendSettings(
        shm_default_bytes=_positive(settings, "shm-default-byte-size", defaults.shm_default_bytes),
        shm_growth_bytes=_positive(settings, "shm-growth-byte-size", defaults.shm_growth_bytes),
        stub_timeout_s=_positive(settings, "stub-timeout-seconds", int(defaults.stub_timeout_s)),
        restart_limit=_positive(settings, "instance-restart-limit", defaults.restart_limit),
        restart_window_s=_positive(
            settings, "instance-restart-window-seconds", int(defaults.restart_window_s)
        ),
    )


def _positive(settings: Mapping[str, str], key: str, default: int) -> int:
    value = _count(settings, key, default, "python")
    if value < 1:
        raise ValueError(f"backend_config: python,{key} must be an integer >= 1")
    return value


def _count(
    settings: Mapping[str, str], key: str, default: int, backend: str = "onnxruntime"
) -> int:
    value = settings.get(key, str(default))
    if not value.isdigit():
        raise ValueError(f"backend_config: {backend},{key} must be an integer >= 0")
    return int(value)
