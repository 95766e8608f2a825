"""Tensors in shared memory: the parameters that place them, inputs read, outputs written.

An input or requested output is in shared memory when its parameters name a region:
``shared_memory_region`` (string) and ``shared_memory_byte_size`` (int), with optional
``shared_memory_offset`` (int, default 0). Both front ends decode their parameters to
plain values and call the functions here, so both read and write tensors identically.

``RequestRegions`` is what one request holds: a lease on every region it names, taken
while the request is decoded and returned once its response is encoded. An input in a
system region is read into a read-only numpy array of its own while the request is
decoded (through the region's descriptor, which cannot fault whatever the client does
to its object: see ``_system``); outputs are copied in after the model ran, each checked
to fit before any is written, so a failed request leaves every region as it was.
A model whose instances run in processes of their own (``windows``) gets a fixed-size
input in a system region as a ``WindowInput``: the instance process reads the bytes from
the region's descriptor itself, so the server copies none of them; an output placed in
a system region gets an ``OutputWindow`` as ``RequestedOutput.place``, which says so if
that process wrote it there itself (checked as here, the same way).

Work on a GPU waits on the device, and a copy from ``OFF_LOOP_BYTES`` (256 KiB) takes
milliseconds, so both run in a worker thread, as models do. Decoding stays synchronous:
an input in a CUDA region becomes a cupy view for a GPU model (no copy); for a model on
the CPU, and for a large input in a system region, it becomes an array over a buffer
that ``read_inputs_off_loop`` fills before the request runs. ``write_outputs_off_loop``
writes the outputs of a request that involves a device or a large system window (the
copies release the GIL, so on a machine of several cores they run beside the event
loop). Requests that place only small tensors in system shared memory take neither
step, and never leave the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import trio

from .._errors import InvalidArgumentError, UnsupportedError
from .._limits import OFF_LOOP_BYTES
from .._tensor import Datatype, array_from_raw, array_to_raw, check_raw_size
from .._types import InferenceResponse, OutputTensor, RequestedOutput
from ..ipc._windows import too_small_message
from ._cuda import CudaRegion, device_bytes, is_device_array, to_host
from ._region import Region
from ._registry import SharedMemoryRegistry
from ._system import OutputWindow, SystemRegion, WindowInput

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"


@dataclass(frozen=True, slots=True)
class _Span:
    region: Region
    offset: int
    byte_size: int


@dataclass(frozen=True, slots=True)
class _HostCopy:
    """An input the model gets a host copy of, in ``raw``, made off the event loop: from
    a CUDA region, or from a large window of a system region."""

    span: _Span
    raw: np.ndarray[Any, Any]  # span.byte_size host bytes
    dt: Datatype
    shape: tuple[int, ...]
    what: str
    array: np.ndarray[Any, Any]  # what decoding returned: a view of ``raw``, or BYTES to fill


class RequestRegions:
    """The regions one request uses, leased until ``close`` (or the end of a ``with``).

    ``inputs_off_loop``: inputs wait to be copied (from CUDA regions, or large system
    windows); ``await read_inputs_off_loop()`` before the request runs.
    ``outputs_off_loop``: writing the outputs involves a device (a CUDA region, or a GPU
    model's arrays) or a large system window; ``await write_outputs_off_loop(response)``
    instead of ``write_outputs(response)``.
    """

    __slots__ = (  # one per request
        "_device", "_host_copies", "_leases", "_outputs", "_places", "_registry", "_windows",
        "inputs_off_loop", "leasing_from_thread", "outputs_off_loop", "outputs_placed",
    )  # fmt: skip

    def __init__(
        self, registry: SharedMemoryRegistry, device: str = "cpu", windows: bool = False
    ) -> None:
        self._registry = registry
        self._device = device  # where the model runs: "gpu" models get cupy inputs
        # The model's instance process reads system-region inputs itself: they stay there.
        self._windows = windows
        self._places: dict[str, OutputWindow] | None = None  # outputs a model may write
        self._leases: list[Region] = []
        self._outputs: dict[str, _Span] = {}
        self._host_copies: tuple[_HostCopy, ...] = ()  # rare: no list for every request
        self.inputs_off_loop = False
        self.outputs_off_loop = device == "gpu"  # a GPU model's outputs are on the device
        # Some output goes to a region: the usual request has none to write.
        self.outputs_placed = False
        # Set while a worker thread decodes: leases are then taken on the event loop.
        self.leasing_from_thread = False

    def __enter__(self) -> RequestRegions:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        leases = self._leases
        if leases:  # the usual request leases none: no list to replace
            self._leases = []
            for region in leases:
                region.release()

    def span(self, parameters: Mapping[str, Any], what: str) -> _Span | None:
        """The leased, bounds-checked place the parameters name; None if they name none."""
        placed = _placement(parameters, what)
        if placed is None:
            return None
        name, offset, byte_size = placed
        if self.leasing_from_thread:
            region = trio.from_thread.run_sync(self._registry.lease, name)
        else:
            region = self._registry.lease(name)
        self._leases.append(region)
        region.check_span(offset, byte_size, what)
        return _Span(region, offset, byte_size)

    def input_array(
        self, span: _Span, dt: Datatype, shape: tuple[int, ...], what: str
    ) -> np.ndarray[Any, Any]:
        region = span.region
        # BYTES and BOOL are checked as they are read (parsed; bytes 0 or 1): read here.
        handed = self._windows and not dt.is_bytes and dt.name != "BOOL"
        if handed and isinstance(region, SystemRegion):
            check_raw_size(dt, shape, span.byte_size, what)
            return WindowInput.over(region, span.offset, span.byte_size, dt.dtype, shape)
        if isinstance(region, SystemRegion) and span.byte_size < OFF_LOOP_BYTES:
            return _read_input(region, span, dt, shape, what)
        if isinstance(region, CudaRegion) and self._device == "gpu" and not dt.is_bytes:
            check_raw_size(dt, shape, span.byte_size, what)
            array: np.ndarray[Any, Any] = region.device_array(
                dt, shape, span.offset, span.byte_size
            )
            return array
        # A host copy, which ``read_inputs_off_loop`` makes: of a large system window; of
        # a CUDA region for a model on the CPU, and for BYTES, parsed on the host whatever
        # runs the model.
        raw = np.empty(span.byte_size, dtype=np.uint8)
        if dt.is_bytes:
            array = np.empty(shape, dtype=object)
        else:
            check_raw_size(dt, shape, span.byte_size, what)
            array = raw.view(dt.dtype).reshape(shape)
            array.flags.writeable = False  # read-only, as every other input
        self._host_copies += (_HostCopy(span, raw, dt, shape, what, array),)
        self.inputs_off_loop = True
        return array

    async def read_inputs_off_loop(self) -> None:
        """Copy the inputs waiting in regions to the host, in a worker thread.

        INVALID_ARG for data the copy shows to be malformed (BYTES, BOOL), as for any
        input. Not abandoned on cancellation: the leases must outlive the copy.
        """
        copies, self._host_copies = self._host_copies, ()
        self.inputs_off_loop = False
        await trio.to_thread.run_sync(_copy_to_host, copies)

    def request_outputs(self, outputs: Iterable[RequestedOutput]) -> None:
        """Note (and lease) the requested outputs that go to shared memory."""
        for output in outputs:
            if output.parameters:
                span = self.span(output.parameters, f"output '{output.name}'")
                if span is not None:
                    self._outputs[output.name] = span
                    self.outputs_placed = True
                    if self._windows and isinstance(span.region, SystemRegion):
                        # The model's process may write it there itself.
                        place = OutputWindow(span.region, span.offset, span.byte_size)
                        output.place = place
                        self._places = {**(self._places or {}), output.name: place}
                    if isinstance(span.region, CudaRegion) or span.byte_size >= OFF_LOOP_BYTES:
                        self.outputs_off_loop = True

    def write_outputs(self, response: InferenceResponse) -> None:
        """Copy the outputs placed in shared memory into their regions.

        Each written output's parameters become what the response reports for it (the
        region, the bytes written, the offset), and the codecs then send no data for it.
        Every output is checked to fit before the first is written. A GPU model's other
        outputs are copied to the host here, for the codecs. With ``outputs_off_loop`` this
        waits on the device or copies a large window: use ``write_outputs_off_loop``
        then.
        """
        if not self._outputs and self._device != "gpu":
            return
        writes = []
        for tensor in response.outputs:
            span = self._outputs.get(tensor.name)
            if span is None:
                _to_host(tensor)
                continue
            place = self._places.get(tensor.name) if self._places else None
            if place is not None and place.written is not None:  # there already, checked
                writes.append((tensor, span, None, place.written))
                continue
            raw = _raw_output(tensor.data, tensor.datatype, span.region)
            size = int(raw.nbytes)
            if size > span.byte_size:
                raise InvalidArgumentError(too_small_message(tensor.name, span.byte_size, size))
            if isinstance(span.region, SystemRegion):  # refused before anything is written
                span.region.check_holds(span.offset, size, f"output '{tensor.name}'")
            writes.append((tensor, span, raw, size))
        for tensor, span, raw, size in writes:
            if raw is not None:
                _write(span, raw, size)
            tensor.parameters = _reported(span, size)

    async def write_outputs_off_loop(self, response: InferenceResponse) -> None:
        """``write_outputs`` in a worker thread, for a request with ``outputs_off_loop``.
        Not abandoned on cancellation: the leases must outlive the copies."""
        await trio.to_thread.run_sync(self.write_outputs, response)


def _to_host(tensor: OutputTensor) -> None:
    if is_device_array(tensor.data):
        tensor.data = to_host(tensor.data)


def is_shared_memory_output(parameters: Mapping[str, Any]) -> bool:
    """Whether an output tensor's parameters say it was written to shared memory."""
    return REGION in parameters


def shared_memory_input(
    regions: RequestRegions | None,
    parameters: Mapping[str, Any],
    dt: Datatype,
    shape: tuple[int, ...],
    what: str,
    has_data: bool,
) -> np.ndarray[Any, Any] | None:
    """The input the parameters place in shared memory; None if they place none there.

    ``has_data``: the input also carries data of its own, which is an error with a region.
    """
    if not parameters or (REGION not in parameters and BYTE_SIZE not in parameters
                          and OFFSET not in parameters):  # fmt: skip
        return None  # the common case, answered before anything else
    if regions is None:
        raise UnsupportedError(f"{what}: shared memory is not supported here")
    if has_data and REGION in parameters:
        raise InvalidArgumentError(
            f"{what}: unexpected data provided when using shared memory for the input"
        )
    span = regions.span(parameters, what)
    if span is None:
        return None
    return regions.input_array(span, dt, shape, what)


def shared_memory_outputs(
    regions: RequestRegions | None, outputs: Sequence[RequestedOutput]
) -> None:
    """Note the requested outputs placed in shared memory (UNSUPPORTED without regions)."""
    if regions is not None:
        regions.request_outputs(outputs)
    elif outputs and any(_names_shared_memory(o.parameters) for o in outputs):
        raise UnsupportedError("shared memory is not supported here")


def _names_shared_memory(parameters: Mapping[str, Any]) -> bool:
    return REGION in parameters or BYTE_SIZE in parameters or OFFSET in parameters


def _placement(parameters: Mapping[str, Any], what: str) -> tuple[str, int, int] | None:
    name = parameters.get(REGION)
    byte_size = parameters.get(BYTE_SIZE)
    offset = parameters.get(OFFSET, 0)
    if name is None:
        for key in (BYTE_SIZE, OFFSET):
            if key in parameters:
                raise InvalidArgumentError(
                    f"{what}: '{key}' can not be specified without '{REGION}'"
                )
        return None
    if not isinstance(name, str):
        raise InvalidArgumentError(f"{what}: '{REGION}' must be a string")
    if byte_size is None:
        raise InvalidArgumentError(f"{what}: '{REGION}' needs '{BYTE_SIZE}' as well")
    for key, value in ((BYTE_SIZE, byte_size), (OFFSET, offset)):
        if type(value) is not int or value < 0:
            raise InvalidArgumentError(
                f"{what}: '{key}' must be a non-negative integer, got {value!r}"
            )
    return name, offset, byte_size


def _read_input(
    region: SystemRegion, span: _Span, dt: Datatype, shape: tuple[int, ...], what: str
) -> np.ndarray[Any, Any]:
    """The input's copy, read from its system region into a buffer of its own."""
    if not dt.is_bytes:  # refused before the bytes are copied for nothing
        check_raw_size(dt, shape, span.byte_size, what)
    raw = np.empty(span.byte_size, dtype=np.uint8)
    region.read_into(span.offset, raw, what)
    raw.flags.writeable = False  # read-only, as inputs from a message body are
    return array_from_raw(dt, shape, raw.data, what)


def _copy_to_host(copies: tuple[_HostCopy, ...]) -> None:
    for copy in copies:
        region = copy.span.region
        if isinstance(region, SystemRegion):
            region.read_into(copy.span.offset, copy.raw, copy.what)
        else:
            assert isinstance(region, CudaRegion)
            region.read_into(copy.span.offset, copy.raw)
        # The checks of any raw input: BYTES parsed, BOOL bytes 0 or 1. Fixed-size data
        # is already in place, ``array`` being a view of ``raw``.
        checked = array_from_raw(copy.dt, copy.shape, copy.raw.data, copy.what)
        if copy.dt.is_bytes:
            copy.array[...] = checked


def _raw_output(data: Any, dt: Datatype, region: Region) -> Any:
    """The output's raw bytes as a flat uint8 array: cupy when both ends are on a GPU."""
    if is_device_array(data):
        raw = device_bytes(data)
        return raw if isinstance(region, CudaRegion) else to_host(raw)
    return np.frombuffer(array_to_raw(data, dt), dtype=np.uint8)


def _write(span: _Span, raw: Any, size: int) -> None:
    region = span.region
    if isinstance(region, SystemRegion):
        region.write(span.offset, raw)
    else:
        assert isinstance(region, CudaRegion)
        region.write(span.offset, raw, size)


def _reported(span: _Span, size: int) -> dict[str, Any]:
    reported: dict[str, Any] = {REGION: span.region.name, BYTE_SIZE: size}
    if span.offset:
        reported[OFFSET] = span.offset
    return reported
