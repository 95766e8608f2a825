import trio
import trio.testing

from trioserve.scheduler._handoff import Handoff


async def test_items_put_before_any_consumer_wait_in_order() -> None:
    handoff = Handoff[int]()
    handoff.put(1)
    handoff.put(2)
    assert await handoff.get() == 1
    assert await handoff.get() == 2


async def test_a_waiting_consumer_gets_the_item_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handoff = Handoff[str]()
    got: list[tuple[str, float, str]] = []

    async def consume(name: str) -> None:
        item = await handoff.get()
        got.append((name, trio.current_time(), item))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, "first")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(consume, "second")
        await trio.sleep(1)
        handoff.put("a")
        # Handed to the longest waiting consumer: a consumer that arrives now finds
        # nothing queued, so it cannot take the item meant for a woken one.
        nursery.start_soon(consume, "late")
        await trio.sleep(1)
        handoff.put("b")
        await trio.sleep(1)
        handoff.put("c")
    assert got == [("first", 1.0, "a"), ("second", 2.0, "b"), ("late", 3.0, "c")]


async def test_a_cancelled_consumer_is_not_handed_anything(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handoff = Handoff[int]()
    with trio.move_on_after(1):
        await handoff.get()
    handoff.put(5)  # nobody waits: the item is kept, not lost to the cancelled consumer
    assert await handoff.get() == 5


async def test_a_queued_item_survives_a_cancelled_get() -> None:
    handoff = Handoff[int]()
    handoff.put(9)
    with trio.CancelScope() as scope:
        scope.cancel()
        assert await handoff.get() == 9  # taken before the checkpoint, so returned


async def test_waiting_says_whether_a_consumer_is_parked() -> None:
    handoff = Handoff[int]()
    got: list[int] = []

    async def consume() -> None:
        got.append(await handoff.get())

    assert not handoff.waiting
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        assert handoff.waiting
        handoff.put(7)
        assert not handoff.waiting  # handed over: no longer waiting
    assert got == [7]
