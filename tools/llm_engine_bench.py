"""The LLM engine's own cost per iteration: everything but the model step, in-process.

    python tools/llm_engine_bench.py                      # 64 sequences, 256 tokens each
    python tools/llm_engine_bench.py --sequences 16 --tokens 128 --repeat 5

The model's step returns precomputed logits and records the time from leaving one
step to entering the next, over steps that decode every sequence. Two measurements:

- engine: the loop alone (an ``async`` step; the streams read their chunks while it
  yields inside the step, so the gap holds nothing else): scheduling, block
  bookkeeping, building the batch, sampling, detokenizing, stop checks, one chunk per
  sequence sent to its stream, the IterationStats value sent.
- served: the production shape: the step runs in a worker thread (``trio.to_thread``),
  every request is read by its own streaming task and the telemetry task turns each
  IterationStats into vLLM metrics, all inside the gap, with the thread hand-offs.

Prints the median gap (microseconds per iteration), median over ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import numpy as np
import trio

from trioserve import GenerativeModel, StepSequence
from trioserve.metrics._stat_logger import VllmTelemetry
from trioserve.scheduler._generation import GenerationRequest, SamplingParams
from trioserve.scheduler._generative_runner import GenerativeRunner

VOCAB = 257


class ConstantLM(GenerativeModel):
    """Byte tokens; every step predicts the letter after the input's last byte.

    It records the time between leaving one step and entering the next (the engine's
    share of an iteration), for steps that carry every sequence as one decode token.
    """

    def __init__(self, sequences: int, tokens: int) -> None:
        super().__init__(
            "bench",
            eos_token_id=256,
            max_model_len=64 + tokens + 1,
            num_kv_blocks=sequences * ((64 + tokens) // 16 + 2),
            max_num_seqs=sequences,
            max_num_batched_tokens=max(2048, sequences),
        )
        self.sequences = sequences
        self._logits = np.zeros((VOCAB, VOCAB), np.float32)
        self._logits[np.arange(VOCAB), 97 + (np.arange(VOCAB) + 1) % 26] = 1.0
        self._left: float | None = None
        self.gaps: list[float] = []

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        try:
            return bytes(token_ids).decode(errors="replace")
        except ValueError:  # a sampled EOS among them
            return bytes(t for t in token_ids if t < 256).decode(errors="replace")

    def entered(self, batch: Sequence[StepSequence]) -> np.ndarray:
        full = len(batch) == self.sequences and all(len(b.token_ids) == 1 for b in batch)
        if full and self._left is not None:
            self.gaps.append(time.perf_counter() - self._left)
        return self._logits[[b.token_ids[-1] for b in batch]]


class InTrioLM(ConstantLM):
    async def step(self, batch: Sequence[StepSequence]) -> np.ndarray:
        rows = self.entered(batch)
        # Let the streams read their chunks now, outside the measured gap.
        await trio.lowlevel.checkpoint()
        self._left = time.perf_counter()
        return rows


class ThreadedLM(ConstantLM):
    def step(self, batch: Sequence[StepSequence]) -> np.ndarray:
        rows = self.entered(batch)
        self._left = time.perf_counter()
        return rows


async def one_run(model: ConstantLM, sampling: SamplingParams, telemetry: bool) -> float:
    """Median microseconds between two full decode steps."""
    runner = GenerativeRunner(model, "1", VllmTelemetry(model, "1") if telemetry else None)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)

        async def stream(i: int) -> None:
            request = GenerationRequest(
                f"r{i}", f"prompt {i:03d} " * 4, sampling, trio.current_time()
            )
            async with runner.generate(request) as chunks:
                async for _ in chunks:
                    pass

        async with trio.open_nursery() as clients:
            for i in range(model.sequences):
                clients.start_soon(stream, i)
        nursery.cancel_scope.cancel()
    return statistics.median(model.gaps) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    modes = [
        (
            "engine, greedy",
            InTrioLM,
            SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True),
            False,
        ),
        (
            "engine, temperature 0.8",
            InTrioLM,
            SamplingParams(max_tokens=args.tokens, temperature=0.8, ignore_eos=True),
            False,
        ),
        (
            "engine, top-p 0.9",
            InTrioLM,
            SamplingParams(max_tokens=args.tokens, temperature=0.8, top_p=0.9, ignore_eos=True),
            False,
        ),
        (
            "served, greedy",
            ThreadedLM,
            SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True),
            True,
        ),
    ]
    print(
        f"{args.sequences} running sequences, {args.tokens} tokens each, "
        f"median of {args.repeat} runs"
    )
    for label, kind, sampling, telemetry in modes:
        runs = [
            trio.run(one_run, kind(args.sequences, args.tokens), sampling, telemetry)
            for _ in range(args.repeat)
        ]
        print(f"  {label:24s} {statistics.median(runs):8.0f} us per iteration")


if __name__ == "__main__":
    main()
