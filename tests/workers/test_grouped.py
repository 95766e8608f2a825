"""A worker's alike INFERs merged into one INFERS as its channel writes them, taken
apart again by the core where their model does not coalesce (``_coalesce.py``), and the
core's OUTCOME of several cut into each one's by the worker."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import trio

from trioserve.ipc import TrioChannel
from trioserve.workers._coalesce import each, grouped, outcomes_of_rows
from trioserve.workers._wire import CANCEL, FREE, INFER, INFERS, NO_CALL, OUTCOME


def _infer(call: int, **fields: Any) -> tuple[Any, ...]:
    """An INFER of one row, its own values (``call``'s); ``fields`` replace its parts."""
    first = np.arange(4, dtype=np.int32).reshape(1, 4) + 100 * abs(call)
    inputs = [
        ("INPUT0", "INT32", (1, 4), first.tobytes(), {}),
        ("INPUT1", "INT32", (1, 4), (first * 2).tobytes(), {}),
    ]
    parts = {
        "endpoint": "HTTP end point", "model": "pair", "version": "", "id": f"id{call}",
        "parameters": {}, "inputs": inputs, "outputs": [], "report": None, "trace": None,
    }  # fmt: skip
    parts.update(fields)
    return (INFER, call, *parts.values())


def _frames(*messages: tuple[Any, ...]) -> list[tuple[Any, list[int]]]:
    return [(message, []) for message in messages]


def test_alike_inferences_go_as_one_infers_in_the_place_of_the_first() -> None:
    alike = [_infer(-1), _infer(-2), _infer(-3)]
    frames = _frames(alike[0], (CANCEL, -9), alike[1], (FREE, []), alike[2])
    merged = grouped(frames)
    assert [message[0] for message, _ in merged] == [INFERS, CANCEL, FREE]
    (infers, fds), *_ = merged
    assert fds == ()
    _, calls, endpoint, model, version, ids, parameters, inputs, outputs, report = infers
    assert (calls, ids) == ((-1, -2, -3), ("id-1", "id-2", "id-3"))
    assert (endpoint, model, version, parameters, outputs, report) == (
        "HTTP end point", "pair", "", {}, [], None,
    )  # fmt: skip
    # Each input with one's shape and the rows of all, in order.
    for index, (name, datatype, shape, joined, params) in enumerate(inputs):
        assert (name, datatype, shape, params) == (*alike[0][7][index][:3], {})
        assert joined == b"".join(message[7][index][3] for message in alike)
    # The core takes them apart as they were sent (no trace context: none was merged),
    # each with parameters of its own.
    apart = list(each(infers, 0, 3))
    assert apart == alike
    assert list(each(infers, 1, 2)) == [alike[1]]
    apart[0][6]["priority"] = 2
    apart[0][7][0][4]["kept"] = True
    assert apart[1][6] == {} and apart[1][7][0][4] == {}


def test_inferences_that_differ_or_cannot_be_stacked_go_as_they_are() -> None:
    first_input = ("INPUT0", "INT32", (1, 4), np.zeros(4, np.int32).tobytes(), {})
    apart = [
        _infer(-1),
        _infer(-2, endpoint="ModelInfer RPC"),
        _infer(-3, report=("http", "json")),
        _infer(-4, parameters={"priority": 1}),
        _infer(-5, trace={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}),
        _infer(-6, outputs=[("SUM", {})]),
        _infer(-7, inputs=[first_input, ("INPUT1", "BYTES", (1, 4), b"", {})]),  # of BYTES
        _infer(-8, inputs=[first_input, ("INPUT1", "INT32", (2, 4), b"", {})]),  # rows differ
        _infer(-9, inputs=[]),
        _infer(-10, parameters={"list": [1, 2]}),  # a value that is no key
        _infer(-11, model="other"),
    ]
    frames = _frames(*apart)
    assert grouped(frames) is frames  # none alike: the frames themselves
    # A frame that announces segments (descriptors) is never merged, nor is a block.
    block_input = [("INPUT0", "INT32", (1, 4), object(), {})]
    with_fds = [(_infer(-1), [5]), (_infer(-2), []), (_infer(-3, inputs=block_input), [])]
    assert grouped(with_fds) == with_fds


def test_only_the_alike_are_merged_and_one_alone_stays_an_infer() -> None:
    frames = _frames(_infer(-1), _infer(-2, model="other"), _infer(-3), _infer(-4, version="2"))
    merged = [message for message, _ in grouped(frames)]
    assert [message[0] for message in merged] == [INFERS, INFER, INFER]
    assert merged[0][1] == (-1, -3)
    assert merged[1] == frames[1][0] and merged[2] == frames[3][0]
    single = frames[:1]
    assert grouped(single) is single


def test_an_outcome_of_several_is_cut_into_each_ones_rows_but_a_withdrawn_ones() -> None:
    sums = np.arange(12, dtype=np.int32).reshape(3, 4)
    outcome = (
        OUTCOME, None, "pair", "1", ("a", "b", "c"), {"p": 1},
        [("SUM", "INT32", (1, 4), sums.tobytes(), {}), ("NEG", "INT32", (1, 4), (-sums).tobytes(), {})],
        ("http", "json"),
    )  # fmt: skip
    cut = dict(outcomes_of_rows((-1, NO_CALL, -3), outcome))
    assert sorted(cut) == [-3, -1]  # the withdrawn one is answered to nobody
    for call, index, request_id in ((-1, 0, "a"), (-3, 2, "c")):
        own = cut[call]
        assert own[:6] == (OUTCOME, None, "pair", "1", request_id, {"p": 1})
        assert own[7] == ("http", "json")
        (name, datatype, shape, raw, params), (_, _, _, negative, _) = own[6]
        assert (name, datatype, shape, params) == ("SUM", "INT32", (1, 4), {})
        assert np.frombuffer(raw, np.int32).tolist() == sums[index].tolist()
        assert np.frombuffer(negative, np.int32).tolist() == (-sums[index]).tolist()


async def test_a_channel_merges_the_frames_of_one_write_as_its_owner_says() -> None:
    ours, theirs = socket.socketpair()
    seen: list[int] = []

    def merge(frames: list[Any]) -> list[Any]:
        seen.append(len(frames))
        return grouped(frames)

    channel, peer = TrioChannel(ours, coalesce=True, merge=merge), TrioChannel(theirs)
    try:
        async with trio.open_nursery() as nursery:
            for call in range(1, 5):  # four tasks send in one turn: one write
                nursery.start_soon(channel.send, _infer(-call))
        received = [message for message, _ in await peer.receive()]
        assert seen == [4] and channel.writes == 1
        assert [message[0] for message in received] == [INFERS]
        assert sorted(received[0][1]) == [-4, -3, -2, -1]  # in the order the tasks ran
        await channel.send(_infer(-5))  # a write of one frame: nothing to merge
        assert [message for message, _ in await peer.receive()] == [_infer(-5)]
        assert seen == [4]
    finally:
        channel.close()
        peer.close()
