"""The core's end of a worker's link, spoken to in process by a test playing the worker
(real socket pair, real frames): forwarded inferences and their withdrawal."""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio

import trioserve
from trioserve import MetricsConfig, Model, TensorSpec
from trioserve._server import Server
from trioserve.ipc import Block, TrioChannel, channel_pair
from trioserve.metrics import exposition, rendered
from trioserve.models import reference_zoo
from trioserve.testing import (
    FailureReason,
    GatedModel,
    TimedLM,
    gated,
    model_statistics,
    open_test_server,
)
from trioserve.workers._core_link import WorkerLink
from trioserve.workers._wire import (
    ANSWER,
    CANCEL,
    FREE,
    HTTP,
    INFER,
    OUTCOME,
    SCRAPE,
    START,
    Outbound,
    new_arena,
)

from ._link_worker import Worker
from ._link_worker import delay_infer as _infer


def _value(outcome: tuple[Any, ...]) -> float:
    """An answered inference's OUTPUT0."""
    assert outcome[0] == OUTCOME and outcome[1] is None
    (_, _, _, data, _), *_ = outcome[6]
    return float(np.frombuffer(data, np.float32)[0])


class Keeper:
    """A model that keeps every INPUT0 it is given, beyond its request."""

    def __init__(self) -> None:
        self.kept: list[np.ndarray[Any, Any]] = []

    def model(self) -> Model:
        @trioserve.model(
            name="keeper",
            inputs=[TensorSpec("INPUT0", "FP32", [-1])],
            outputs=[TensorSpec("OUTPUT0", "FP32", [1])],
        )
        def keeper(INPUT0: np.ndarray[Any, Any]) -> dict[str, Any]:
            self.kept.append(INPUT0[1:])  # a view of the input, as a model may keep
            return {"OUTPUT0": INPUT0[:1]}

        return keeper


@pytest.fixture
def gate() -> GatedModel:
    """The zoo's ``delay`` (its output is its input), its executions held at a gate."""
    return gated(next(model for model in reference_zoo() if model.name == "delay"))


@pytest.fixture
def keeper() -> Keeper:
    return Keeper()


@pytest.fixture
def on_device() -> Model:
    """A model whose outputs are written off the loop, as a GPU model's (copied to the
    host in a worker thread); here they are numpy already."""

    @trioserve.model(
        name="on_device",
        inputs=[TensorSpec("INPUT0", "FP32", [1])],
        outputs=[TensorSpec("OUTPUT0", "FP32", [1])],
        max_batch_size=8,
        device="gpu",
    )
    def on_device(INPUT0: np.ndarray[Any, Any]) -> dict[str, Any]:
        return {"OUTPUT0": INPUT0 * 2}

    return on_device


@pytest.fixture
async def server(gate: GatedModel, keeper: Keeper, on_device: Model) -> AsyncIterator[Server]:
    async with open_test_server([gate, keeper.model(), on_device, TimedLM()]) as server:
        yield server


async def _queued(server: Server, count: int) -> None:
    await server.repository.get("delay").wait_until(lambda stats: stats.queued == count)  # type: ignore[attr-defined]


async def test_a_cancel_withdraws_a_queued_inference(
    autojump_clock: trio.abc.Clock,
    server: Server,
    gate: GatedModel,
    worker: Worker,
) -> None:
    await worker.infer(-1, 1.0)
    await gate.entered.wait()  # the one instance is busy until release
    await worker.infer(-2, 2.0)
    await _queued(server, 1)
    await worker.channel.send((CANCEL, -2))
    await _queued(server, 0)  # withdrawn
    gate.release.set()
    assert await worker.answers() == [(-1, 1.0)]
    await worker.infer(-3, 3.0)
    assert await worker.answers() == [(-3, 3.0)]  # the withdrawn one is never answered
    assert model_statistics(server, "delay").inference_count == 2  # and never ran


async def test_a_cancel_that_overtakes_its_inference_withdraws_it_on_submission(
    autojump_clock: trio.abc.Clock,
    server: Server,
    gate: GatedModel,
    worker: Worker,
) -> None:
    gate.release.set()
    # Read together: the CANCEL is handled before the call's task runs.
    await worker.send_together(_infer(-1, 1.0), (CANCEL, -1))
    await worker.infer(-2, 2.0)
    assert await worker.answers() == [(-2, 2.0)]
    assert model_statistics(server, "delay").inference_count == 1


async def test_an_input_a_model_keeps_is_not_reused_until_it_lets_go(
    autojump_clock: trio.abc.Clock, keeper: Keeper, worker: Worker
) -> None:
    """A large input reads the worker's block in place; the block goes back to the worker
    (FREE) only once the model drops the last array that reads it."""
    out = Outbound(worker.channel, new_arena())
    worker.arenas.append(out.arena)
    sent = np.arange(32 * 1024, dtype=np.float32)  # 128 KiB: a block, not in the frame
    block = out.pack(sent.tobytes())
    assert isinstance(block, Block)
    inputs = [("INPUT0", "FP32", sent.shape, block, {})]
    await out.send(
        (INFER, -1, "HTTP end point", "keeper", "", "", {}, inputs, [], None, None), block
    )
    frames = [message for message, _ in await worker.channel.receive()]
    assert [message[0] for message in frames] == [ANSWER]  # answered, the block still read
    np.testing.assert_array_equal(keeper.kept[0], sent[1:])
    keeper.kept.clear()
    frames = [message for message, _ in await worker.channel.receive()]
    assert frames == [(FREE, [block])]


async def test_the_answers_of_one_batch_go_in_one_frame(
    autojump_clock: trio.abc.Clock, server: Server, gate: GatedModel, worker: Worker
) -> None:
    await worker.infer(-1, 1.0)
    await gate.entered.wait()  # the one instance is busy until release
    await worker.send_together(_infer(-2, 2.0), _infer(-3, 3.0))
    await _queued(server, 2)
    gate.release.set()  # -1 runs, then -2 and -3 in one batch
    frames: list[list[int]] = []  # each ANSWER frame's calls
    while sum(map(len, frames)) < 3:
        for message, _ in await worker.channel.receive():
            assert message[0] == ANSWER
            frames.append([call for call, _, _ in message[1]])
    assert [set(calls) for calls in frames] == [{-1}, {-2, -3}]


class _Steps(trio.abc.Instrument):
    """Counts the steps of the tasks whose name ends with ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.name):
            self.steps += 1


async def test_a_batch_is_answered_as_it_ends_not_a_turn_later(
    autojump_clock: trio.abc.Clock, gate: GatedModel, worker: Worker
) -> None:
    """The ANSWER of a batch's inferences is written in the turn the batch ends (from its
    runner, ``Ticket.after_batch``), not by the link's answering task a turn later: under
    load that is a turn of the core's event loop per frame."""
    gate.release.set()
    await worker.infer(-1, 1.0)
    assert await worker.answers() == [(-1, 1.0)]  # (the answering task waits by now)
    steps = _Steps("LinkInferences.run")
    trio.lowlevel.add_instrument(steps)
    try:
        await worker.send_together(_infer(-2, 2.0), _infer(-3, 3.0))
        answers = await worker.answers()
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert sorted(answers) == [(-3, 3.0), (-2, 2.0)]
    assert steps.steps == 0


async def test_the_input_blocks_of_refused_inferences_go_back_once(
    autojump_clock: trio.abc.Clock, gate: GatedModel, worker: Worker
) -> None:
    """An inference refused before its inputs are read gives its block back at once; one
    refused after (its array read the block in place) as that array goes: each once."""
    gate.release.set()
    out = Outbound(worker.channel, new_arena())
    worker.arenas.append(out.arena)
    data = np.zeros(32 * 1024, np.float32).tobytes()  # 128 KiB: a block each
    unread, read = out.pack(data), out.pack(data)
    for call, model, block in ((-1, "no_such_model", unread), (-2, "delay", read)):
        inputs = [("INPUT0", "FP32", (1, 32 * 1024), block, {})]  # delay takes [1] items
        message = (INFER, call, "HTTP end point", model, "", "", {}, inputs, [], None, None)
        await out.send(message, block)
    failures: list[str] = []
    freed: list[Block] = []
    while len(failures) < 2:
        for message, _ in await worker.channel.receive():
            if message[0] == FREE:
                freed += message[1]
            else:
                failures += [item[1][0] for _, item, _ in message[1]]
    assert sorted(failures) == ["INVALID_ARG", "NOT_FOUND"]
    gc.collect()  # whatever still holds the refused request's array
    await worker.infer(-3, 3.0)
    answered = False
    while not answered:  # the FREEs due come before this answer
        for message, _ in await worker.channel.receive():
            if message[0] == FREE:
                freed += message[1]
            else:
                answered = True
    assert sorted(freed) == sorted([unread, read])


def _tasks() -> int:
    return trio.lowlevel.current_statistics().tasks_living


async def test_a_frame_of_inferences_is_submitted_and_answered_in_one_pass(
    autojump_clock: trio.abc.Clock, server: Server, gate: GatedModel, worker: Worker
) -> None:
    """The inferences of one frame are queued as it is read, with no task each, and
    those that finish together are answered together."""
    await worker.infer(-1, 1.0)
    await gate.entered.wait()  # the one instance is busy until release
    tasks = _tasks()
    await worker.send_together(_infer(-2, 2.0), _infer(-3, 3.0), _infer(-4, 4.0))
    await _queued(server, 3)
    assert _tasks() == tasks
    gate.release.set()  # -1 runs, then the three in one batch
    frames = await worker.outcomes()
    while sum(map(len, frames)) < 4:
        frames += await worker.outcomes()
    assert [{call: _value(outcome) for call, outcome in frame.items()} for frame in frames] == [
        {-1: 1.0},
        {-2: 2.0, -3: 3.0, -4: 4.0},
    ]


async def test_a_cancel_withdraws_only_its_own_inference_of_a_frame(
    autojump_clock: trio.abc.Clock, server: Server, gate: GatedModel, worker: Worker
) -> None:
    await worker.infer(-1, 1.0)
    await gate.entered.wait()
    await worker.send_together(_infer(-2, 2.0), _infer(-3, 3.0), _infer(-4, 4.0), (CANCEL, -3))
    await _queued(server, 2)
    gate.release.set()
    answered: list[tuple[int, float]] = []
    while len(answered) < 3:
        answered += await worker.answers()
    assert sorted(answered) == [(-4, 4.0), (-2, 2.0), (-1, 1.0)]
    statistics = model_statistics(server, "delay")
    assert statistics.inference_count == 3
    assert statistics.failures[FailureReason.CANCELED] == 1


async def test_a_failing_inference_does_not_fail_the_others_of_its_frame(
    autojump_clock: trio.abc.Clock, server: Server, gate: GatedModel, worker: Worker
) -> None:
    gate.release.set()
    await worker.send_together(
        _infer(-1, 1.0),
        _infer(-2, 2.0, model="no_such_model"),  # refused as it is submitted
        _infer(-3, 3.0, width=2),  # the model takes one value per item
        _infer(-4, 4.0),
    )
    outcomes: dict[int, tuple[Any, ...]] = {}
    while len(outcomes) < 4:
        for frame in await worker.outcomes():
            outcomes.update(frame)
    assert _value(outcomes[-1]) == 1.0 and _value(outcomes[-4]) == 4.0
    assert outcomes[-2][:2] == (
        OUTCOME,
        ("NOT_FOUND", "Request for unknown model: 'no_such_model' is not found"),
    )
    assert outcomes[-3][1][0] == "INVALID_ARG"
    assert outcomes[-3][1][1].startswith("unexpected shape for input 'INPUT0'")
    assert model_statistics(server, "delay").inference_count == 2


async def test_the_inferences_of_a_worker_that_leaves_are_withdrawn(
    autojump_clock: trio.abc.Clock, server: Server, gate: GatedModel, worker: Worker
) -> None:
    await worker.infer(-1, 1.0)
    await gate.entered.wait()
    await worker.send_together(_infer(-2, 2.0), _infer(-3, 3.0))
    await _queued(server, 2)
    worker.channel.close()
    await _queued(server, 0)
    gate.release.set()
    await server.repository.get("delay").wait_until(lambda stats: not stats.executing)  # type: ignore[attr-defined]
    statistics = model_statistics(server, "delay")
    assert statistics.failures[FailureReason.CANCELED] == 3  # the one executing too
    assert statistics.inference_count == 0  # none answered


async def test_inferences_whose_outputs_are_written_off_the_loop_are_answered(
    autojump_clock: trio.abc.Clock, worker: Worker
) -> None:
    await worker.send_together(
        _infer(-1, 1.0, model="on_device"),
        _infer(-2, 2.0, model="on_device", width=2),  # refused: one value per item
        _infer(-3, 3.0, model="on_device"),
    )
    outcomes: dict[int, tuple[Any, ...]] = {}
    while len(outcomes) < 3:
        for frame in await worker.outcomes():
            outcomes.update(frame)
    assert _value(outcomes[-1]) == 2.0 and _value(outcomes[-3]) == 6.0
    assert outcomes[-2][1][0] == "INVALID_ARG"


def _generate(call: int, prompt: bytes) -> tuple[Any, ...]:
    """An OIP inference of the generative fake (its text continues the prompt's bytes)."""
    inputs = [("text_input", "BYTES", (1,), len(prompt).to_bytes(4, "little") + prompt, {})]
    parameters = {"max_tokens": 3}
    return (INFER, call, "HTTP end point", "timed_lm", "", "", parameters, inputs, [], None, None)


async def test_a_generative_models_inferences_are_answered_or_withdrawn(
    autojump_clock: trio.abc.Clock, worker: Worker
) -> None:
    await worker.send_together(_generate(-1, b"hello"), _generate(-2, b"hello"), (CANCEL, -2))
    frames = await worker.outcomes()
    assert [list(frame) for frame in frames] == [[-1]]  # the withdrawn one is not answered
    ((name, datatype, shape, data, _),) = frames[0][-1][6]
    assert (name, datatype, shape) == ("text_output", "BYTES", (1,))
    assert data == (3).to_bytes(4, "little") + b"pqr"


async def test_the_core_leaves_compression_to_the_worker(worker: Worker) -> None:
    """A forwarded HTTP call's response comes back uncompressed whatever its client
    accepts (the worker compresses it), marked compressible where one process would have
    compressed it."""
    headers = [(b"accept-encoding", b"gzip"), (b"content-type", b"application/json")]
    tensor = {"name": "INPUT0", "datatype": "FP32", "shape": [2], "data": [5, 6]}
    body = json.dumps({"inputs": [tensor]}).encode()
    await worker.channel.send((HTTP, 1, "POST", "/v2/models/keeper/infer", b"", headers, body))
    await worker.channel.send((HTTP, 2, "GET", "/v2/models/keeper", b"", headers, b""))
    starts = {}
    while len(starts) < 2:
        for message, _ in await worker.channel.receive():
            assert message[0] == ANSWER
            for call, item, last in message[1]:
                assert item[0] == START and last
                starts[call] = item
    _, status, answer_headers, compressible, data, more = starts[1]
    assert (status, compressible, more) == (200, True, False)  # an inference's answer
    assert json.loads(data)["outputs"][0]["data"] == [5.0]
    assert b"content-encoding" not in dict(answer_headers)
    assert dict(answer_headers)[b"content-length"] == str(len(data)).encode()
    _, status, answer_headers, compressible, data, more = starts[2]
    assert (status, compressible, more) == (200, False, False)  # metadata: never compressed
    assert json.loads(data)["name"] == "keeper"


async def test_a_scrape_gets_the_families_for_the_worker_to_render(
    server: Server, worker: Worker
) -> None:
    await worker.send_together((SCRAPE, -2))
    scraped = None
    while scraped is None:
        for message, _ in await worker.channel.receive():
            assert message[0] == ANSWER
            for call, item, last in message[1]:
                if call == -2:
                    assert item[0] == SCRAPE and last
                    scraped = item[1]
    names = {family.name for family in scraped}
    assert {"nv_inference_count", "nv_inference_request_success"} <= names
    assert server.context is not None and server.context.registry is not None
    # Rendered in the worker, the families read as the core's own exposition.
    families = _family_lines(rendered(scraped))
    assert families == _family_lines(exposition(server.context.registry))
    assert "# TYPE nv_inference_count counter" in families


def _family_lines(text: bytes) -> list[str]:
    """The HELP and TYPE lines of an exposition, in order."""
    return [line for line in text.decode().splitlines() if line.startswith("#")]


async def test_a_server_without_metrics_answers_a_scrape_with_none(nursery: trio.Nursery) -> None:
    async with open_test_server(
        list(reference_zoo())[:1], metrics=MetricsConfig(enabled=False)
    ) as server:
        core_end, worker_end = channel_pair()
        assert server.context is not None and server.context.registry is None
        link = WorkerLink(TrioChannel(core_end), server.context, server.rest_app, {})
        nursery.start_soon(link.serve, [])
        worker = TrioChannel(worker_end)
        await worker.send((SCRAPE, -1))
        ((message, _),) = await worker.receive()
        assert message == (ANSWER, [(-1, (SCRAPE, None), True)])
        worker.close()


async def test_a_scrape_whose_client_left_is_not_answered(server: Server, worker: Worker) -> None:
    entered, left = trio.Event(), trio.Event()

    async def held() -> None:  # a source that reports only when asked, taking its time
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            left.set()

    assert server.context is not None
    server.context.metrics_sources.append(held)
    await worker.send_together((SCRAPE, -2))
    await entered.wait()
    await worker.send_together((CANCEL, -2))
    await left.wait()  # the scrape was cancelled in the core
    await worker.channel.send(_infer(-3, 4.0, "on_device"))
    (frame,) = await worker.outcomes()
    assert list(frame) == [-3]  # and not answered: the worker dropped it


async def test_a_worker_gone_with_answers_unread_ends_its_link_quietly(
    server: Server, gate: GatedModel
) -> None:
    """A worker killed under load leaves frames of the core's unread, so the core finds
    its socket reset rather than closed: its link ends as when any worker leaves, not
    with an error that would end the core."""
    core_end, worker_end = channel_pair()
    assert server.context is not None
    link = WorkerLink(TrioChannel(core_end), server.context, server.rest_app, {})
    worker = Worker(worker_end)
    gate.release.set()
    async with trio.open_nursery() as nursery:  # an error of serve() fails the test here
        nursery.start_soon(link.serve, [])
        await worker.infer(-1, 1.0)
        await trio.lowlevel.wait_readable(worker_end)  # its answer, never to be read
        worker.channel.close()
    assert model_statistics(server, "delay").inference_count == 1
