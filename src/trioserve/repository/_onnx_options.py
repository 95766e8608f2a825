"""What a config asks of ONNX Runtime: session options, execution providers, run options.

Triton's ONNX Runtime backend settings that ONNX Runtime's Python API can honour are
honoured; the others fail the load with a ``ConfigError`` naming them.

    parameters                                  -> ONNX Runtime
    intra_op_thread_count, inter_op_thread_count   the session's own thread pools
    execution_mode (0 sequential, 1 parallel)      SessionOptions.execution_mode
    enable_mem_arena, enable_mem_pattern           enable_cpu_mem_arena, enable_mem_pattern
    session.use_device_allocator_for_initializers  a session config entry
    memory.enable_memory_arena_shrinkage           a run config entry, every run
    cudnn_conv_algo_search, gpu_mem_limit,         CUDA provider options (KIND_GPU)
      arena_extend_strategy, do_copy_in_default_stream
    share_session_between_instances                instances always share one session
    optimization { graph { level } }            -1 basic, 1 extended, 2 none, else all
    optimization { execution_accelerators }     "cuda" (its parameters: CUDA options),
                                                "tensorrt", "openvino" where this ONNX
                                                Runtime has the provider
    model_operations { op_library_filename }    register_custom_ops_library

With ``--backend-config onnxruntime,enable-global-threadpool=1`` every session runs on
ONNX Runtime's global thread pools, created once per process
(``use_per_session_threads = False``): a repository of many models then holds two pools,
not two per model, and a model's thread counts are ignored, as in Triton. ONNX Runtime
refuses any session with pools of its own once the global ones exist, so they stay on
for the rest of the process (other servers in it, code that creates sessions itself).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._backend_config import OnnxRuntimeSettings
from ._config import ConfigError
from ._generated.model_config_pb2 import ModelConfig, ModelInstanceGroup

_THREADS = {"intra_op_thread_count": "intra_op_num_threads",
            "inter_op_thread_count": "inter_op_num_threads"}  # fmt: skip
_CUDA_PARAMETERS = ("cudnn_conv_algo_search", "gpu_mem_limit", "arena_extend_strategy",
                    "do_copy_in_default_stream")  # fmt: skip
_ARENA_STRATEGIES = {"0": "kNextPowerOfTwo", "1": "kSameAsRequested"}
_SHRINKAGE = "memory.enable_memory_arena_shrinkage"
_DEVICE_INITIALIZERS = "session.use_device_allocator_for_initializers"
_TENSORRT_NAMES = {
    "max_workspace_size_bytes": "trt_max_workspace_size",
    "int8_calibration_table_name": "trt_int8_calibration_table_name",
    "int8_use_native_calibration_table": "trt_int8_use_native_calibration_table",
}
_PRECISIONS = {"FP32": None, "FP16": "trt_fp16_enable", "BF16": "trt_bf16_enable",
               "INT8": "trt_int8_enable"}  # fmt: skip
_PROVIDERS = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider",
              "openvino": "OpenVINOExecutionProvider"}  # fmt: skip

logger = logging.getLogger("trioserve.repository")
_settings = OnnxRuntimeSettings()
_global_pools = threading.Lock()
_global_pools_ready = False


def configure(settings: OnnxRuntimeSettings) -> None:
    """The server's ``--backend-config onnxruntime,...`` settings, for the models it loads."""
    global _settings
    _settings = settings


def default_max_batch_size() -> int:
    return _settings.default_max_batch_size


def runtime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError(
            "the onnxruntime backend needs ONNX Runtime: pip install 'trioserve[onnx]'"
        ) from None
    return onnxruntime


def base_options(thread_counts: Mapping[str, int]) -> Any:
    """Session options on the global thread pools when they are on (created here the
    first time), else with the session's own pools of ``thread_counts`` threads."""
    global _global_pools_ready
    onnxruntime = runtime()
    options = onnxruntime.SessionOptions()
    with _global_pools:  # sessions are created from several worker threads at once
        if _settings.global_thread_pools and not _global_pools_ready:
            onnxruntime.set_global_thread_pool_sizes(
                _settings.intra_op_threads, _settings.inter_op_threads
            )
            _global_pools_ready = True
        shared = _global_pools_ready
    if shared:
        options.use_per_session_threads = False
        return options
    for key, count in thread_counts.items():
        setattr(options, _THREADS[key], count)
    return options


@dataclass
class SessionPlan:
    """Everything a session is created and run with."""

    options: Any
    providers: list[str | tuple[str, dict[str, str]]] = field(default_factory=list)
    run_entries: dict[str, str] = field(default_factory=dict)

    def run_options(self) -> Any:
        if not self.run_entries:
            return None
        options = runtime().RunOptions()
        for key, value in self.run_entries.items():
            options.add_run_config_entry(key, value)
        return options


def session_plan(config: ModelConfig, where: str) -> SessionPlan:
    """The session options, providers and run entries ``config`` asks for."""
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    own_threads = {k: _count(parameters[k], k, where) for k in _THREADS if k in parameters}
    plan = SessionPlan(base_options(own_threads))
    if any(own_threads.values()) and not plan.options.use_per_session_threads:
        logger.info("%s: the global thread pools are on: its thread counts are ignored", where)
    _session_parameters(plan, parameters, where)
    options = plan.options
    options.graph_optimization_level = _graph_level(config, where)
    for library in config.model_operations.op_library_filename:
        try:
            options.register_custom_ops_library(library)
        except Exception as exc:
            raise ConfigError(f"{where}: op library '{library}': {exc}") from None
    gpu = any(g.kind == ModelInstanceGroup.KIND_GPU for g in config.instance_group)
    plan.providers = _providers(config, parameters, gpu, where)
    return plan


def _session_parameters(plan: SessionPlan, parameters: Mapping[str, str], where: str) -> None:
    options = plan.options
    if "execution_mode" in parameters:
        mode = parameters["execution_mode"].strip()
        if mode not in ("0", "1"):
            raise ConfigError(f"{where}: parameter 'execution_mode': must be 0 or 1, not {mode!r}")
        modes = runtime().ExecutionMode
        options.execution_mode = modes.ORT_PARALLEL if mode == "1" else modes.ORT_SEQUENTIAL
    if "enable_mem_arena" in parameters:
        options.enable_cpu_mem_arena = _flag(
            parameters["enable_mem_arena"], "enable_mem_arena", where
        )
    if "enable_mem_pattern" in parameters:
        options.enable_mem_pattern = _flag(
            parameters["enable_mem_pattern"], "enable_mem_pattern", where
        )
    if _DEVICE_INITIALIZERS in parameters:
        value = "1" if _flag(parameters[_DEVICE_INITIALIZERS], _DEVICE_INITIALIZERS, where) else "0"
        options.add_session_config_entry(_DEVICE_INITIALIZERS, value)
    if _SHRINKAGE in parameters:
        plan.run_entries[_SHRINKAGE] = parameters[_SHRINKAGE]
    if "share_session_between_instances" in parameters:
        _flag(
            parameters["share_session_between_instances"], "share_session_between_instances", where
        )


def _graph_level(config: ModelConfig, where: str) -> Any:
    levels = runtime().GraphOptimizationLevel
    level = config.optimization.graph.level
    chosen = {-1: levels.ORT_ENABLE_BASIC, 1: levels.ORT_ENABLE_EXTENDED, 2: levels.ORT_DISABLE_ALL}
    if level not in (0, *chosen):
        raise ConfigError(
            f"{where}: field 'optimization.graph.level': {level} is not -1, 0, 1 or 2"
        )
    return chosen.get(level, levels.ORT_ENABLE_ALL)


def _providers(
    config: ModelConfig, parameters: Mapping[str, str], gpu: bool, where: str
) -> list[str | tuple[str, dict[str, str]]]:
    available = set(runtime().get_available_providers())
    accelerators = config.optimization.execution_accelerators
    chosen: list[str | tuple[str, dict[str, str]]] = []
    for accelerator in accelerators.cpu_execution_accelerator:
        if accelerator.name != "openvino":
            raise ConfigError(
                f"{where}: field 'optimization.execution_accelerators': unknown CPU "
                f"execution accelerator '{accelerator.name}'"
            )
        chosen.append((_provider("openvino", available, where), dict(accelerator.parameters)))
    cuda_options = {
        k: _cuda_option(k, parameters[k], where) for k in _CUDA_PARAMETERS if k in parameters
    }
    if gpu:
        for accelerator in accelerators.gpu_execution_accelerator:
            if accelerator.name == "cuda":
                cuda_options.update(accelerator.parameters)
            elif accelerator.name == "tensorrt":
                provider = _provider("tensorrt", available, where)
                chosen.append((provider, _tensorrt_options(accelerator.parameters, where)))
            else:
                raise ConfigError(
                    f"{where}: field 'optimization.execution_accelerators': unknown GPU "
                    f"execution accelerator '{accelerator.name}'"
                )
        if "CUDAExecutionProvider" not in available:
            raise ConfigError(
                f"{where}: field 'instance_group': KIND_GPU needs ONNX Runtime's "
                "CUDAExecutionProvider, which this onnxruntime does not have (install "
                "onnxruntime-gpu, or use KIND_CPU)"
            )
        chosen.append(("CUDAExecutionProvider", cuda_options))
    chosen.append("CPUExecutionProvider")
    return chosen


def _provider(name: str, available: set[str], where: str) -> str:
    provider = _PROVIDERS[name]
    if provider not in available:
        raise ConfigError(
            f"{where}: field 'optimization.execution_accelerators': '{name}' needs ONNX "
            f"Runtime's {provider}, which this onnxruntime does not have"
        )
    return provider


def _tensorrt_options(parameters: Mapping[str, str], where: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for key, value in parameters.items():
        if key == "precision_mode":
            if value not in _PRECISIONS:
                raise ConfigError(f"{where}: tensorrt parameter 'precision_mode': {value!r}")
            flag = _PRECISIONS[value]
            if flag:
                options[flag] = "1"
        elif key in _TENSORRT_NAMES:
            options[_TENSORRT_NAMES[key]] = value
        elif key.startswith("trt_"):
            options[key] = value
        else:
            raise ConfigError(f"{where}: tensorrt parameter '{key}' is not supported")
    return options


def _cuda_option(key: str, value: str, where: str) -> str:
    if key == "arena_extend_strategy":
        if value.strip() not in _ARENA_STRATEGIES:
            raise ConfigError(f"{where}: parameter 'arena_extend_strategy': must be 0 or 1")
        return _ARENA_STRATEGIES[value.strip()]
    if key == "cudnn_conv_algo_search":
        algorithms = {"0": "EXHAUSTIVE", "1": "HEURISTIC", "2": "DEFAULT"}
        if value.strip() not in algorithms:
            raise ConfigError(f"{where}: parameter 'cudnn_conv_algo_search': must be 0, 1 or 2")
        return algorithms[value.strip()]
    return value.strip()


def _count(value: str, key: str, where: str) -> int:
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ConfigError(f"{where}: parameter '{key}': must be an integer >= 0, not {value!r}")
    return count


def _flag(value: str, key: str, where: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "on", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise ConfigError(f"{where}: parameter '{key}': must be a boolean (0/1, true/false)")
