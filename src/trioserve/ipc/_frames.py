"""Framed control messages over a local stream socket, descriptors riding with them.

A frame is an 8-byte header (payload length, descriptor count) and a pickled payload:
the messages sent together, and how many of the frame's descriptors each names.
Messages carry control only: names, shapes, dtypes, ``Block`` places, errors. Tensor
bytes live in an ``Arena`` and never pass through pickle. The descriptors a frame
names travel in the ancillary data (``SCM_RIGHTS``) of the ``sendmsg`` that carries
the frame's bytes, so by the time a frame is whole its descriptors have arrived, in
order; the reader hands each frame the count its header says.

Messages sent at once are one frame and one ``sendmsg``: a sender that finds others
waiting writes their messages together (``encode_frames``), one pickle call and one
system call for the batch, and the reader one unpickling.
"""

from __future__ import annotations

import array
import os
import pickle
import socket
import struct
from collections import deque
from collections.abc import Sequence
from typing import Any

HEADER = struct.Struct("<II")
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_FDS_PER_READ = 64
ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_READ * array.array("i").itemsize)
READ_BYTES = 256 * 1024


class FrameError(ValueError):
    """A peer sent bytes that are not a frame: the link cannot go on."""


Outgoing = tuple[Any, Sequence[int]]  # a message and the descriptors it sends


def encode_frames(frames: Sequence[Outgoing]) -> tuple[bytes, list[int]]:
    """The bytes of one frame holding the messages ``frames`` names, in order, and all
    their descriptors in order (several frames if one would exceed the bound)."""
    fds = [fd for _, frame_fds in frames for fd in frame_fds]
    payload = pickle.dumps(
        ([message for message, _ in frames], [len(frame_fds) for _, frame_fds in frames]),
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    if len(payload) > MAX_FRAME_BYTES and len(frames) > 1:  # halves, each within it
        half = len(frames) // 2
        first, second = encode_frames(frames[:half]), encode_frames(frames[half:])
        return first[0] + second[0], fds
    return HEADER.pack(len(payload), len(fds)) + payload, fds


def ancillary(fds: Sequence[int]) -> list[tuple[int, int, bytes]]:
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


def received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            numbers = array.array("i")
            numbers.frombytes(data[: len(data) - len(data) % numbers.itemsize])
            fds.extend(numbers)
    return fds


class FrameReader:
    """Bytes and descriptors in as they arrive; whole frames out."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._fds: deque[int] = deque()

    def feed(self, data: bytes, fds: Sequence[int] = ()) -> list[tuple[Any, list[int]]]:
        self._buffer += data
        self._fds.extend(fds)
        frames = []
        start = 0
        buffer = self._buffer
        while len(buffer) - start >= HEADER.size:
            length, fd_count = HEADER.unpack_from(buffer, start)
            if length > MAX_FRAME_BYTES:
                raise FrameError(f"a frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
            end = start + HEADER.size + length
            if len(buffer) < end:
                break
            if fd_count > len(self._fds):
                raise FrameError(f"a frame names {fd_count} descriptors; {len(self._fds)} came")
            try:
                messages, counts = pickle.loads(memoryview(buffer)[start + HEADER.size : end])
            except Exception as exc:
                raise FrameError(f"a frame does not decode: {exc!r}") from None
            if sum(counts) != fd_count or len(counts) != len(messages):
                raise FrameError("a frame's messages name other descriptors than its header")
            if fd_count:
                for message, count in zip(messages, counts, strict=True):
                    frames.append((message, [self._fds.popleft() for _ in range(count)]))
            else:
                frames += [(message, []) for message in messages]
            start = end
        if start:
            del buffer[:start]
        return frames

    def close(self) -> None:
        """Close descriptors that arrived for frames that never completed."""
        while self._fds:
            os.close(self._fds.popleft())
