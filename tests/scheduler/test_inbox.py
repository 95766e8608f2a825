import math

import pytest
import trio
import trio.testing

from trioserve.scheduler._inbox import Inbox


async def test_take_returns_the_backlog_in_order_without_waiting() -> None:
    inbox = Inbox[int]()
    for i in range(3):
        inbox.put(i)
    assert len(inbox) == 3
    assert await inbox.take() == [0, 1, 2]
    assert len(inbox) == 0


async def test_take_waits_for_the_first_put(autojump_clock: trio.testing.MockClock) -> None:
    inbox = Inbox[str]()
    taken: list[tuple[float, list[str]]] = []

    async def consume() -> None:
        items = await inbox.take()
        taken.append((trio.current_time(), items))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.sleep(2)
        assert taken == []
        inbox.put("a")
        inbox.put("b")
    assert taken == [(2.0, ["a", "b"])]


async def test_take_gives_up_at_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    inbox = Inbox[int]()
    assert await inbox.take(trio.current_time() + 1.5) == []
    assert trio.current_time() == 1.5
    inbox.put(7)  # nobody waits any more: nothing to wake, the item is kept
    assert await inbox.take(math.inf) == [7]


async def test_a_cancelled_take_leaves_the_inbox_usable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    inbox = Inbox[int]()
    with trio.move_on_after(1):
        await inbox.take()
    inbox.put(1)
    assert await inbox.take() == [1]


async def test_one_consumer_only() -> None:
    inbox = Inbox[int]()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inbox.take)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RuntimeError, match="one consuming task"):
            await inbox.take()
        inbox.put(0)


async def test_sleeping_means_waiting_with_no_deadline_and_quiet_puts_wake_no_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``sleeping`` is true only while the consumer waits with no deadline; an item put
    quietly stays for ``take_nowait`` (or the consumer's next take) and wakes no one."""
    inbox = Inbox[int]()
    taken: list[list[int]] = []

    async def consume(deadline: float) -> None:
        taken.append(await inbox.take(deadline))

    assert not inbox.sleeping
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, trio.current_time() + 1)
        await trio.testing.wait_all_tasks_blocked()
        assert not inbox.sleeping  # a deadline: it wakes by itself
    assert taken == [[]]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, math.inf)
        await trio.testing.wait_all_tasks_blocked()
        assert inbox.sleeping
        inbox.put_quietly(1)
        await trio.sleep(5)
        assert inbox.sleeping and taken == [[]]
        assert inbox.take_nowait() == [1] and inbox.take_nowait() == []
        inbox.put(2)
    assert taken == [[], [2]] and not inbox.sleeping
