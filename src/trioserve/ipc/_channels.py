"""The event loop's end of a link, ``TrioChannel``; the other end is ``_blocking``'s
``BlockingChannel``. Both speak ``_frames``; both batch frames that are ready together
into one ``sendmsg``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import trio

from ._blocking import LinkClosed
from ._frames import (
    ANCILLARY_BYTES,
    READ_BYTES,
    FrameReader,
    Outgoing,
    ancillary,
    encode_frames,
    received_fds,
)


class TrioChannel:
    """The event loop's end. ``send`` never waits for the peer to read a frame, only
    for the kernel to take its bytes (a frame without descriptors that the socket takes
    at once is written without a checkpoint); frames sent while another send is writing
    go out together with the next write. ``coalesce``: a send that finds no write under way
    first lets the other ready tasks run, so that every frame of one turn of the event
    loop goes in one system call (for links that carry many small frames under load; it
    costs a scheduling round per write). ``merge``: what the frames of one write become
    before they are encoded (the owner's, which may merge some into one). ``write_now``
    writes frames from code that cannot wait (a callback), or leaves them for ``flush``.

    It does its own non-blocking I/O on ``sock`` (a stdlib socket, made non-blocking),
    not through trio's socket wrapper: a link's peer answers every frame, so a read
    that drained the socket is followed by a wait, and the next read finds the frames
    (the wrapper tries the read first: a failed system call, an exception and a
    context manager, on both ends of the link, for every frame)."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        coalesce: bool = False,
        merge: Callable[[list[Outgoing]], list[Outgoing]] | None = None,
    ) -> None:
        sock.setblocking(False)
        self._socket = sock
        self.coalesce = coalesce
        self._merge = merge
        self._reader = FrameReader()
        self._pending: list[Outgoing] = []
        self._rest = b""  # the end of a frame ``write_now`` wrote in part
        self._writing = False
        self._closed = False
        self._drained = True  # the last read took all the socket held: wait first
        self._owned: set[int] = set()  # descriptors to close once sent
        self.frames_sent = 0
        self.writes = 0

    async def send(self, message: Any, fds: Sequence[int] = (), *, owned: bool = False) -> None:
        """Queue a frame and, unless a send is already writing, write every queued one.
        Descriptors are duplicated by the kernel on send; the caller keeps its own, unless
        ``owned``: the channel closes them once sent (the frame may wait for another
        send's write, while the caller's own descriptor could be closed)."""
        if self._closed:
            if owned:
                _close(fds)
            raise LinkClosed("the link is closed")
        if owned:
            self._owned.update(fds)
        self._pending.append((message, fds))
        await self.flush()

    def write_now(self, messages: list[Any]) -> bool:
        """Write frames without descriptors at once, without waiting: True if the socket
        took them all, or a write under way will send them; False if the caller must
        ``flush`` (soon: the frames, or the end of them the socket did not take, wait
        for it, and every later frame behind them)."""
        if self._closed:
            raise LinkClosed("the link is closed")
        if self._writing or self._pending or self._rest:
            self._pending += [(message, ()) for message in messages]
            return self._writing
        data, _ = self._encode([(message, ()) for message in messages])
        try:
            written = self._write_now(data)
        except OSError as exc:
            raise LinkClosed(f"the peer is gone: {exc}") from None
        if written == len(data):
            return True
        self._rest = data[written:]
        return False

    async def flush(self) -> None:
        """Write every frame waiting to go, unless a write under way is writing them."""
        if self._writing:
            return
        self._writing = True
        try:
            if self.coalesce:
                # Let the other tasks that are ready run first: frames they send in this
                # turn of the event loop join this write, one system call for all. (A
                # schedule point that no cancellation interrupts, without the cost of a
                # shielded scope.)
                await trio.lowlevel.cancel_shielded_checkpoint()
            if self._rest:  # what ``write_now`` could not write goes first
                rest, self._rest = self._rest, b""
                with trio.CancelScope(shield=True):
                    await self._write(rest, [])
            while self._pending:
                batch, self._pending = self._pending, []
                data, all_fds = self._encode(batch)
                if not all_fds:
                    # Most frames fit the socket's buffer: written at once, they need
                    # neither a trip through the event loop nor a shielded scope.
                    data = data[self._write_now(data) :]
                    if not data:
                        continue
                # A frame cut short by a cancellation would garble every later one. The
                # peer reads all the time, so the write is brief; a peer that stopped
                # reading is killed by its owner, which ends the write with EPIPE.
                try:
                    with trio.CancelScope(shield=True):
                        await self._write(data, all_fds)
                finally:
                    self._close_owned(all_fds)
        except OSError as exc:
            raise LinkClosed(f"the peer is gone: {exc}") from None
        finally:
            self._writing = False

    def _encode(self, batch: list[Outgoing]) -> tuple[bytes, list[int]]:
        """The bytes of one write of ``batch``, and their descriptors."""
        if self._merge is not None and len(batch) > 1:
            batch = self._merge(batch)
        self.frames_sent += len(batch)
        self.writes += 1
        return encode_frames(batch)

    def _close_owned(self, fds: Sequence[int]) -> None:
        if self._owned:
            sent = self._owned.intersection(fds)
            self._owned -= sent
            _close(sent)

    def _write_now(self, data: bytes) -> int:
        """How much of ``data`` the socket took without waiting (it is non-blocking)."""
        try:
            return os.write(self._socket.fileno(), data)
        except BlockingIOError:
            return 0

    async def _write(self, data: bytes, fds: list[int]) -> None:
        view = memoryview(data)
        ancdata = ancillary(fds)  # with the first bytes that go
        while view:
            try:
                sent = self._socket.sendmsg([view], ancdata)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._socket)
                continue
            view, ancdata = view[sent:], []
        # A turn for the other tasks: the frames they send meanwhile go in one write.
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive(self) -> list[tuple[Any, list[int]]]:
        """The next frames to arrive (at least one), each with its descriptors."""
        while True:
            if self._drained:
                await trio.lowlevel.wait_readable(self._socket)
            else:  # a read filled its buffer: more may be there, read after a turn
                await trio.lowlevel.checkpoint()
            try:
                data, ancdata, _flags, _address = self._socket.recvmsg(READ_BYTES, ANCILLARY_BYTES)
            except BlockingIOError:  # nothing yet (after a full read, or a stale wake-up)
                self._drained = True
                continue
            except ConnectionResetError as exc:  # it died with frames of ours unread
                raise LinkClosed(f"the peer is gone: {exc}") from None
            # A short read took what there was (or stopped at a frame's descriptors:
            # then the wait returns at once).
            self._drained = len(data) < READ_BYTES
            fds = received_fds(ancdata)
            if not data:
                for fd in fds:
                    os.close(fd)
                raise LinkClosed("the peer closed the link")
            frames = self._reader.feed(data, fds)
            if frames:
                return frames

    def close(self) -> None:
        self._closed = True
        self._reader.close()
        if self._socket.fileno() != -1:  # not closed before
            trio.lowlevel.notify_closing(self._socket)  # a task waiting on it is woken
            self._socket.close()
        owned, self._owned = self._owned, set()  # frames never sent
        _close(owned)


def _close(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)
