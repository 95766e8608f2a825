"""ModelInfer's messages with their tensors kept out of protobuf.

A ``ModelInferRequest`` is mostly tensor bytes (``raw_input_contents``, field 7) around a
small description. Parsing it with protobuf copies every tensor into the parsed message
and again out of it. Here the message's top-level fields are scanned instead: field 7's
entries become views of the received bytes (no copy), and the rest, the *head*, is
parsed by protobuf. Clients repeat their heads (same model, inputs and shapes; only the
tensors change), so a head is decoded once into a plan, and a request with a known head
is built from the plan and its views, without protobuf at all.

The reply goes the same way in reverse: the head of a ``ModelInferResponse`` (names,
shapes) is serialized by protobuf (and kept for the next reply with the same head), and
each output's bytes follow it as its own ``raw_output_contents`` field, a view of the
numpy array, written to the socket without being joined. Protobuf readers take fields in
any order and merge repeated ones, so head + raw fields is one well-formed message.

Both classes are what the gRPC front ends expect of messages (``FromString``,
``SerializeToString``), so grpclib carries them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf.message import DecodeError

from .._tensor import Datatype, array_from_raw, array_to_raw
from .._types import (
    InferenceRequest,
    InferenceResponse,
    InputTensor,
    OutputTensor,
    Parameters,
    RequestedOutput,
)
from ..shm import RequestRegions, is_shared_memory_output
from ._codec import decode_request, response_head
from ._errors import parse_message
from ._generated import grpc_service_pb2 as pb

_RAW_INPUT_FIELD = 7  # ModelInferRequest.raw_input_contents
_RAW_OUTPUT_TAG = (6 << 3) | 2  # ModelInferResponse.raw_output_contents, length-delimited
_STREAM_REPLY_TAG = (2 << 3) | 2  # ModelStreamInferResponse.infer_response
_CACHED_HEADS = 256
_SHM_KEYS = frozenset({"shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"})

Buffer = bytes | bytearray | memoryview


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class WireRequest:
    """A ``ModelInferRequest`` as its head (bytes) and its raw inputs (views)."""

    __slots__ = ("head", "raw")
    DESCRIPTOR = pb.ModelInferRequest.DESCRIPTOR  # the message it stands for

    def __init__(self, head: bytes, raw: list[memoryview]) -> None:
        self.head = head
        self.raw = raw

    @classmethod
    def FromString(cls, data: Buffer) -> WireRequest:
        """Split ``data``; ``DecodeError`` if its top level is not well-formed."""
        view = memoryview(data)
        size = len(view)
        head: list[memoryview] = []
        raw: list[memoryview] = []
        start = pos = 0
        # Keys and lengths under 128 (nearly all) are read inline: a call per varint was
        # most of the scan's cost.
        while pos < size:
            key = view[pos]
            if key < 0x80:
                after = pos + 1
            else:
                key, after = _varint(view, pos)
            wire = key & 7
            if wire == 2:
                if after < size and view[after] < 0x80:
                    length = view[after]
                    after += 1
                else:
                    length, after = _varint(view, after)
                if key >> 3 == _RAW_INPUT_FIELD:
                    head.append(view[start:pos])
                    raw.append(view[after : after + length])
                    start = after + length
                after += length
            elif wire == 0:
                _, after = _varint(view, after)
            elif wire == 1:
                after += 8
            elif wire == 5:
                after += 4
            else:
                raise DecodeError(f"unexpected wire type {wire}")
            if after > size:
                raise DecodeError("truncated message")
            pos = after
        head.append(view[start:])
        return cls(b"".join(head), raw)


class InferPlan:
    """What one request head says, decoded once; ``decode`` builds each request."""

    __slots__ = ("_direct", "_inputs", "_message", "_rest", "model_name", "model_version")

    def __init__(self, message: pb.ModelInferRequest) -> None:
        self._message = message
        self.model_name = message.model_name
        self.model_version = message.model_version
        # Once a request has decoded: each input's name, datatype, shape and parameters,
        # and the request's outputs, id and parameters (no tensor data is kept).
        self._inputs: tuple[tuple[str, Datatype, tuple[int, ...], Parameters], ...] = ()
        self._rest: tuple[list[RequestedOutput], str, Parameters] | None = None
        # Inputs all raw and nothing in shared memory: built straight from the template.
        self._direct = not any(
            tensor.HasField("contents") or _SHM_KEYS.intersection(tensor.parameters)
            for tensor in message.inputs
        ) and not any(_SHM_KEYS.intersection(output.parameters) for output in message.outputs)

    def decode(self, raw: Sequence[Buffer], regions: RequestRegions) -> InferenceRequest:
        rest = self._rest
        if rest is None or len(raw) != len(self._inputs):
            request = decode_request(self._message, regions, raw)
            if self._direct and rest is None:
                self._inputs = tuple(
                    (t.name, t.datatype, t.shape, t.parameters) for t in request.inputs.values()
                )
                self._rest = (request.outputs, request.id, request.parameters)
            return request
        inputs = {}
        for (name, dt, shape, parameters), buffer in zip(self._inputs, raw, strict=True):
            data = array_from_raw(dt, shape, buffer, f"input '{name}'")
            inputs[name] = InputTensor(name, dt, shape, data, dict(parameters))
        outputs, request_id, parameters = rest
        return InferenceRequest(
            self.model_name,
            self.model_version,
            inputs,
            [RequestedOutput(o.name, dict(o.parameters)) for o in outputs],
            request_id,
            dict(parameters),
        )


class InferPlans:
    """Plans by request head, bounded (a client that varies its head every time, e.g.
    with a fresh request id, only ever misses)."""

    def __init__(self) -> None:
        self._plans: dict[bytes, InferPlan] = {}

    def plan(self, request: WireRequest) -> InferPlan:
        plan = self._plans.get(request.head)
        if plan is None:
            plan = InferPlan(parse_message(pb.ModelInferRequest, request.head))
            if len(self._plans) >= _CACHED_HEADS:
                self._plans.clear()
            self._plans[request.head] = plan
        return plan


class WireReply:
    """A ``ModelInferResponse`` as parts: its serialized head, then each raw output."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[bytes | memoryview]) -> None:
        self.parts = parts

    def SerializeToString(self) -> bytes:
        return b"".join(self.parts)


class ReplyHeads:
    """Serialized reply heads by what they hold, bounded."""

    def __init__(self) -> None:
        self._heads: dict[tuple[Any, ...], bytes] = {}

    def encode(self, response: InferenceResponse) -> WireReply:
        outputs = response.outputs
        plain = not response.parameters and not any(t.parameters for t in outputs)
        if plain:
            key = (
                response.model_name,
                response.model_version,
                response.id,
                *[(t.name, t.datatype.name, t.data.shape) for t in outputs],
            )
            head = self._heads.get(key)
            if head is None:
                head = response_head(response).SerializeToString()
                if len(self._heads) >= _CACHED_HEADS:
                    self._heads.clear()
                self._heads[key] = head
        else:
            head = response_head(response).SerializeToString()
        return WireReply([head, *_raw_parts(outputs)])


def stream_reply(head: pb.ModelInferResponse, outputs: Sequence[OutputTensor]) -> WireReply:
    """A ``ModelStreamInferResponse`` holding ``head`` and the outputs' raw contents, as
    parts: protobuf would copy every output twice on the event loop (into the reply,
    then into the stream response), seconds for a large one."""
    parts = [head.SerializeToString(), *_raw_parts(outputs)]
    size = sum(map(len, parts))
    return WireReply([bytes((_STREAM_REPLY_TAG,)) + _encode_varint(size), *parts])


def _raw_parts(outputs: Sequence[OutputTensor]) -> list[bytes | memoryview]:
    """Each output's ``raw_output_contents`` field: its key and length, then its bytes
    (a view of the array); an empty one for an output placed in shared memory."""
    parts: list[bytes | memoryview] = []
    for tensor in outputs:
        if is_shared_memory_output(tensor.parameters):
            parts.append(bytes((_RAW_OUTPUT_TAG, 0)))
            continue
        data = array_to_raw(tensor.data, tensor.datatype)
        parts.append(bytes((_RAW_OUTPUT_TAG,)) + _encode_varint(len(data)))
        parts.append(data)
    return parts
