"""The trace and logging extensions over gRPC: TraceSetting and LogSettings.

TraceSetting: a request with no setting only asks (for the model it names, or the
server); a setting with no value clears it. LogSettings: each value is one of
``bool_param``, ``uint32_param``, ``string_param``, as the setting takes; a request with
no setting only asks. Both answer every setting as it is now. A restricted group
("trace", "logging") answers UNAVAILABLE without its metadata, as the others do.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from .._log_settings import LogControl
from .._served import ModelRepository
from ..tracing import SettingsDocument, TraceControl
from ._generated import grpc_service_pb2 as pb


def trace_setting(
    tracing: TraceControl, repository: ModelRepository, request: pb.TraceSettingRequest
) -> Message:
    model = request.model_name
    if model:
        repository.get(model)  # an unknown model is NOT_FOUND
    if not request.settings:  # what tritonclient's get_trace_settings sends
        return _trace_reply(tracing.settings(model))
    changes = {key: list(setting.value) or None for key, setting in request.settings.items()}
    return _trace_reply(tracing.update(model, changes))


def _trace_reply(document: SettingsDocument) -> Message:
    reply = pb.TraceSettingResponse()
    for key, value in document.items():
        reply.settings[key].value.extend([value] if isinstance(value, str) else value)
    return reply


def log_settings(logs: LogControl, request: pb.LogSettingsRequest) -> Message:
    changes: dict[str, Any] = {}
    for key, setting in request.settings.items():
        choice = setting.WhichOneof("parameter_choice")
        if choice is not None:
            changes[key] = getattr(setting, choice)
    document = logs.update(changes) if changes else logs.settings()
    reply = pb.LogSettingsResponse()
    for key, value in document.items():
        entry = reply.settings[key]
        if isinstance(value, bool):
            entry.bool_param = value
        elif isinstance(value, int):
            entry.uint32_param = value
        else:
            entry.string_param = value
    return reply
