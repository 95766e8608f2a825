"""A generative model whose every step costs exactly ``STEP`` s of the clock: its next
token is the byte after the last one ("a" -> "bcd..."), and "z" is followed by
end-of-sequence, so every output and every time under a mock clock is known exactly."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import trio

from trioserve import GenerativeModel, InferenceRequest, InputTensor, StepSequence
from trioserve._tensor import datatype
from trioserve.scheduler import GenerationRequest, SamplingParams
from trioserve.scheduler._generative_runner import GenerativeRunner

STEP = 0.012  # seconds per model step, whatever the batch (off every bucket boundary)
EOS = 256


class CountingLM(GenerativeModel):
    def __init__(self, **settings):
        settings.setdefault("max_model_len", 64)
        settings.setdefault("num_kv_blocks", 64)
        super().__init__("counting", eos_token_id=EOS, **settings)
        self.steps: list[list[tuple[int, int]]] = []  # (start, tokens) per entry, per step

    async def encode(self, text):  # in trio: exact times under the mock clock
        return list(text.encode())

    def decode(self, token_ids):
        return bytes(t for t in token_ids if t < EOS).decode(errors="replace")

    async def step(self, batch: Sequence[StepSequence]):
        self.steps.append([(b.start, len(b.token_ids)) for b in batch])
        await trio.sleep(STEP)
        logits = np.zeros((len(batch), EOS + 1), np.float32)
        for row, b in enumerate(batch):
            last = b.token_ids[-1]
            logits[row, EOS if last == ord("z") else (last + 1) % EOS] = 1.0
        return logits


class StepKindsLM(CountingLM):
    """Notes what each step gave: "logits" from ``step``, and the kind a subclass's
    device step (``step_greedy``, ``step_sample``) names through ``counted``."""

    def __init__(self, **settings):
        super().__init__(**settings)
        self.kinds: list[str] = []  # per step

    async def step(self, batch: Sequence[StepSequence]):
        return await self.counted("logits", batch)

    async def counted(self, kind: str, batch: Sequence[StepSequence]):
        """The counting logits of ``batch``, its step noted as ``kind``."""
        self.kinds.append(kind)
        return await CountingLM.step(self, batch)


def failures(runner: GenerativeRunner) -> tuple[dict[str, int], tuple[int, int]]:
    """The runner's failures by reason (those that happened), and (fail count, fail ns)."""
    stats = runner.inference_statistics()
    reasons = {reason.value: n for reason, n in stats.failures.items() if n}
    return reasons, (stats.fail.count, stats.fail.ns)


async def generated(runner: GenerativeRunner, prompt: str, **sampling) -> str:
    """What ``runner`` generates for ``prompt``, one sample's text."""
    request = GenerationRequest(
        f"r{prompt}", prompt, SamplingParams(**sampling), trio.current_time()
    )
    async with runner.generate(request) as stream:
        return "".join([c.text async for c in stream])


def oip_request(prompt: bytes, **parameters):
    """An OIP inference request of ``counting`` for ``prompt``."""
    tensor = InputTensor("text_input", datatype("BYTES"), (1,), np.array([prompt], dtype=object))
    return InferenceRequest("counting", "", {"text_input": tensor}, parameters=parameters)
