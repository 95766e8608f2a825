"""The LLM engine's own cost per iteration: everything but the model step, in-process.

    python tools/llm_engine_bench.py                      # 64 sequences, 256 tokens each
    python tools/llm_engine_bench.py --sequences 16 --tokens 128 --repeat 5
    python tools/llm_engine_bench.py --load 1 16 64      # tiny_lm streams, in-process

The model's step returns precomputed logits and records the time from leaving one
step to entering the next, over steps that decode every sequence. Two measurements:

- engine: the loop alone (an ``async`` step; the streams read their chunks while it
  yields inside the step, so the gap holds nothing else): scheduling, block
  bookkeeping, building the batch, sampling, detokenizing, stop checks, one chunk per
  sequence sent to its stream, the IterationStats value sent.
- served: the production shape: the step runs in a worker thread (``trio.to_thread``),
  every request is read by its own streaming task and the telemetry task turns each
  IterationStats into vLLM metrics, all inside the gap, with the thread hand-offs.

Prints the median gap in microseconds per iteration, median over ``--repeat`` runs:
wall clock, and for the engine alone also the CPU time the event-loop thread spent in
it (the figure that does not move when other processes share the cores).

``--load`` instead drives the real ``tiny_lm`` (numpy) in-process with that many
concurrent streaming clients for ``--duration`` seconds each (64-token greedy answers
to distinct 32-byte prompts) and prints TTFT and inter-token p50/p99 and tokens/s:
what the engine delivers before any HTTP or gRPC cost.
"""

from __future__ import annotations

import os

# tiny_lm's matrices are small: OpenBLAS threads only fight the event loop for the
# cores (a 64-row matmul took 25x longer with them on a busy 2-core machine).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import statistics
import time
from collections.abc import Sequence

import numpy as np
import trio

from trioserve import GenerativeModel, StepSequence
from trioserve.metrics._llm_telemetry import LLMMetricFamilies
from trioserve.models import TinyLM
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
        self._left: tuple[float, float] | None = None  # (wall, this thread's CPU) clocks
        self.gaps: list[float] = []
        self.cpu_gaps: list[float] = []

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
            self.gaps.append(time.perf_counter() - self._left[0])
            self.cpu_gaps.append(time.thread_time() - self._left[1])
        return self._logits[[b.token_ids[-1] for b in batch]]


class InTrioLM(ConstantLM):
    async def step(self, batch: Sequence[StepSequence]) -> np.ndarray:
        rows = self.entered(batch)
        # Let the streams read their chunks now, outside the measured gap.
        await trio.lowlevel.checkpoint()
        self._left = (time.perf_counter(), time.thread_time())
        return rows


class ThreadedLM(ConstantLM):
    def step(self, batch: Sequence[StepSequence]) -> np.ndarray:
        rows = self.entered(batch)
        self._left = (time.perf_counter(), time.thread_time())
        return rows


async def one_run(
    model: ConstantLM, sampling: SamplingParams, telemetry: bool
) -> tuple[float, float | None]:
    """Median microseconds between two full decode steps: wall clock, and CPU time."""
    metrics = LLMMetricFamilies([model]).telemetry(model, "1") if telemetry else None
    runner = GenerativeRunner(model, "1", metrics)
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
    # In a worker thread the CPU clock is that thread's: only the wall gap means anything.
    cpu = statistics.median(model.cpu_gaps) * 1e6 if isinstance(model, InTrioLM) else None
    return statistics.median(model.gaps) * 1e6, cpu


async def load_run(
    concurrency: int,
    duration: float,
    max_tokens: int,
    model: GenerativeModel | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict[str, float]:
    """Streaming clients on ``model`` (tiny_lm by default), which the runner loads;
    greedy unless ``temperature`` says otherwise."""
    model = model or TinyLM()
    runner = GenerativeRunner(model, "1", LLMMetricFamilies([model]).telemetry(model, "1"))
    ttft: list[float] = []
    itl: list[float] = []
    generated = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=True
        )
        warmup = GenerationRequest("warmup", "warm up", sampling, trio.current_time())
        async with runner.generate(warmup) as chunks:
            async for _ in chunks:
                pass
        started = trio.current_time()
        deadline = started + duration

        async def client(c: int) -> None:
            nonlocal generated
            n = 0
            while trio.current_time() < deadline:
                arrival = trio.current_time()
                prompt = f"client {c:03d} request {n:06d} abcdefghij"[:32]
                request = GenerationRequest(f"{c}-{n}", prompt, sampling, arrival)
                last = arrival
                async with runner.generate(request) as chunks:
                    async for chunk in chunks:
                        now = trio.current_time()
                        (itl if chunk.token_ids and last != arrival else ttft).append(now - last)
                        last = now
                        generated += len(chunk.token_ids)
                n += 1

        async with trio.open_nursery() as clients:
            for c in range(concurrency):
                clients.start_soon(client, c)
        elapsed = trio.current_time() - started
        nursery.cancel_scope.cancel()
    return {
        "ttft_p50": float(np.percentile(ttft, 50)) * 1e3,
        "ttft_p99": float(np.percentile(ttft, 99)) * 1e3,
        "itl_p50": float(np.percentile(itl, 50)) * 1e3,
        "itl_p99": float(np.percentile(itl, 99)) * 1e3,
        "tokens_per_s": generated / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--load", type=int, nargs="+", metavar="STREAMS")
    parser.add_argument("--duration", type=float, default=10.0)
    args = parser.parse_args()
    if args.load:
        print(f"tiny_lm in-process, greedy, 64 tokens per answer, {args.duration:.0f} s each")
        for concurrency in args.load:
            r = trio.run(load_run, concurrency, args.duration, 64)
            print(
                f"  {concurrency:3d} streams: TTFT p50 {r['ttft_p50']:7.1f} ms "
                f"p99 {r['ttft_p99']:7.1f} ms, inter-token p50 {r['itl_p50']:6.1f} ms "
                f"p99 {r['itl_p99']:6.1f} ms, {r['tokens_per_s']:7.0f} tokens/s"
            )
        return
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
        wall = statistics.median(w for w, _ in runs)
        cpus = [c for _, c in runs if c is not None]
        cpu = f", CPU {statistics.median(cpus):6.0f} us" if cpus else ""
        print(f"  {label:24s} wall {wall:6.0f} us{cpu} per iteration")


if __name__ == "__main__":
    main()
