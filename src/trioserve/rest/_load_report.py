"""ORCA over REST: the ``endpoint-load-metrics`` response header, in the form the
request's ``endpoint-load-metrics-format`` header names (``JSON`` or ``TEXT``; Triton's
two). The report itself is the server's ``LoadReporter``'s, the same one gRPC's trailer
carries."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from .._served import ServedModel
from ..metrics import FORMAT_HEADER, REPORT_HEADER, LoadReporter

logger = logging.getLogger("trioserve.http")


def load_report_header(
    load: LoadReporter, served: ServedModel, request_headers: Mapping[bytes, bytes]
) -> tuple[bytes, bytes] | None:
    """The header for a response of ``served``, if the request asked for one in a format
    we know and a report can be made (``LoadReporter.report`` logs why not)."""
    wanted = request_headers.get(FORMAT_HEADER)
    if wanted is None:
        return None
    if wanted not in (b"json", b"text"):
        logger.error(
            "unknown endpoint-load-metrics-format %r: no load report sent",
            wanted.decode("latin-1"),
        )
        return None
    report = load.report(served)
    if report is None:
        return None
    value = report.json() if wanted == b"json" else report.text()
    return REPORT_HEADER, value.encode()
