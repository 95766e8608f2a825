"""The clients' system shared-memory regions one instance process was handed, as the
server sees them.

A fixed-size input that a client placed in a system region reaches a process-mode model
as a ``shm.WindowInput`` (``RequestRegions(windows=True)``): no byte of it was read in
the server. ``HandedRegions.frame_tensor`` describes it for the batch's frame by region
and offset, and the region's descriptor goes to the process once (a ``windows`` frame,
before the first batch that uses it); the process reads the bytes itself
(``_pb_windows``). Likewise an output the request placed in a system region: the
process writes it there itself (``placed_outputs``), and its answer names the window
(``written``). Once the region is released (unregistered, and no request leases it
any more) the process is told to close its descriptor (``unwindow``), so that it keeps
neither the descriptor nor the client's object.

The descriptor a frame carries is a duplicate the channel closes once it is sent: the
frame may wait behind another send's write, by which time the region's own descriptor
may be closed (its request cancelled, the region unregistered).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import numpy as np
import trio

from .._tensor import datatype, datatype_from_config
from .._types import RequestedOutput
from ..ipc import Arena, Block, LinkClosed, TrioChannel
from ..shm._system import SystemRegion, WindowInput, stand_in
from ._pb_windows import WINDOW
from ._pb_wire import FrameTensor, frame_tensor


class HandedRegions:
    """The regions one instance process holds a descriptor of (by serial); ``reset``
    for each new process."""

    def __init__(self, model_config: str) -> None:
        # The declared datatype of each fixed-size output (the model's config, as JSON):
        # the process writes an output itself only when the model made it of that type
        # (the server converts any other, and writes it).
        self._datatypes = {
            o["name"]: datatype_from_config(o["data_type"]).name
            for o in json.loads(model_config).get("output", [])
            if o["data_type"] != "TYPE_STRING"
        }
        self._channel: TrioChannel | None = None
        self._handed: set[int] = set()
        self._fresh: list[SystemRegion] = []  # handed, not yet announced

    def reset(self, channel: TrioChannel) -> None:
        """A new process, linked by ``channel``: it holds none of the regions."""
        self._channel = channel
        self._handed.clear()
        self._fresh.clear()

    def frame_tensor(
        self,
        arena: Arena,
        name: str,
        datatype_name: str,
        data: np.ndarray[Any, Any],
        blocks: list[Block],
    ) -> FrameTensor:
        """An input for a batch's frame: by region and offset if it lies in a client's
        region, else as ``_pb_wire.frame_tensor`` places it."""
        if not isinstance(data, WindowInput):
            return frame_tensor(arena, name, datatype_name, data, blocks)
        serial = self._hand(data.region)
        return (name, datatype_name, data.shape, WINDOW, serial, data.offset, data.byte_size)

    def placed_outputs(
        self, outputs: list[RequestedOutput]
    ) -> dict[str, tuple[int, int, int, str]]:
        """The requested outputs the process may write into clients' regions itself: by
        name, (serial, offset, byte size, declared datatype)."""
        datatypes = self._datatypes
        return {
            o.name: (self._hand(o.place.region), o.place.offset, o.place.byte_size,
                     datatypes[o.name])
            for o in outputs
            if o.place is not None and o.name in datatypes
        }  # fmt: skip

    @staticmethod
    def written(tensor: FrameTensor, outputs: list[RequestedOutput]) -> np.ndarray[Any, Any] | None:
        """For an output of a ``done`` frame that the process wrote into a client's
        region: a stand-in array of its datatype and shape (its place notes the bytes
        written, for ``shm.RequestRegions.write_outputs``); None for any other output."""
        if len(tensor) != 7:
            return None
        name, datatype_name, shape, _mark, _serial, _offset, byte_size = tensor
        for output in outputs:
            if output.name == name and output.place is not None:
                output.place.written = byte_size
        return stand_in(datatype(datatype_name).dtype, shape)

    def _hand(self, region: SystemRegion) -> int:
        """The region's serial; its descriptor goes with the next ``announce``, the first
        time."""
        serial = region.serial
        if serial not in self._handed:
            self._handed.add(serial)
            self._fresh.append(region)
            region.when_released(lambda: self._released(serial))
        return serial

    @property
    def unannounced(self) -> bool:
        """Whether regions were handed since the last ``announce``."""
        return bool(self._fresh)

    async def announce(self, channel: TrioChannel) -> None:
        """Send the descriptors of the regions handed since the last call. Call it with no
        checkpoint after ``frame_tensor``: the frame is queued before any, so it goes
        before the batch's frame, whatever becomes of the batch."""
        fresh, self._fresh = self._fresh, []
        if fresh:
            regions = [(r.serial, r.name, r.key, r.offset) for r in fresh]
            fds = [os.dup(r.descriptor) for r in fresh]
            await channel.send(("windows", regions), fds, owned=True)

    def _released(self, serial: int) -> None:
        """The region let go of its descriptor: so does the process, if it holds one."""
        if serial in self._handed and self._channel is not None:
            self._handed.discard(serial)
            trio.lowlevel.spawn_system_task(self._unwindow, self._channel, serial)

    @staticmethod
    async def _unwindow(channel: TrioChannel, serial: int) -> None:
        with contextlib.suppress(LinkClosed):  # the process is gone, and its descriptor
            await channel.send(("unwindow", [serial]))
