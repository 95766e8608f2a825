"""The package's shape: public API, import direction, CLI, model repository loading."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

import trioserve
from trioserve._cli import _parser, config_from_args
from trioserve.repository import RepositoryError, load_repository

SRC = Path(trioserve.__file__).parent


def test_public_api_is_what_we_mean():
    assert sorted(trioserve.__all__) == sorted(
        [
            "AlreadyExistsError",
            "CancelledError",
            "DeviceDraw",
            "DynamicBatching",
            "ErrorKind",
            "FunctionModel",
            "GenerativeModel",
            "GrpcLimits",
            "HttpLimits",
            "InferenceRequest",
            "InferenceResponse",
            "InferenceServerError",
            "InputTensor",
            "InternalError",
            "InvalidArgumentError",
            "LogConfig",
            "MemoryUsage",
            "MetricsConfig",
            "Model",
            "NotFoundError",
            "OutputTensor",
            "RequestedOutput",
            "Restriction",
            "SampledTokens",
            "SequenceBatching",
            "SequenceControl",
            "SequenceState",
            "Server",
            "ServerConfig",
            "StepSequence",
            "TensorSpec",
            "TraceConfig",
            "UnavailableError",
            "UnsupportedError",
            "__version__",
            "model",
            "open_server",
            "serve",
        ]
    )
    for name in trioserve.__all__:
        assert getattr(trioserve, name) is not None


def test_testing_api_is_what_we_mean():
    import trioserve.testing

    assert sorted(trioserve.testing.__all__) == sorted(
        [
            "BatchStat",
            "DurationStat",
            "ExecutedBatch",
            "ExecutedStep",
            "FailureReason",
            "GatedModel",
            "GrpcCallError",
            "GrpcChannel",
            "ModelStatistics",
            "StreamingCall",
            "TimedLM",
            "TimedModel",
            "batch_size_counts",
            "gated",
            "model_statistics",
            "open_grpc_channel",
            "open_test_server",
            "server_in_thread",
            "timed",
        ]
    )
    for name in trioserve.testing.__all__:
        assert getattr(trioserve.testing, name) is not None
    # What a running server offers in-process.
    server_api = {name for name in vars(trioserve.Server) if not name.startswith("_")}
    server_api |= {f.name for f in dataclasses.fields(trioserve.Server)}
    assert {"infer", "generate", "rest_app"} <= server_api


# Which top-level parts of the package may not import which (ARCHITECTURE.md's import
# rule: _cli -> _server -> rest | grpc -> scheduler, metrics -> shm, core).
_ABOVE_CORE = {
    "rest",
    "grpc",
    "testing",
    "_cli",
    "_server",
    "scheduler",
    "metrics",
    "shm",
    "models",
    "repository",
    "workers",
}
FORBIDDEN = {
    "__init__": {"testing"},
    "__main__": {"testing"},
    "_cli": {"testing"},
    "_server": {"workers", "testing", "_cli"},
    "_alternatives": {
        "workers",
        "testing",
        "_cli",
        "_server",
    },  # the optional front ends, for _server
    # Front-end worker processes: beside _server (the CLI starts them over a server).
    "workers": {"testing", "_cli", "_server"},
    "rest": {"workers", "grpc", "testing", "_cli", "_server"},
    "grpc": {"workers", "rest", "testing", "_cli", "_server"},
    "scheduler": {
        "workers",
        "rest",
        "grpc",
        "testing",
        "_cli",
        "_server",
        "metrics",
        "models",
        "repository",
    },
    # Triton repositories build on the core only; the server hands them its runners.
    "repository": {
        "workers",
        "rest",
        "grpc",
        "testing",
        "_cli",
        "_server",
        "scheduler",
        "metrics",
        "models",
    },
    "metrics": {"workers", "rest", "grpc", "testing", "_cli", "_server", "models"},
    "shm": _ABOVE_CORE - {"shm"},
    "models": {"workers", "rest", "grpc", "testing", "_cli", "_server"},
    "testing": set(),
    # The core's two rooms that gather the floors below for every front end.
    "_pipeline": {"workers", "rest", "grpc", "testing", "_cli", "_server", "models"},
    "_context": {"workers", "rest", "grpc", "testing", "_cli", "_server", "models"},
    "_inprocess": {"workers", "rest", "grpc", "testing", "_cli", "_server", "models"},
}
# Third-party libraries that one place alone may import.
OWNERS: dict[str, str | tuple[str, ...]] = {
    "hypercorn": "rest/_hypercorn.py",
    "hpack": "grpc/_hpack.py",
    "grpclib": "grpc/_grpclib.py",
    "trio_asyncio": "grpc/_grpclib.py",
    # grpclib's loop, and the loops Python-backend models run on (their BLS futures).
    "asyncio": ("grpc/_grpclib.py", "repository/_pb_loop.py", "repository/_pb_requests.py"),
    "opentelemetry": "tracing/_otel.py",  # the extra trioserve[tracing]
}


def _imports(path: Path) -> list[str]:
    """Absolute module names this file imports (relative imports resolved)."""
    package = path.relative_to(SRC.parent).with_suffix("").parts[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "trioserve" and len(parts) > 1 else None


@pytest.mark.parametrize(
    "path", sorted(p for p in SRC.rglob("*.py") if "_generated" not in p.parts), ids=str
)
def test_import_direction(path):
    relative = path.relative_to(SRC)
    own = relative.parts[0].removesuffix(".py")
    imported = _imports(path)
    parts = {p for p in map(_part, imported) if p is not None}
    forbidden = FORBIDDEN.get(own, _ABOVE_CORE)  # the private top-level modules are the core
    assert not parts & forbidden, f"{relative} imports {parts & forbidden}"
    top_level = {m.split(".")[0] for m in imported}
    for library, owner in OWNERS.items():
        if library in top_level:
            assert str(relative).startswith(owner), f"only {owner} may import {library}"


# The gRPC transport (the HTTP/2 core and gRPC's framing over it) serves any method table:
# it names methods and calls through ``grpc/_call``, never the server's handlers or context.
_GRPC_TRANSPORT = sorted(
    p
    for p in (SRC / "grpc").glob("*.py")
    if p.name.startswith(("_h2_", "_hpack", "_wire", "_core", "_grpc_call"))
)
_GRPC_APPLICATION = {
    "trioserve.grpc._methods",
    "trioserve.grpc._stream",
    "trioserve.grpc._codec",
    "trioserve.grpc._infer_wire",
    "trioserve._context",
}


@pytest.mark.parametrize("path", _GRPC_TRANSPORT, ids=lambda p: p.name)
def test_grpc_transport_imports_no_application(path):
    imported = {".".join(m.split(".")[:3]) for m in _imports(path)}
    imported |= {".".join(m.split(".")[:2]) for m in _imports(path)}
    assert not imported & _GRPC_APPLICATION, f"{path.name} imports {imported & _GRPC_APPLICATION}"


def test_grpc_transport_is_found():
    names = {p.name for p in _GRPC_TRANSPORT}
    assert {"_core.py", "_h2_connection.py", "_hpack.py", "_wire.py"} <= names


# The pure parts: decisions and wire formats without I/O, clocks or an event loop, so
# testable without trio. Each imports the standard library's plain data modules, the other
# pure parts, and only what its entry names besides.
PURE: dict[str, set[str]] = {
    "scheduler/_batching.py": set(),
    "scheduler/_sequences.py": set(),
    "scheduler/_llm_policy.py": set(),
    "scheduler/_kv_blocks.py": set(),
    "scheduler/_llm_output.py": set(),
    "scheduler/_sampling.py": {
        "numpy",
        "trioserve.scheduler._generation",  # TokenLogprob, a type
        "trioserve.scheduler._sampling_params",
    },
    "rest/_http11_parser.py": {
        "email.utils",
        "http",
        "urllib.parse",
        "trioserve._limits",
        "trioserve.rest._errors",
    },
    "grpc/_hpack.py": {"hpack", "trioserve.grpc._sized_cache"},
    "grpc/_h2_frames.py": {"struct", "trioserve._limits"},
}
_STDLIB_ALLOWED = {
    "__future__", "bisect", "collections", "dataclasses", "enum", "itertools", "typing",
}  # fmt: skip
_PURE_MODULES = {f"trioserve.{p.removesuffix('.py').replace('/', '.')}" for p in PURE}


def _outside_purity(relative: str, imported: list[str]) -> set[str]:
    """What ``relative``, a pure part, imports beyond what a pure part may."""
    allowed = PURE[relative]
    return {
        module
        for module in imported
        if module.split(".")[0] not in _STDLIB_ALLOWED
        and not any(module == a or module.startswith(f"{a}.") for a in allowed | _PURE_MODULES)
    }


@pytest.mark.parametrize("relative", sorted(PURE))
def test_pure_parts_import_no_event_loop_or_io(relative):
    outside = _outside_purity(relative, _imports(SRC / relative))
    assert not outside, f"{relative} imports {sorted(outside)}"


def test_impurity_is_found():
    imported = ["trio", "collections.abc", "trioserve.scheduler._kv_blocks", "numpy"]
    assert _outside_purity("scheduler/_llm_policy.py", imported) == {"trio", "numpy"}
    assert _outside_purity("scheduler/_sampling.py", imported) == {"trio"}


# Packages with a public face: their __init__ names what the rest of trioserve may use,
# and no module outside them imports their private modules.
SEALED = {"scheduler", "metrics", "grpc", "rest"}


def _private_reach(relative: Path, imported: list[str]) -> set[str]:
    """The private modules of sealed packages, other than its own, that a file imports."""
    sealed = SEALED - {relative.parts[0]}
    reached = set()
    for module in imported:
        parts = module.split(".")[:3]
        if (
            len(parts) == 3
            and parts[0] == "trioserve"
            and parts[1] in sealed
            and parts[2][0] == "_"
        ):
            reached.add(".".join(parts))
    return reached


@pytest.mark.parametrize(
    "path", sorted(p for p in SRC.rglob("*.py") if "_generated" not in p.parts), ids=str
)
def test_sealed_packages_are_reached_through_their_public_face(path):
    relative = path.relative_to(SRC)
    reached = _private_reach(relative, _imports(path))
    assert not reached, f"{relative} imports {sorted(reached)}: import the package instead"


def test_private_reach_is_found():
    imported = ["trioserve.scheduler._engine", "trioserve.scheduler.LLMEngine"]
    assert _private_reach(Path("rest/_x.py"), imported) == {"trioserve.scheduler._engine"}
    assert _private_reach(Path("scheduler/_x.py"), imported) == set()


@pytest.mark.parametrize("package", sorted(SEALED))
def test_sealed_packages_export_what_they_name(package):
    face = importlib.import_module(f"trioserve.{package}")
    assert all(hasattr(face, name) for name in face.__all__)
    assert not [name for name in face.__all__ if name.startswith("_")]


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Each trioserve module and the trioserve modules it imports, annotation-only imports
    included. Packages a module lies in are left out: Python runs them first anyway."""
    paths = [p for p in SRC.rglob("*.py") if "_generated" not in p.parts]
    modules = {_module_name(p): p for p in paths}
    graph = {}
    for name, path in modules.items():
        ancestors = {name.rsplit(".", depth)[0] for depth in range(1, name.count(".") + 1)}
        graph[name] = {m for m in _imports(path) if m in modules} - ancestors - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_import_circles():
    assert _circles(_import_graph()) == []


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], "builtin"),
        (["--grpc-server", "trio"], "builtin"),
        (["--grpc-server", "grpclib"], "grpclib"),
    ],
)
def test_cli_picks_the_grpc_front_end(flags, expected):
    config = config_from_args(_parser().parse_args(["run", *flags]))
    assert config.grpc_server == expected
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", "--grpc-server", "grpcio"])
    with pytest.raises(ValueError, match="grpc_server must be"):
        trioserve.ServerConfig(grpc_server="grpcio")  # type: ignore[arg-type]


def test_old_flags_and_values_still_configure_the_server(tmp_path):
    """The flags and values renamed for consistency are still read, as aliases."""
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    config = config_from_args(_parser().parse_args(["run", "--http-server", "stdlib"]))
    assert config.http_server == "builtin"
    for certfile, keyfile in (
        ("--tls-certfile", "--tls-keyfile"),
        ("--http-tls-certfile", "--http-tls-keyfile"),
    ):
        flags = ["--http-server", "hypercorn", certfile, cert, keyfile, key]
        config = config_from_args(_parser().parse_args(["run", *flags]))
        assert (config.http_tls_certfile, config.http_tls_keyfile) == (cert, key)
    flags = ["--grpc-max-message-bytes", "1024", "--repository-poll-secs", "2.5"]
    config = config_from_args(_parser().parse_args(["run", *flags]))
    assert config.grpc_limits.max_message_bytes == config.grpc_max_message_bytes == 1024
    assert config.repository_poll_s == 2.5


def test_old_config_keywords_are_deprecated_aliases():
    with pytest.warns(
        DeprecationWarning, match="repository_poll_secs=...\\) is now repository_poll_s"
    ):
        config = trioserve.ServerConfig(repository_poll_secs=3.0)  # type: ignore[call-arg]
    assert config.repository_poll_s == 3.0
    with pytest.warns(DeprecationWarning, match="is now http_tls_(certfile|keyfile)"):
        config = trioserve.ServerConfig(
            http_server="hypercorn",
            tls_certfile="c.pem",  # type: ignore[call-arg]
            tls_keyfile="k.pem",  # type: ignore[call-arg]
        )
    assert (config.http_tls_certfile, config.http_tls_keyfile) == ("c.pem", "k.pem")
    limits = trioserve.GrpcLimits(max_concurrent_streams=7)
    with pytest.warns(DeprecationWarning, match="is now grpc_limits.max_message_bytes"):
        config = trioserve.ServerConfig(
            grpc_limits=limits,
            grpc_max_message_bytes=99,  # type: ignore[call-arg]
        )
    assert config.grpc_limits == trioserve.GrpcLimits(
        max_concurrent_streams=7, max_message_bytes=99
    )
    config = trioserve.ServerConfig(http_server="stdlib", grpc_server="trio")
    assert (config.http_server, config.grpc_server) == ("builtin", "builtin")


def test_cli_builds_a_config_for_the_builtin_models():
    args = _parser().parse_args(["run", "--http-port", "0", "--allow-grpc", "false"])
    config = config_from_args(args)
    assert config.grpc_port is None and config.http_port == 0
    assert {m.name for m in config.models} >= {
        "simple",
        "simple_string",
        "identity_fp32",
        "identity_bytes",
        "delay",
        "fail",
        "tiny_lm",
    }
    assert config.show_hidden_metrics_for_version is None
    args = _parser().parse_args(["run", "--show-hidden-metrics-for-version", "0.9"])
    assert config_from_args(args).show_hidden_metrics_for_version == "0.9"
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", "--allow-http", "maybe"])


MODEL_PY = """
import trioserve

@trioserve.model(
    name="ignored",
    inputs=[trioserve.TensorSpec("X", "FP32", [-1])],
    outputs=[trioserve.TensorSpec("Y", "FP32", [-1])],
)
def model(X):
    return {"Y": X * SCALE}

SCALE = %d
"""


def _write_repository(root: Path) -> None:
    (root / "double").mkdir()
    (root / "double" / "model.py").write_text(MODEL_PY % 2)
    for version in (1, 2):
        (root / "scaled" / str(version)).mkdir(parents=True)
        (root / "scaled" / str(version) / "model.py").write_text(MODEL_PY % (10 * version))


def test_load_repository(tmp_path):
    _write_repository(tmp_path)
    models = load_repository(tmp_path)
    assert [(m.name, tuple(m.versions)) for m in models] == [
        ("double", ("1",)),
        ("scaled", ("1",)),
        ("scaled", ("2",)),
    ]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "holds no models"),
        ({"m/readme.txt": ""}, "no model.py"),
        ({"m/model.py": "x = 1"}, "no module-level 'model'"),
        ({"m/model.py": "raise ValueError('bad')"}, "failed to import"),
    ],
)
def test_bad_repositories(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    with pytest.raises(RepositoryError, match=message):
        load_repository(tmp_path)


def test_trioserve_run_serves_a_repository_until_sigterm(tmp_path):
    """The real command line in a subprocess: serve, answer tritonclient, stop on SIGTERM."""
    (tmp_path / "repo").mkdir()
    _write_repository(tmp_path / "repo")
    script = textwrap.dedent(
        """
        import socket, sys
        s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()
        """
    )
    port = int(subprocess.check_output([sys.executable, "-c", script]).decode())
    command = [
        sys.executable,
        "-m",
        "trioserve",
        "run",
        "--model-repository",
        str(tmp_path / "repo"),
        "--host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--allow-grpc",
        "false",
    ]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as process:
        try:
            assert process.stderr is not None
            for line in process.stderr:  # wait for the listening line, not for a time
                if "serving models" in line:
                    break
            client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
            tensor = httpclient.InferInput("X", [3], "FP32")
            tensor.set_data_from_numpy(np.ones(3, np.float32))
            scaled = client.infer("scaled", [tensor], model_version="2")
            assert scaled.as_numpy("Y").tolist() == [20.0] * 3
            latest = client.infer("scaled", [tensor])
            assert latest.as_numpy("Y").tolist() == [20.0] * 3
            assert client.infer("double", [tensor]).as_numpy("Y").tolist() == [2.0] * 3
            client.close()
        finally:
            process.terminate()
            assert process.wait(timeout=30) == 0
