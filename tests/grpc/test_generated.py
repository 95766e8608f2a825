"""Check the generated protobuf code against the real Triton definitions.

tritonclient ships its own compiled copy of Triton's ``grpc_service.proto`` and
``model_config.proto``; its descriptors are the ground truth for wire
compatibility. These tests compare every message, field, enum and RPC of ours
against them, and push real messages through both sets of classes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, text_format
from google.protobuf.descriptor import FileDescriptor
from grpclib.const import Cardinality
from grpclib.health.v1 import health_pb2 as grpclib_health_pb2
from tritonclient.grpc import model_config_pb2 as triton_model_config_pb2
from tritonclient.grpc import service_pb2 as triton_service_pb2

from trioserve.grpc._generated import (
    grpc_service_grpc,
    grpc_service_pb2,
    health_grpc,
    health_pb2,
    model_config_pb2,
    orca_load_report_pb2,
)

FDP = descriptor_pb2.FieldDescriptorProto
REPO_ROOT = Path(__file__).resolve().parents[2]

# (ours, theirs) pairs of generated modules that must describe the same schema.
PAIRS = [
    pytest.param(model_config_pb2, triton_model_config_pb2, id="model_config"),
    pytest.param(grpc_service_pb2, triton_service_pb2, id="grpc_service"),
]


# --------------------------------------------------------------------------- helpers


def _file_proto(fd: FileDescriptor) -> descriptor_pb2.FileDescriptorProto:
    out = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(out)
    return out


def _walk_messages(
    prefix: str, messages: Any
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for msg in messages:
        name = f"{prefix}.{msg.name}"
        yield name, msg
        yield from _walk_messages(name, msg.nested_type)


def _walk_enums(prefix: str, enums: Any, messages: Any) -> Iterator[tuple[str, dict[str, int]]]:
    for enum in enums:
        yield f"{prefix}.{enum.name}", {v.name: v.number for v in enum.value}
    for msg in messages:
        yield from _walk_enums(f"{prefix}.{msg.name}", msg.enum_type, msg.nested_type)


def message_schema(fd: FileDescriptor) -> dict[str, dict[str, Any]]:
    """Full message name -> {field name: (number, type, label, type name, oneof)} + options."""
    fdp = _file_proto(fd)
    schema: dict[str, dict[str, Any]] = {}
    for full_name, msg in _walk_messages(fdp.package, fdp.message_type):
        fields: dict[str, Any] = {}
        for f in msg.field:
            oneof = msg.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
            fields[f.name] = (
                f.number,
                FDP.Type.Name(f.type),
                FDP.Label.Name(f.label),
                f.type_name or None,
                oneof,
                f.options.deprecated,
            )
        fields["<map_entry>"] = msg.options.map_entry
        fields["<oneofs>"] = [o.name for o in msg.oneof_decl]
        schema[full_name] = fields
    return schema


def enum_schema(fd: FileDescriptor) -> dict[str, dict[str, int]]:
    fdp = _file_proto(fd)
    return dict(_walk_enums(fdp.package, fdp.enum_type, fdp.message_type))


def service_schema(fd: FileDescriptor) -> dict[str, dict[str, tuple[str, str, bool, bool]]]:
    fdp = _file_proto(fd)
    return {
        f"{fdp.package}.{svc.name}": {
            m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
            for m in svc.method
        }
        for svc in fdp.service
    }


def _grpclib_mapping(base: type) -> dict[str, Any]:
    """Instantiate a grpclib ``*Base`` with stub handlers and return its ``__mapping__()``."""

    async def handler(self: Any, stream: Any) -> None:  # pragma: no cover - never called
        raise NotImplementedError

    impl = type("Impl", (base,), dict.fromkeys(base.__abstractmethods__, handler))
    return dict(impl().__mapping__())


_CARDINALITY = {
    (False, False): Cardinality.UNARY_UNARY,
    (True, False): Cardinality.STREAM_UNARY,
    (False, True): Cardinality.UNARY_STREAM,
    (True, True): Cardinality.STREAM_STREAM,
}


# ------------------------------------------------------------------ schema identity


@pytest.mark.parametrize(("ours", "theirs"), PAIRS)
def test_file_identity(ours: Any, theirs: Any) -> None:
    assert ours.DESCRIPTOR.name == theirs.DESCRIPTOR.name
    assert ours.DESCRIPTOR.package == theirs.DESCRIPTOR.package == "inference"
    deps = [d.name for d in ours.DESCRIPTOR.dependencies]
    assert deps == [d.name for d in theirs.DESCRIPTOR.dependencies]


@pytest.mark.parametrize(("ours", "theirs"), PAIRS)
def test_same_message_types(ours: Any, theirs: Any) -> None:
    assert sorted(message_schema(ours.DESCRIPTOR)) == sorted(message_schema(theirs.DESCRIPTOR))


@pytest.mark.parametrize(("ours", "theirs"), PAIRS)
def test_same_fields(ours: Any, theirs: Any) -> None:
    mine = message_schema(ours.DESCRIPTOR)
    ref = message_schema(theirs.DESCRIPTOR)
    problems = []
    for name, fields in ref.items():
        if name not in mine:
            problems.append(f"missing message {name}")
            continue
        for field, spec in fields.items():
            if mine[name].get(field) != spec:
                problems.append(f"{name}.{field}: ours {mine[name].get(field)!r}, triton {spec!r}")
        for field in mine[name].keys() - fields.keys():
            problems.append(f"{name}.{field}: extra field {mine[name][field]!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("ours", "theirs"), PAIRS)
def test_same_enums(ours: Any, theirs: Any) -> None:
    assert enum_schema(ours.DESCRIPTOR) == enum_schema(theirs.DESCRIPTOR)


def test_datatype_enum() -> None:
    expected = [
        "TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64",
        "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32",
        "TYPE_FP64", "TYPE_STRING", "TYPE_BF16",
    ]  # fmt: skip
    assert [model_config_pb2.DataType.Name(i) for i in range(len(expected))] == expected


def test_same_services() -> None:
    mine = service_schema(grpc_service_pb2.DESCRIPTOR)
    ref = service_schema(triton_service_pb2.DESCRIPTOR)
    assert list(mine) == ["inference.GRPCInferenceService"]
    assert mine == ref
    methods = mine["inference.GRPCInferenceService"]
    assert methods["ModelStreamInfer"] == (
        ".inference.ModelInferRequest",
        ".inference.ModelStreamInferResponse",
        True,
        True,
    )
    assert not any(cs or ss for m, (_, _, cs, ss) in methods.items() if m != "ModelStreamInfer")


@pytest.mark.parametrize(("ours", "theirs"), PAIRS)
def test_descriptor_bytes_identical_to_tritonclient(ours: Any, theirs: Any) -> None:
    # Stronger than the checks above: same declaration order and options too.
    assert _file_proto(ours.DESCRIPTOR) == _file_proto(theirs.DESCRIPTOR)
    assert ours.DESCRIPTOR.serialized_pb == theirs.DESCRIPTOR.serialized_pb


def test_grpclib_service_matches_descriptor() -> None:
    base = grpc_service_grpc.GRPCInferenceServiceBase
    svc = triton_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert base.__abstractmethods__ == {m.name for m in svc.methods}
    mapping = _grpclib_mapping(base)
    assert set(mapping) == {f"/inference.GRPCInferenceService/{m.name}" for m in svc.methods}
    for method in svc.methods:
        handler = mapping[f"/inference.GRPCInferenceService/{method.name}"]
        assert (
            handler.cardinality is _CARDINALITY[(method.client_streaming, method.server_streaming)]
        ), method.name
        assert handler.request_type.DESCRIPTOR.full_name == method.input_type.full_name
        assert handler.reply_type.DESCRIPTOR.full_name == method.output_type.full_name
        assert handler.request_type.__module__ == grpc_service_pb2.__name__
    assert hasattr(grpc_service_grpc, "GRPCInferenceServiceStub")


# ----------------------------------------------------------------- wire round trips


def _triton_infer_request() -> Any:
    t = triton_service_pb2
    params = {
        "b": t.InferParameter(bool_param=True),
        "i": t.InferParameter(int64_param=-7),
        "s": t.InferParameter(string_param="x"),
        "d": t.InferParameter(double_param=0.25),
        "u": t.InferParameter(uint64_param=2**63 + 5),
    }
    req = t.ModelInferRequest(
        model_name="simple",
        model_version="3",
        id="req-1",
        parameters=params,
        raw_input_contents=[b"\x00\x01\x02\x03", b"\xff" * 8],
    )
    req.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 2], parameters={"k": params["s"]})
    req.inputs.add(name="INPUT1", datatype="FP64", shape=[1])
    typed = req.inputs.add(name="INPUT2", datatype="BYTES", shape=[2])
    typed.contents.bytes_contents.extend([b"a", b"bc"])
    typed.contents.fp32_contents.extend([1.5, -2.0])
    typed.contents.uint64_contents.append(2**64 - 1)
    req.outputs.add(name="OUTPUT0", parameters={"binary_data": params["b"]})
    return req


def _triton_infer_response() -> Any:
    t = triton_service_pb2
    resp = t.ModelInferResponse(
        model_name="simple",
        model_version="1",
        id="req-1",
        parameters={"triton_final_response": t.InferParameter(bool_param=True)},
        raw_output_contents=[b"\x10\x20"],
    )
    out = resp.outputs.add(name="OUTPUT0", datatype="INT8", shape=[2])
    out.contents.int_contents.extend([1, -1])
    return t.ModelStreamInferResponse(error_message="", infer_response=resp)


def _triton_model_config_response() -> Any:
    mc = triton_model_config_pb2
    cfg = mc.ModelConfig(
        name="m",
        backend="python",
        max_batch_size=8,
        version_policy=mc.ModelVersionPolicy(specific=mc.ModelVersionPolicy.Specific(versions=[1])),
        dynamic_batching=mc.ModelDynamicBatching(
            preferred_batch_size=[4],
            priority_queue_policy={
                1: mc.ModelQueuePolicy(timeout_action=mc.ModelQueuePolicy.DELAY)
            },
        ),
        parameters={"p": mc.ModelParameter(string_value="v")},
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True),
    )
    cfg.input.add(name="IN", data_type=mc.TYPE_BF16, dims=[-1, 3], optional=True)
    cfg.output.add(name="OUT", data_type=mc.TYPE_STRING, dims=[1])
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_GPU, count=2, gpus=[0, 1])
    return triton_service_pb2.ModelConfigResponse(config=cfg)


ROUND_TRIP_CASES = [
    pytest.param(_triton_infer_request, "ModelInferRequest", id="ModelInferRequest"),
    pytest.param(_triton_infer_response, "ModelStreamInferResponse", id="ModelStreamInferResponse"),
    pytest.param(_triton_model_config_response, "ModelConfigResponse", id="ModelConfigResponse"),
]


@pytest.mark.parametrize(("build", "name"), ROUND_TRIP_CASES)
def test_round_trip_with_tritonclient(build: Any, name: str) -> None:
    theirs = build()
    wire = theirs.SerializeToString(deterministic=True)

    ours = getattr(grpc_service_pb2, name).FromString(wire)
    # Every field was understood (text format leaves unknown fields out) and
    # named the same way.
    assert text_format.MessageToString(ours) == text_format.MessageToString(theirs)
    assert ours.SerializeToString(deterministic=True) == wire

    back = type(theirs).FromString(ours.SerializeToString(deterministic=True))
    assert back == theirs
    assert back.SerializeToString(deterministic=True) == wire


def test_round_trip_from_our_side() -> None:
    ours = grpc_service_pb2.ModelInferRequest.FromString(
        _triton_infer_request().SerializeToString(deterministic=True)
    )
    ours.inputs[0].shape.append(9)
    ours.parameters["extra"].int64_param = 1
    wire = ours.SerializeToString(deterministic=True)
    theirs = triton_service_pb2.ModelInferRequest.FromString(wire)
    assert list(theirs.inputs[0].shape) == [1, 2, 9]
    assert theirs.parameters["extra"].WhichOneof("parameter_choice") == "int64_param"
    assert theirs.SerializeToString(deterministic=True) == wire


# ------------------------------------------------------------------ other protos


def test_orca_load_report_fields() -> None:
    fields = message_schema(orca_load_report_pb2.DESCRIPTOR)["xds.data.orca.v3.OrcaLoadReport"]
    entry = ".xds.data.orca.v3.OrcaLoadReport."
    assert {k: v[:4] for k, v in fields.items() if not k.startswith("<")} == {
        "cpu_utilization": (1, "TYPE_DOUBLE", "LABEL_OPTIONAL", None),
        "mem_utilization": (2, "TYPE_DOUBLE", "LABEL_OPTIONAL", None),
        "rps": (3, "TYPE_UINT64", "LABEL_OPTIONAL", None),
        "request_cost": (4, "TYPE_MESSAGE", "LABEL_REPEATED", entry + "RequestCostEntry"),
        "utilization": (5, "TYPE_MESSAGE", "LABEL_REPEATED", entry + "UtilizationEntry"),
        "rps_fractional": (6, "TYPE_DOUBLE", "LABEL_OPTIONAL", None),
        "eps": (7, "TYPE_DOUBLE", "LABEL_OPTIONAL", None),
        "named_metrics": (8, "TYPE_MESSAGE", "LABEL_REPEATED", entry + "NamedMetricsEntry"),
        "application_utilization": (9, "TYPE_DOUBLE", "LABEL_OPTIONAL", None),
    }
    assert [name for name, spec in fields.items() if not name.startswith("<") and spec[5]] == [
        "rps"
    ]
    desc = orca_load_report_pb2.OrcaLoadReport.DESCRIPTOR
    for map_field in ("request_cost", "utilization", "named_metrics"):
        entry_desc = desc.fields_by_name[map_field].message_type
        assert entry_desc.GetOptions().map_entry
        assert entry_desc.fields_by_name["key"].type == entry_desc.fields_by_name["key"].TYPE_STRING
        assert (
            entry_desc.fields_by_name["value"].type
            == entry_desc.fields_by_name["value"].TYPE_DOUBLE
        )

    report = orca_load_report_pb2.OrcaLoadReport(cpu_utilization=0.5, named_metrics={"q": 2.0})
    # field 1, wire type 1 (64-bit) -> tag 0x09
    assert report.SerializeToString().startswith(b"\x09")


def test_health_matches_grpclib_health() -> None:
    # grpclib ships the upstream grpc.health.v1 definitions; the messages must match.
    mine = message_schema(health_pb2.DESCRIPTOR)
    ref = message_schema(grpclib_health_pb2.DESCRIPTOR)
    assert mine == ref
    assert enum_schema(health_pb2.DESCRIPTOR) == {
        "grpc.health.v1.HealthCheckResponse.ServingStatus": {
            "UNKNOWN": 0,
            "SERVING": 1,
            "NOT_SERVING": 2,
            "SERVICE_UNKNOWN": 3,
        }
    }
    mapping = _grpclib_mapping(health_grpc.HealthBase)
    assert set(mapping) == {"/grpc.health.v1.Health/Check"}
    check = mapping["/grpc.health.v1.Health/Check"]
    assert check.cardinality is Cardinality.UNARY_UNARY
    assert check.request_type is health_pb2.HealthCheckRequest
    assert check.reply_type is health_pb2.HealthCheckResponse


# ------------------------------------------------------- packaging / regeneration


def test_private_descriptor_pool() -> None:
    # Our descriptors live outside protobuf's default pool, so importing
    # tritonclient or grpclib.health in the same process cannot clash.
    default = descriptor_pool.Default()
    for mod in (grpc_service_pb2, model_config_pb2, health_pb2, orca_load_report_pb2):
        assert mod.DESCRIPTOR.pool is not default
        assert mod.DESCRIPTOR.pool is grpc_service_pb2.DESCRIPTOR.pool
    assert grpc_service_pb2.ModelInferRequest is not triton_service_pb2.ModelInferRequest
    assert (
        grpc_service_pb2.ModelConfigResponse.DESCRIPTOR.fields_by_name["config"].message_type
        is model_config_pb2.ModelConfig.DESCRIPTOR
    )


def test_generated_code_is_up_to_date() -> None:
    pytest.importorskip("grpc_tools")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
