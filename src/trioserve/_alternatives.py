"""The alternative front ends, hypercorn (HTTP) and grpclib (gRPC): extras, imported only
when a configuration chooses them.

Neither serves by default, and grpclib comes with trio-asyncio, which brings asyncio's
whole machinery into the process and, on Python 3.12 and 3.13, warns about asyncio names
it uses that are deprecated there (``AbstractChildWatcher``, removed in 3.14). So the
built-in front ends never import them, and choosing one that is not installed, or that
cannot work on this Python, is refused before anything starts with a message that says
why and what to do (``FrontEndUnavailable``, a ``ValueError`` like every other bad
setting).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

from ._config import ServerConfig

# trio-asyncio reads asyncio.AbstractChildWatcher at import; Python 3.12 and 3.13 warn
# that the name is deprecated. The warning is about trio-asyncio, not about anything the
# user can change, so it alone is silenced, and only while the import runs.
_TRIO_ASYNCIO_WARNING = r"'AbstractChildWatcher' is deprecated"


class FrontEndUnavailable(ValueError):
    """The configuration chooses an alternative front end that cannot be imported here."""


def check_alternatives(config: ServerConfig) -> None:
    """Import the alternative front ends ``config`` chooses, so that one which is missing
    or broken is refused before any model loads."""
    if config.http_port is not None and config.http_server == "hypercorn":
        hypercorn_server()
    if config.grpc_port is not None and config.grpc_server == "grpclib":
        grpclib_server()


def hypercorn_server() -> Callable[..., Awaitable[None]]:
    """``rest.serve_hypercorn``."""
    from . import rest

    try:
        return rest.serve_hypercorn  # imported on first use of the name
    except ImportError as exc:
        raise FrontEndUnavailable(_missing("--http-server hypercorn", "hypercorn", exc)) from exc


def grpclib_server() -> Callable[..., Awaitable[None]]:
    """``grpc.serve_grpclib``."""
    from . import grpc

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=_TRIO_ASYNCIO_WARNING, category=DeprecationWarning
            )
            # Imported on first use of the name; an attribute access, not ``from grpc
            # import``, which would turn an AttributeError raised by the import into an
            # ImportError.
            serve_grpclib = grpc.serve_grpclib
    except ImportError as exc:
        raise FrontEndUnavailable(_missing("--grpc-server grpclib", "grpclib", exc)) from exc
    except Exception as exc:  # any failure at import means it cannot serve here
        python = ".".join(map(str, sys.version_info[:3]))
        raise FrontEndUnavailable(
            f"--grpc-server grpclib cannot serve on Python {python}: importing grpclib and "
            f"trio-asyncio failed ({type(exc).__name__}: {exc}); the built-in gRPC server "
            "(--grpc-server builtin, the default) serves on every supported Python"
        ) from exc
    return serve_grpclib


def _missing(choice: str, extra: str, exc: Any) -> str:
    return (
        f"{choice} needs an optional package that is not installed ({exc}): "
        f"pip install 'trioserve[{extra}]'"
    )
