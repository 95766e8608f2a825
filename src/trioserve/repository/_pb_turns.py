"""Which thread of an instance process reads the link, and which runs the model.

The thread that reads a batch runs it too: handing each batch to a second thread would
cost a wake-up and a switch per batch. But a thread inside the model's code cannot read,
and a model waiting for the server (a BLS request, ``is_cancelled``, a metric family;
from its ``execute``, its asyncio loop or a thread of its own) needs someone to read
the reply. So every call to the server first asks for a reader (``need_reader``): if
the reading thread is the one running the model, its turn to read passes to an idle
thread (one is started if none waits). When the model's work ends, that thread reads
again if the turn is free, else it waits for a turn.

The model's work (``initialize``, each batch, ``finalize``) runs one piece at a time,
in the order the frames came: a piece read while another runs waits in line, and the
thread running the other one runs it next.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

Work = Callable[[], None]


class Turns:
    """``read`` gets the next piece of the model's work (None for a frame handled while
    read); it runs in whichever thread has the turn, and raises to end that thread."""

    def __init__(self, read: Callable[[], Work | None], ended: Callable[[], None]) -> None:
        self._read = read
        self._ended = ended  # what a thread whose read or work raised does: ends the process
        self._lock = threading.Condition()
        self._reader: int | None = None  # whose turn to read; None: the first to wake
        self._worker: int | None = None  # the thread inside the model's work
        self._line: deque[Work] = deque()
        self._idle = 0

    def run(self) -> None:
        """Take turns from this thread (the process's main thread first)."""
        me = threading.get_ident()
        with self._lock:
            if self._reader is None:
                self._reader = me
        try:
            while True:
                self._wait_turn(me)
                work = self._read()
                if work is not None:
                    self._work(me, work)
        except BaseException:
            self._ended()
            raise

    def need_reader(self) -> None:
        """A reply will come: make sure a thread reads while the model's code runs."""
        with self._lock:
            if self._worker is None or self._reader != self._worker:
                return
            self._reader = None
            if self._idle:
                self._lock.notify()
                return
        threading.Thread(target=self.run, name="reading", daemon=True).start()

    def _wait_turn(self, me: int) -> None:
        with self._lock:
            while self._reader not in (None, me):
                self._idle += 1
                self._lock.wait()
                self._idle -= 1
            self._reader = me

    def _work(self, me: int, work: Work) -> None:
        with self._lock:
            if self._worker is not None:
                self._line.append(work)  # the thread running the model runs it next
                return
            self._worker = me
        while True:
            try:
                work()
            finally:
                with self._lock:
                    next_work = self._line.popleft() if self._line else None
                    if next_work is None:
                        self._worker = None
            if next_work is None:
                return
            work = next_work
