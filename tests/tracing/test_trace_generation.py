"""A generation's trace under the mock clock: the engine's times (arrival, queue,
first scheduled, last token) in Triton's trace file, one request waiting for another."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from trioserve import GenerativeModel, InferenceServerError, ServerConfig, StepSequence
from trioserve._server import open_server
from trioserve.tracing import TraceConfig

STEP = 0.012  # seconds per model step
EOS = 256
MS = 1_000_000


class NextByteLM(GenerativeModel):
    """Answers the byte after the last one; a step takes 12 ms, one sequence at a time."""

    def __init__(self) -> None:
        super().__init__(
            "next_byte",
            eos_token_id=EOS,
            max_model_len=64,
            num_kv_blocks=64,
            max_num_seqs=1,
            max_num_batched_tokens=64,
        )

    async def encode(self, text: str) -> list[int]:  # in trio: exact times
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < EOS).decode(errors="replace")

    async def step(self, batch: Sequence[StepSequence]) -> np.ndarray[Any, Any]:
        await trio.sleep(STEP)
        logits = np.zeros((len(batch), EOS + 1), np.float32)
        for row, entry in enumerate(batch):
            logits[row, (entry.token_ids[-1] + 1) % EOS] = 1.0
        return logits


async def test_two_generations_one_waiting(autojump_clock: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    config = traced(NextByteLM(), path)
    texts: dict[str, str] = {}
    async with open_server(config) as server:
        start = trio.current_time()

        async def generate(prompt: str) -> None:
            pieces = server.generate("next_byte", prompt, max_tokens=3, temperature=0.0)
            texts[prompt] = "".join([piece async for piece in pieces])

        async with trio.open_nursery() as clients:
            clients.start_soon(generate, "ab")
            await trio.sleep(0.001)
            clients.start_soon(generate, "xy")  # waits: one sequence at a time
    assert texts == {"ab": "cde", "xy": "z{|"}
    records = json.loads(path.read_text())
    meta = {r["id"]: r for r in records if "model_name" in r}
    stamps = {
        meta[r["id"]]["request_id"]: [
            (t["name"], t["ns"] / MS - start * 1e3) for t in r["timestamps"]
        ]
        for r in records
        if "timestamps" in r
    }
    first, second = sorted(stamps, key=lambda request_id: stamps[request_id][0][1])
    # Three steps of 12 ms each: the prompt's, which gives the first token, and two more.
    assert [(n, round(t, 6)) for n, t in stamps[first]] == [
        ("REQUEST_START", 0.0),
        ("QUEUE_START", 0.0),
        ("COMPUTE_START", 0.0),
        ("COMPUTE_END", 36.0),
        ("REQUEST_END", 36.0),
    ]
    assert [(n, round(t, 6)) for n, t in stamps[second]] == [
        ("REQUEST_START", 1.0),
        ("QUEUE_START", 1.0),
        ("COMPUTE_START", 36.0),
        ("COMPUTE_END", 72.0),
        ("REQUEST_END", 72.0),
    ]
    assert {m["model_name"] for m in meta.values()} == {"next_byte"}


def traced(lm: GenerativeModel, path: Path) -> ServerConfig:
    """An in-process server of ``lm`` that traces every request's timestamps to ``path``."""
    return ServerConfig(
        models=[lm],
        http_port=None,
        grpc_port=None,
        trace=TraceConfig(level=("TIMESTAMPS",), rate=1, file=str(path)),
    )


def only_trace_ms(path: Path, start: float) -> list[tuple[str, float]]:
    """The file's one trace's timestamps, in ms from ``start`` (trio's clock, s)."""
    records = json.loads(path.read_text())
    (stamps,) = [r["timestamps"] for r in records if "timestamps" in r]
    return [(t["name"], round(t["ns"] / MS - start * 1e3, 6)) for t in stamps]


class FailingLM(NextByteLM):
    """NextByteLM whose second step fails."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    async def step(self, batch: Sequence[StepSequence]) -> np.ndarray[Any, Any]:
        self.steps += 1
        if self.steps == 2:
            await trio.sleep(STEP)
            raise RuntimeError("the device fell over")
        return await super().step(batch)


async def test_a_failed_generation_is_traced(autojump_clock: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    config = traced(FailingLM(), path)
    async with open_server(config) as server:
        start = trio.current_time()
        pieces = server.generate("next_byte", "ab", max_tokens=3, temperature=0.0)
        with pytest.raises(InferenceServerError, match="the device fell over"):
            async for _ in pieces:
                pass
    assert only_trace_ms(path, start) == [
        ("REQUEST_START", 0.0),
        ("QUEUE_START", 0.0),
        ("COMPUTE_START", 0.0),
        ("COMPUTE_END", 12.0),  # its one token
        ("REQUEST_END", 24.0),  # the failed step
    ]


async def test_an_inference_of_a_generative_model_has_the_engines_times(
    autojump_clock: Any, tmp_path: Path
) -> None:
    """OIP inference of a generative model (its text collected into one response): the
    pipeline's trace, stamped with the engine's times, ended when the answer is out."""
    path = tmp_path / "trace.json"
    config = traced(NextByteLM(), path)
    async with open_server(config) as server:
        start = trio.current_time()
        prompt = np.array([b"ab"], dtype=object)
        response = await server.infer(
            "next_byte", {"text_input": prompt}, parameters={"max_tokens": 2, "temperature": 0}
        )
        assert response.outputs[0].data.tolist() == [b"cd"]
    assert only_trace_ms(path, start) == [
        ("REQUEST_START", 0.0),
        ("QUEUE_START", 0.0),
        ("COMPUTE_START", 0.0),
        ("COMPUTE_END", 24.0),
        ("REQUEST_END", 24.0),
    ]
