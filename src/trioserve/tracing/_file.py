"""Triton's trace file: a JSON array of records, each trace's in turn.

    {"id": 1, "model_name": "simple", "model_version": 1, "request_id": "", "parent_id": 0}
    {"id": 1, "timestamps": [{"name": "REQUEST_START", "ns": 2356425054785863}, ...]}
    {"id": 1, "activity": "TENSOR_QUEUE_INPUT",
     "tensor": {"name": "INPUT0", "data": "1,2,3", "shape": "1,3", "dtype": "INT32"}}

With ``log_frequency`` 0 every trace goes to ``file`` when the server stops (or when
the setting moves to another file); with N, each N traces go to ``file.0``, ``file.1``...
The writing itself is done by ``TraceControl``'s task, in a worker thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._trace import Trace

Write = Callable[[str, list[dict[str, Any]]], None]


class TraceFile:
    """The traces collected for one file (a ``TraceSink``)."""

    def __init__(self, path: str, log_frequency: int, write: Write) -> None:
        self.path = path
        self.log_frequency = log_frequency
        self._write = write
        self._pending: list[dict[str, Any]] = []
        self._collected = 0
        self._index = 0  # the next rotated file's suffix

    def collect(self, trace: Trace) -> None:
        for each in trace.walk():
            self._pending += trace_records(each)
        self._collected += 1
        if self.log_frequency and self._collected % self.log_frequency == 0:
            self._emit()

    def flush(self) -> None:
        """Write what was collected since the last file (the server stops, or the
        setting moves to another file)."""
        if self._pending:
            self._emit()

    def _emit(self) -> None:
        if self.log_frequency:
            path = f"{self.path}.{self._index}"
            self._index += 1
        else:
            path = self.path
        records, self._pending = self._pending, []
        if self.path:  # an empty file setting collects nowhere
            self._write(path, records)


def trace_records(trace: Trace) -> list[dict[str, Any]]:
    """One trace's records, as Triton writes them."""
    version: int | str = int(trace.model_version) if trace.model_version.isdigit() else -1
    records: list[dict[str, Any]] = [
        {
            "id": trace.id,
            "model_name": trace.model_name,
            "model_version": version,
            "request_id": trace.request_id,
            "parent_id": trace.parent_id,
        },
        {"id": trace.id, "timestamps": [{"name": n, "ns": ns} for n, ns in trace.timestamps]},
    ]
    for tensor in trace.tensors:
        records.append(
            {
                "id": trace.id,
                "activity": tensor.activity,
                "tensor": {
                    "name": tensor.name,
                    "data": tensor.data,
                    "shape": tensor.shape,
                    "dtype": tensor.datatype,
                },
            }
        )
    return records


def write_records(path: str, records: list[dict[str, Any]]) -> None:
    """Write one file of records (in a worker thread)."""
    Path(path).write_text(json.dumps(records))
