"""The disconnect sweeper under MockClock: who gets watched, and when."""

import pytest
import trio

from trioserve.rest._disconnects import DisconnectWatch


class FakeTicket:
    def __init__(self) -> None:
        self.withdrawn_at: float | None = None

    def withdraw(self) -> None:
        self.withdrawn_at = trio.current_time()


async def test_only_requests_outliving_the_grace_period_are_watched(autojump_clock):
    watch = DisconnectWatch(grace_s=0.005)
    client_gone = trio.Event()
    watched_at: list[float] = []

    async def receive():
        watched_at.append(trio.current_time())
        await client_gone.wait()
        return {"type": "http.disconnect"}

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        fast, slow, answered = FakeTicket(), FakeTicket(), FakeTicket()
        entry = watch.track(fast, receive)  # t = 0
        await trio.sleep(0.004)
        watch.untrack(fast, entry)  # answered after 4 ms: never watched
        watch.track(slow, receive)  # t = 4 ms; the sweep at 5 ms finds it too young
        await trio.sleep(0.0015)
        late_entry = watch.track(answered, receive)  # t = 5.5 ms
        await trio.sleep(0.0055)
        # The sweep at 10 ms watched the one that had waited 6 ms, not the 4.5 ms-old one.
        assert watched_at == pytest.approx([0.010])
        await trio.sleep(0.005)  # the sweep at 15 ms watches the second
        assert watched_at == pytest.approx([0.010, 0.015])
        watch.untrack(answered, late_entry)  # answered while watched: its watcher stops
        client_gone.set()
        await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    assert fast.withdrawn_at is None
    assert answered.withdrawn_at is None
    assert slow.withdrawn_at == pytest.approx(0.016)
