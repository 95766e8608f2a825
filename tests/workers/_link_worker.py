"""The worker's end of a link that the core serves in process (``WorkerLink``), played
by a test: real socket pair, real frames."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import trio

from trioserve.ipc import Arena, TrioChannel, encode_frames
from trioserve.workers._wire import ANSWER, INFER, OUTCOME


class Worker:
    """The worker's end of a link served by a ``WorkerLink``."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self.channel = TrioChannel(sock)
        self.arenas: list[Arena] = []  # closed with the link

    async def send_together(self, *messages: tuple[Any, ...]) -> None:
        """``messages`` in one write: the core reads them all at once."""
        data, _ = encode_frames([(message, []) for message in messages])
        await trio.lowlevel.checkpoint()
        assert self.socket.send(data) == len(data)  # small: the empty socket takes it

    async def infer(self, call: int, value: float) -> None:
        await self.channel.send(delay_infer(call, value))

    async def outcomes(self) -> list[dict[int, tuple[Any, ...]]]:
        """The next ANSWER frames to come, each as its OUTCOMEs by call."""
        frames = []
        for message, _ in await self.channel.receive():
            assert message[0] == ANSWER
            frames.append({call: item for call, item, last in message[1] if last})
        return frames

    async def answers(self) -> list[tuple[int, float]]:
        """The next answers to come: (call, OUTPUT0) each."""
        answers = []
        for message, _ in await self.channel.receive():
            assert message[0] == ANSWER
            for call, item, last in message[1]:
                assert item[0] == OUTCOME and item[1] is None and last
                (_, _, _, data, _), *_ = item[6]
                answers.append((call, float(np.frombuffer(data, np.float32)[0])))
        return answers


def delay_infer(call: int, value: float, model: str = "delay", width: int = 1) -> tuple[Any, ...]:
    """An INFER of the zoo's ``delay`` (or ``model``): ``width`` values, each ``value``."""
    data = np.full((1, width), value, np.float32).tobytes()
    inputs = [("INPUT0", "FP32", (1, width), data, {})]
    return (INFER, call, "HTTP end point", model, "", "", {}, inputs, [], None, None)
