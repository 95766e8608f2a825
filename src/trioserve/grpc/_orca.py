"""ORCA load reports over gRPC: a serialized ``xds.data.orca.v3.OrcaLoadReport`` in the
trailing metadata key ``endpoint-load-metrics-bin``.

A call asks for one with the metadata key ``endpoint-load-metrics-format`` (the request
header the REST front end reads). Its value names an HTTP header form; a trailer has
one form only, the binary message, so any value asks for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._served import ServedModel
from ..metrics import FORMAT_HEADER, LoadReport, LoadReporter
from ._generated.orca_load_report_pb2 import OrcaLoadReport

if TYPE_CHECKING:
    from ._call import Call

TRAILER_KEY = "endpoint-load-metrics-bin"
_FORMAT_KEY = FORMAT_HEADER.decode()


def orca_message(report: LoadReport) -> OrcaLoadReport:
    message = OrcaLoadReport(
        application_utilization=report.application_utilization,
        rps_fractional=report.rps_fractional,
        eps=report.eps,
        named_metrics=report.named_metrics,
    )
    if report.cpu_utilization is not None:
        message.cpu_utilization = report.cpu_utilization
    if report.mem_utilization is not None:
        message.mem_utilization = report.mem_utilization
    return message


def add_load_report(call: Call, load: LoadReporter, served: ServedModel) -> None:
    """The trailer for a response of ``served``, if the call asked for it and a report can
    be made (``LoadReporter.report`` logs why not)."""
    if _FORMAT_KEY not in call.metadata:
        return
    report = load.report(served)
    if report is not None:
        call.add_trailer(TRAILER_KEY, orca_message(report).SerializeToString())
