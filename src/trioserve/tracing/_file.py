"""Triton's trace file: a JSON array of records, each trace's in turn.

    {"id": 1, "model_name": "simple", "model_version": 1, "request_id": ""}
    {"id": 2, "model_name": "step", "model_version": 1, "request_id": "", "parent_id": 1}
    {"id": 1, "timestamps": [{"name": "REQUEST_START", "ns": 2356425054785863}, ...]}
    {"id": 1, "activity": "TENSOR_QUEUE_INPUT",
     "tensor": {"name": "INPUT0", "data": "1,2,3", "shape": "1,3", "dtype": "INT32"}}

With ``log_frequency`` 0 every trace goes to ``file`` when the server stops (or when
the setting moves to another file); with N, each N traces go to ``file.0``, ``file.1``...
The writing itself, JSON included, is done by ``TraceControl``'s task, in a worker
thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring as _quoted  # a JSON string, quoted
from pathlib import Path
from typing import Any

from ._trace import Trace

Write = Callable[[str, list[Trace]], None]


class TraceFile:
    """The traces collected for one file (a ``TraceSink``)."""

    def __init__(self, path: str, log_frequency: int, write: Write) -> None:
        self.path = path
        self.log_frequency = log_frequency
        self._write = write
        self._pending: list[Trace] = []  # root traces, turned into JSON by the writer
        self._index = 0  # the next rotated file's suffix

    def collect(self, trace: Trace) -> None:
        self._pending.append(trace)
        if self.log_frequency and len(self._pending) == self.log_frequency:
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
        traces, self._pending = self._pending, []
        if self.path:  # an empty file setting collects nowhere
            self._write(path, traces)


def write_traces(path: str, traces: list[Trace]) -> None:
    """Write one file of traces and their children (in a worker thread: the JSON is
    built here, off the event loop)."""
    records = ",".join(trace_json(each) for root in traces for each in root.walk())
    Path(path).write_text(f"[{records}]", encoding="utf-8")


def trace_json(trace: Trace) -> str:
    """One trace's records, as Triton writes them (formatted by hand: three times quicker
    than ``json.dumps`` of the same dicts)."""
    version = int(trace.model_version) if trace.model_version.isdigit() else -1
    stamps = ",".join([f'{{"name":"{name}","ns":{ns}}}' for name, ns in trace.timestamps])
    # As Triton writes it: "parent_id" only for a trace that has a parent.
    parent = f',"parent_id":{trace.parent_id}' if trace.parent_id else ""
    records = [
        f'{{"id":{trace.id},"model_name":{_quoted(trace.model_name)},'
        f'"model_version":{version},"request_id":{_quoted(trace.request_id)}{parent}}}',
        f'{{"id":{trace.id},"timestamps":[{stamps}]}}',
    ]
    for tensor in trace.tensors:
        described: dict[str, Any] = {
            "id": trace.id,
            "activity": tensor.activity,
            "tensor": {
                "name": tensor.name,
                "data": tensor.data,
                "shape": tensor.shape,
                "dtype": tensor.datatype,
            },
        }
        records.append(json.dumps(described))
    return ",".join(records)
