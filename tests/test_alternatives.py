"""The alternative front ends are extras: nothing imports them (or asyncio's machinery)
unless a configuration chooses them, and one that cannot serve is refused up front with
a message that says why."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import subprocess
import sys
import types
from collections.abc import Sequence

import pytest

from trioserve import ServerConfig, serve
from trioserve._alternatives import FrontEndUnavailable, grpclib_server, hypercorn_server
from trioserve._cli import main

OPTIONAL = ("asyncio", "trio_asyncio", "grpclib", "hypercorn", "h2")


def test_the_default_server_imports_no_optional_front_end() -> None:
    code = (
        "import sys, trioserve, trioserve._cli, trioserve._server\n"
        f"print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_choosing_grpclib_imports_it_without_a_warning() -> None:
    # Python 3.12 and 3.13 deprecate an asyncio name trio-asyncio reads at import: the
    # warning is silenced for that import alone, so -W error still starts the server.
    code = (
        "import sys, warnings\n"
        "from trioserve._alternatives import grpclib_server\n"
        "grpclib_server()\n"
        "print('trio_asyncio' in sys.modules)\n"
        "warnings.warn('still an error', DeprecationWarning)\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
    )
    assert done.stdout.strip() == "True"
    # The filter did not outlive the import: a later warning is still an error.
    assert "DeprecationWarning: still an error" in done.stderr


class _FailingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes importing ``name`` raise ``error``, as a missing or broken package does."""

    def __init__(self, name: str, error: Exception) -> None:
        self.name, self.error = name, error

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        raise self.error


@pytest.fixture
def broken_import(monkeypatch: pytest.MonkeyPatch) -> type[_FailingImport]:
    """Lets a test break one import: the modules that would find it already imported are
    forgotten for the test (and restored after it)."""
    for name in list(sys.modules):
        if name.split(".")[0] in {"trio_asyncio", "hypercorn"} or name in (
            "trioserve.grpc._grpclib",
            "trioserve.rest._hypercorn",
        ):
            monkeypatch.delitem(sys.modules, name)

    class Installed(_FailingImport):
        def __init__(self, name: str, error: Exception) -> None:
            super().__init__(name, error)
            monkeypatch.setattr(sys, "meta_path", [self, *sys.meta_path])

    return Installed


def test_trio_asyncio_broken_on_this_python_refuses_grpclib(
    broken_import: type[_FailingImport],
) -> None:
    # What trio-asyncio 0.16 raises on Python 3.14, where the asyncio name is gone.
    broken_import(
        "trio_asyncio", AttributeError("module 'asyncio' has no attribute 'AbstractChildWatcher'")
    )
    with pytest.raises(FrontEndUnavailable) as refused:
        grpclib_server()
    message = str(refused.value)
    assert "--grpc-server grpclib cannot serve on Python" in message
    assert "AbstractChildWatcher" in message
    assert "--grpc-server builtin, the default" in message


def test_missing_extras_name_what_to_install(broken_import: type[_FailingImport]) -> None:
    broken_import("trio_asyncio", ModuleNotFoundError("No module named 'trio_asyncio'"))
    broken_import("hypercorn", ModuleNotFoundError("No module named 'hypercorn'"))
    with pytest.raises(FrontEndUnavailable, match=r"pip install 'trioserve\[grpclib\]'"):
        grpclib_server()
    with pytest.raises(FrontEndUnavailable, match=r"pip install 'trioserve\[hypercorn\]'"):
        hypercorn_server()


def test_the_command_line_refuses_before_serving(broken_import: type[_FailingImport]) -> None:
    broken_import("trio_asyncio", ModuleNotFoundError("No module named 'trio_asyncio'"))
    with pytest.raises(SystemExit) as exited:
        main(["run", "--http-port", "0", "--grpc-port", "0", "--grpc-server", "grpclib"])
    assert "pip install 'trioserve[grpclib]'" in str(exited.value.code)


async def test_embedding_refuses_before_loading(broken_import: type[_FailingImport]) -> None:
    broken_import("hypercorn", ModuleNotFoundError("No module named 'hypercorn'"))
    config = ServerConfig(http_port=0, grpc_port=None, http_server="hypercorn")
    with pytest.raises(FrontEndUnavailable, match="--http-server hypercorn"):
        await serve(config)


def test_a_front_end_that_is_off_is_not_imported(broken_import: type[_FailingImport]) -> None:
    from trioserve._alternatives import check_alternatives

    broken_import("trio_asyncio", ModuleNotFoundError("No module named 'trio_asyncio'"))
    check_alternatives(ServerConfig(grpc_port=None, grpc_server="grpclib"))  # no error
