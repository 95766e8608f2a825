"""The generative-model API users implement; the engine does everything else.

A generative model is a tokenizer and a step function over a paged KV cache::

    class MyLM(trioserve.GenerativeModel):
        def load(self):                    # allocate num_kv_blocks x block_size of K/V
            ...
        def encode(self, text): ...        # str -> token ids
        def decode(self, token_ids): ...   # token ids -> str
        def step(self, batch):             # -> logits, one row per entry of batch
            ...

The engine (``scheduler/``) decides which sequences run in each iteration, which of
their tokens are processed (a chunk of a prompt, or the one token sampled last) and in
which cache blocks they live; ``step`` computes K/V for those tokens, writes them into
the named blocks, attends over everything the block table holds and returns the
logits of the token that follows each sequence's last processed token. Sampling,
stop conditions, streaming and metrics are the engine's.

A plain ``step`` runs in a worker thread (GPU work too: the thread blocks on the
device, the event loop does not); an ``async def step`` runs in trio. So do ``encode``
and ``encode_chat`` on prompts. ``decode`` runs on the event loop, a few tokens at a time.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._model import Model, TensorSpec

Logits = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True)
class StepSequence:
    """One sequence's work in one engine step."""

    token_ids: Sequence[int]  # the tokens to process now: a prompt chunk or one decode token
    start: int  # position of token_ids[0]: how many of this sequence's tokens the cache holds
    # Cache blocks for positions 0 .. start + len(token_ids) - 1, in order; position p
    # lives in block_table[p // block_size] at slot p % block_size.
    block_table: Sequence[int]


@dataclass(frozen=True, slots=True)
class DeviceDraw:
    """One next token a model chooses on its device (``step_sample``): which logits row
    it comes from and how it is drawn. A temperature of 0 (or ``top_k == 1``) is greedy;
    a random draw takes its numbers from the stream ``(seed, stream)`` at ``position``,
    so the same draw gives the same token whatever the rest of the batch."""

    row: int  # the batch entry whose logits it is drawn from (several draws may share one)
    temperature: float
    top_k: int  # 0: every token
    top_p: float
    min_p: float
    seed: int  # 0 .. 2**64 - 1
    stream: int  # which of the seed's streams: the sample's index in its request
    position: int  # the drawn token's position in its sequence
    logprobs: int  # how many of the likeliest tokens' logprobs to return beside the chosen
    # token's; -1: no logprobs
    # vLLM's penalties, over ``seen``: each distinct token id of the sequence (prompt and
    # output), with ``output_counts`` the times each is in the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seen: Sequence[int] | Logits = ()  # a sequence or a numpy array of integers
    output_counts: Sequence[int] | Logits = ()


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """What ``step_sample`` returns: a token per draw and, for the draws that asked,
    log-softmax values of the raw logits (rows of the other draws are not read)."""

    tokens: Logits  # (draws,) integers
    logprobs: Logits | None = None  # (draws,) the chosen tokens'; None when nobody asked
    top_tokens: Logits | None = None  # (draws, n): the likeliest tokens, most likely first
    top_logprobs: Logits | None = None  # (draws, n): theirs


class GenerativeModel(Model):
    """A text-generation model served by the continuous-batching engine.

    The inputs and outputs are fixed: ``text_input`` (BYTES) -> ``text_output`` (BYTES),
    like Triton's vLLM backend. The keyword settings size the engine: ``num_kv_blocks``
    cache blocks of ``block_size`` tokens (``load`` allocates them), at most
    ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens per step, and
    sequences of at most ``max_model_len`` tokens (prompt and output together).

    Optional attributes a model may set for the OpenAI-compatible endpoints:
    ``vocab_size`` (token-id prompts are checked against it, and refused without it),
    ``chat_template`` (a Jinja template in the form of Hugging Face's
    ``tokenizer_config.json``; without one, chat uses a plain documented default) and
    ``special_tokens`` (e.g. ``bos_token``, ``eos_token``: strings the template reads).
    """

    vocab_size: int | None = None
    chat_template: str | None = None
    special_tokens: Mapping[str, str] = {}  # read-only: a model sets its own

    def __init__(
        self,
        name: str,
        *,
        eos_token_id: int,
        max_model_len: int,
        num_kv_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        versions: Sequence[str] = ("1",),
        device: Literal["cpu", "gpu"] = "cpu",
        parameters: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            name=name,
            inputs=[TensorSpec("text_input", "BYTES", [1])],
            outputs=[TensorSpec("text_output", "BYTES", [-1])],
            versions=versions,
            device=device,
            parameters=dict(parameters or {}),
        )
        if min(max_model_len, num_kv_blocks, block_size, max_num_seqs) < 1:
            raise ValueError("engine sizes must be positive")
        if max_model_len > num_kv_blocks * block_size:
            # A sequence must fit the cache on its own, or preemption could never end.
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the KV cache "
                f"({num_kv_blocks} blocks of {block_size} tokens)"
            )
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching

    def encode(self, text: str) -> list[int] | Awaitable[list[int]]:
        """Token ids of ``text``. A plain ``encode`` runs in a worker thread (a slow
        tokenizer holds up its own request only); an ``async def encode`` runs in trio."""
        raise NotImplementedError(f"{type(self).__name__} must implement encode()")

    def encode_chat(self, text: str) -> list[int] | Awaitable[list[int]]:
        """Token ids of a prompt rendered by a chat template, which writes its own special
        tokens (a BOS...): a tokenizer that adds them to every text leaves them out here.
        By default, ``encode``; it runs as ``encode`` does."""
        return self.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; an incomplete multi-byte character decodes as U+FFFD."""
        raise NotImplementedError(f"{type(self).__name__} must implement decode()")

    def step(self, batch: Sequence[StepSequence]) -> Logits | Awaitable[Logits]:
        """Process ``batch``; return logits of shape ``(len(batch), vocab_size)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    @property
    def greedy_on_device(self) -> bool:
        """Whether ``step_greedy`` serves (a model on a GPU says so once loaded)."""
        return False

    def step_greedy(self, batch: Sequence[StepSequence]) -> Logits | Awaitable[Logits]:
        """Process ``batch`` as ``step`` does, but return each entry's argmax token id,
        shape ``(len(batch),)``, instead of its logits. The engine calls it instead of
        ``step`` when ``greedy_on_device`` is true and every sample of the step is greedy
        with no penalty and no logprobs: a model on a GPU then copies back token ids, not
        a vocabulary of logits per sequence. It runs as ``step`` does."""
        raise NotImplementedError(f"{type(self).__name__} must implement step_greedy()")

    @property
    def sampling_on_device(self) -> bool:
        """Whether ``step_sample`` serves (a model on a GPU says so once loaded)."""
        return False

    def step_sample(
        self, batch: Sequence[StepSequence], draws: Sequence[DeviceDraw]
    ) -> SampledTokens | Awaitable[SampledTokens]:
        """Process ``batch`` as ``step`` does, then draw each of ``draws``' tokens on the
        device: only tokens (and the logprobs asked for) come back. The engine calls it
        when ``sampling_on_device`` is true and not every draw of the step is a plain
        greedy one that ``step_greedy`` can serve. It runs as ``step`` does."""
        raise NotImplementedError(f"{type(self).__name__} must implement step_sample()")

    @property
    def steps_async(self) -> bool:
        return inspect.iscoroutinefunction(self.step)
