"""The REST (HTTP/JSON) front end: HTTP servers, ASGI app and routing.

``build_app`` makes a server's ``RestApp``; ``serve_http11`` is our HTTP/1.1 server (the
default, fastest), ``serve_metrics`` the metrics port's. ``serve_hypercorn`` is
Hypercorn's: an extra, imported only when chosen (``_alternatives``), on first use of
the name.
"""

from typing import TYPE_CHECKING

from ._app import Endpoint as Endpoint
from ._app import ReceivesInto as ReceivesInto
from ._app import Request as Request
from ._app import Response as Response
from ._app import RestApp
from ._app import accepted_encoding as accepted_encoding
from ._app import compressed as compressed
from ._asgi import COMPRESSED_IN_FRONT as COMPRESSED_IN_FRONT
from ._asgi import COMPRESSIBLE as COMPRESSIBLE
from ._endpoints import build_app
from ._endpoints import header_length as header_length
from ._endpoints import infer_response as infer_response
from ._endpoints import small_infer_response as small_infer_response
from ._errors import HttpError as HttpError
from ._http11 import HTTP_COUNTERS, HttpStatistics, serve_http11
from ._infer_codec import decode_request as decode_request
from ._load_report import load_report_header as load_report_header
from ._metrics import serve_metrics
from ._router import Router as Router

if TYPE_CHECKING:
    from ._hypercorn import serve_hypercorn as serve_hypercorn

__all__ = [
    "COMPRESSED_IN_FRONT",
    "COMPRESSIBLE",
    "HTTP_COUNTERS",
    "Endpoint",
    "HttpError",
    "HttpStatistics",
    "ReceivesInto",
    "Request",
    "Response",
    "RestApp",
    "Router",
    "accepted_encoding",
    "build_app",
    "compressed",
    "decode_request",
    "header_length",
    "infer_response",
    "load_report_header",
    "serve_http11",
    "serve_hypercorn",
    "serve_metrics",
    "small_infer_response",
]


def __getattr__(name: str) -> object:
    if name == "serve_hypercorn":
        from ._hypercorn import serve_hypercorn

        return serve_hypercorn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
