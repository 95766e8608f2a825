"""The worker's end of a link that the core serves in process (``WorkerLink``), played
by a test: real socket pair, real frames."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import trio

from trioserve.ipc import Arena, TrioChannel, encode_frames
from trioserve.workers._coalesce import grouped, outcomes_of_rows
from trioserve.workers._wire import ANSWER, INFER, OUTCOME


class Worker:
    """The worker's end of a link served by a ``WorkerLink``."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self.channel = TrioChannel(sock)
        self.arenas: list[Arena] = []  # closed with the link

    async def send_together(self, *messages: tuple[Any, ...]) -> None:
        """``messages`` in one write, as a worker writes them (alike INFERs as one
        INFERS): the core reads them all at once."""
        data, _ = encode_frames(grouped([(message, []) for message in messages]))
        await trio.lowlevel.checkpoint()
        assert self.socket.send(data) == len(data)  # small: the empty socket takes it

    async def infer(self, call: int, value: float) -> None:
        await self.channel.send(delay_infer(call, value))

    async def outcomes(self) -> list[dict[int, tuple[Any, ...]]]:
        """The next ANSWER frames to come, each as its OUTCOMEs by call."""
        frames = []
        for message, _ in await self.channel.receive():
            assert message[0] == ANSWER
            frames.append(dict(_each_outcome(message[1])))
        return frames

    async def answers(self) -> list[tuple[int, float]]:
        """The next answers to come: (call, OUTPUT0) each."""
        answers = []
        for message, _ in await self.channel.receive():
            assert message[0] == ANSWER
            for call, item in _each_outcome(message[1]):
                assert item[0] == OUTCOME and item[1] is None
                (_, _, _, data, _), *_ = item[6]
                answers.append((call, float(np.frombuffer(data, np.float32)[0])))
        return answers


def _each_outcome(items: list[tuple[Any, ...]]) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """An ANSWER's OUTCOMEs by call, as the worker takes them: an OUTCOME of several
    INFERs cut into each one's."""
    for call, item, last in items:
        assert last
        if type(call) is tuple:
            yield from outcomes_of_rows(call, item)
        else:
            yield call, item


def delay_infer(call: int, value: float, model: str = "delay", width: int = 1) -> tuple[Any, ...]:
    """An INFER of the zoo's ``delay`` (or ``model``): ``width`` values, each ``value``."""
    data = np.full((1, width), value, np.float32).tobytes()
    inputs = [("INPUT0", "FP32", (1, width), data, {})]
    return (INFER, call, "HTTP end point", model, "", "", {}, inputs, [], None, None)
