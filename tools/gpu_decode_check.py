"""The GPU forward on a CUDA device: correctness against the numpy forward and timings.

    PYTHONPATH=src python tools/gpu_decode_check.py [--skip-1b] [--skip-graphs] [--steps 32]

It imports trioserve's model modules without the package's front ends (see
``bare_packages``), so numpy and cupy are all the checks need, but ml_dtypes for the
bfloat16 ones (without it they print their error); the engine section also needs trio,
outcome and sniffio: where the image lacks them, put their wheels on PYTHONPATH
(``PYTHONPATH=src:wheels/trio-...whl:...``: pure-Python wheels import as they are).

Needs cupy and a CUDA device; torch and transformers are used when present (the
same-dtype reference). Prints one JSON object per line, each with a ``section``:

- ``env``: devices and versions;
- ``kernel``: each kernel against its numpy arithmetic (max abs error), float32, float16
  and bfloat16 storage (bfloat16 rounds through ml_dtypes, the ``checkpoints`` extra);
- ``forward``: a small Llama (float32 and bfloat16 storage) and tiny_lm, GPU logits
  against numpy's float32 over a step of prompt chunks, a mixed step and decodes;
- ``greedy``: greedy tokens of a few prompts for ``--steps`` steps, GPU against numpy
  float32 (and against transformers in float16 for the 1 B model), with the gap
  between the top two logits where they first differ;
- ``sampling``: the device sampler against its numpy reference (``reference_draws``)
  on a 32,000-token vocabulary, penalties included (tokens agreeing, logprob error),
  and a chi-square of
  20,000 device draws against the softmax; whether the load check passed;
- ``timing``: decode step medians at batch 1/16/64, tokens or logits copied back, or
  drawn on the device at temperature 0.8 / top-p 0.9 (``sampled_ms``; the kernel alone
  ``sampler_only_ms``); prefill of 64 x 128 tokens; tiny_lm on the GPU and the CPU;
- ``engine``: the 1 B model served by the engine in-process: 1 and 64 concurrent
  streams, greedy, then temperature 0.8 / top-p 0.9 drawn on the device and on the
  host, tokens/s and TTFT;
- then, in a child process, the same with decode CUDA graphs (``graphs``): what was
  captured, the replay against numpy and the eager forward, timings, the engine.

Every section catches its own failure and prints it (``error``, ``traceback``), so one
failure hides nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from gpu_check_common import (  # first: it makes trioserve's model modules importable
    BLOCK,
    CONTEXT,
    ONE_B,
    SEQUENCES,
    SMALL,
    NumpyLlama,
    agreement,
    emit,
    gpu_llama,
    greedy,
    guarded,
    median_ms,
    mixed_batch,
    random_tensors,
    tables,
)
from trioserve._generative import DeviceDraw, GenerativeModel, StepSequence
from trioserve.models._gpu_forward import GpuForward, ServedOnDevice
from trioserve.models._gpu_sampling import reference_draws
from trioserve.models._llama import LlamaConfig, LlamaForward, _rotate
from trioserve.models._paged_attention import PagedAttention, StepLayout
from trioserve.models._storage import BFLOAT16_BITS, to_storage
from trioserve.models._tiny_lm import TinyLM


def check_kernels(cp: Any, dtype: Any) -> None:
    """Each kernel against the numpy arithmetic it replaces."""
    from trioserve.models._cuda_source import ATTENTION_WARPS
    from trioserve.models._gpu_inputs import pack_step, part

    config = LlamaConfig.from_hf(SMALL)
    c = config
    fw = gpu_llama(cp, config, random_tensors(SMALL, 1, np.float32), dtype, num_kv_blocks=64,
                   block_size=BLOCK, max_model_len=256, max_num_seqs=4, graphs=False)  # fmt: skip
    rng = np.random.default_rng(2)
    name = "bfloat16" if dtype == BFLOAT16_BITS else np.dtype(dtype).name
    if dtype == BFLOAT16_BITS:
        import ml_dtypes

        host = ml_dtypes.bfloat16  # what numpy rounds and reads the storage's bits as
    else:
        host = dtype

    def rounded(a: np.ndarray) -> np.ndarray:
        """``a`` rounded to the storage type, as float64."""
        return a.astype(host).astype(np.float64)

    def stored(a: np.ndarray) -> Any:
        return cp.asarray(to_storage(a, dtype))

    def error(gpu: Any, ref: np.ndarray) -> float:
        got = cp.asnumpy(gpu)
        if got.dtype == BFLOAT16_BITS:
            got = got.view(host)
        return float(np.abs(got.astype(np.float64) - ref).max())

    def report(kernel: str, value: float, **extra: Any) -> None:
        emit("kernel", kernel=kernel, dtype=name, max_abs_error=value, **extra)

    rows, h = 5, c.hidden_size
    x = rng.standard_normal((rows, h)).astype(np.float32)
    delta = rng.standard_normal((rows, h)).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    for mode, label in ((0, "add_norm rms"), (1, "add_norm layer")):
        residual, out = stored(x), cp.empty((rows, h), dtype)
        fw.kernels("add_norm", (rows,), 256, residual, stored(delta), np.int32(1),
                   stored(weight), out, np.int32(h), np.float32(1e-5), np.int32(mode))  # fmt: skip
        r = rounded(x) + rounded(delta)
        if mode == 0:
            ref = r / np.sqrt((r * r).mean(-1, keepdims=True) + 1e-5) * rounded(weight)
        else:
            ref = (r - r.mean(-1, keepdims=True)) / np.sqrt(r.var(-1, keepdims=True) + 1e-5)
        report(label, error(out, ref), residual_error=error(residual, r))

    a = rng.standard_normal((rows, h)).astype(np.float32)
    b = (rng.standard_normal((h, 384)) * 0.05).astype(np.float32)
    out = cp.empty((rows, 384), dtype)
    with fw.stream:
        fw.gemm(stored(a), stored(b), out)
    fw.stream.synchronize()
    report("gemm", error(out, rounded(a) @ rounded(b)),
           direct_cublas=fw.gemm.direct)  # fmt: skip

    width = c.intermediate_size
    gu = rng.standard_normal((rows, 2 * width)).astype(np.float32)
    out = cp.empty((rows, width), dtype)
    fw.kernels("activate", (8,), 256, stored(gu), out, np.int64(rows), np.int32(width),
               np.int32(0))  # fmt: skip
    g, u = np.split(rounded(gu), 2, axis=1)
    report("activate swiglu", error(out, g / (1 + np.exp(-g)) * u))

    heads, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
    qkv = rng.standard_normal((rows, (heads + 2 * kvh) * d)).astype(np.float32)
    positions = np.array([0, 5, 100, 255, 17])
    slots = np.array([3, 40, 77, -1, 1000])
    q_out = cp.empty((rows, heads, d), dtype)
    kc, vc = fw.k_cache[0], fw.v_cache[0]
    kc[...] = 0
    vc[...] = 0
    fw.kernels("rope_cache_write", (rows,), 128, stored(qkv), fw._nothing, np.int32(0),
               fw.cos, fw.sin, np.int32(1), cp.asarray(positions, np.int32),
               cp.asarray(slots, np.int32), q_out, kc, vc, np.int32(heads), np.int32(kvh),
               np.int32(d))  # fmt: skip
    cos, sin = LlamaForward(np, config, None, BLOCK)._rotation(positions)  # type: ignore[arg-type]
    qkv64 = rounded(qkv)
    q_ref = _rotate(np, qkv64[:, : heads * d].reshape(rows, heads, d), cos, sin)
    k_ref = _rotate(np, qkv64[:, heads * d : (heads + kvh) * d].reshape(rows, kvh, d), cos, sin)
    v_ref = qkv64[:, (heads + kvh) * d :].reshape(rows, kvh, d)
    kept = slots >= 0
    k_got = kc.reshape(-1, kvh, d)[cp.asarray(slots[kept])]
    v_got = vc.reshape(-1, kvh, d)[cp.asarray(slots[kept])]
    report("rope_cache_write", error(q_out, q_ref), k_error=error(k_got, k_ref[kept]),
           v_error=error(v_got, v_ref[kept]),
           padding_row_untouched=bool(int(cp.count_nonzero(kc)) == kept.sum() * kvh * d))  # fmt: skip

    fill, mixed = mixed_batch([30, 0], [1, 16, 17, 200], c.vocab_size, 3)
    del fill
    mixed[1] = StepSequence(mixed[1].token_ids, 0, mixed[1].block_table)  # a first chunk
    count = sum(len(e.token_ids) for e in mixed)
    q = rounded(rng.standard_normal((count, heads, d))).astype(np.float32)
    k = rounded(rng.standard_normal((count, kvh, d))).astype(np.float32)
    v = rounded(rng.standard_normal((count, kvh, d))).astype(np.float32)
    k_np = rounded(rng.standard_normal(kc.shape)).astype(np.float32)
    v_np = rounded(rng.standard_normal(vc.shape)).astype(np.float32)
    layout = StepLayout.of(np, mixed, BLOCK)
    ref = PagedAttention(np, d)(q, k, v, k_np, v_np, mixed, layout)
    packed = pack_step(mixed, BLOCK)
    ints = cp.asarray(packed.ints)
    views = {n: part(ints, n, packed.rows, packed.entries, packed.width)
             for n in ("token_rows", "positions", "block_tables")}  # fmt: skip
    out = cp.empty((count, heads, d), dtype)
    fw.kernels("paged_attention", (count, heads), 32 * ATTENTION_WARPS, stored(q), out,
               stored(k_np), stored(v_np), views["token_rows"], views["positions"],
               views["block_tables"], np.int32(packed.width), np.int32(heads), np.int32(kvh),
               np.int32(d), np.int32(BLOCK), np.float32(d**-0.5))  # fmt: skip
    report("paged_attention", error(out, ref), tokens=count)

    logits = rounded(rng.standard_normal((6, c.vocab_size)))
    bias = rng.standard_normal(c.vocab_size).astype(np.float32)
    widened, tokens = cp.empty((6, c.vocab_size), np.float32), cp.empty(6, np.int32)
    fw.kernels("widen_logits", (8,), 256, stored(logits), cp.asarray(bias), np.int32(1),
               widened, np.int64(logits.size), np.int32(c.vocab_size))  # fmt: skip
    report("widen_logits", error(widened, logits + bias))
    fw.kernels("argmax_rows", (6,), 256, widened, tokens, np.int32(c.vocab_size))
    emit("kernel", kernel="argmax_rows", dtype=name,
         equal=bool((cp.asnumpy(tokens) == cp.asnumpy(widened).argmax(1)).all()))  # fmt: skip


def check_forwards(cp: Any, graphs: bool = False) -> None:
    """Whole steps: a small Llama in float32 and in bfloat16, and tiny_lm, GPU logits
    against numpy's (float32)."""
    config = LlamaConfig.from_hf(SMALL)
    tensors = random_tensors(SMALL, 4, np.float32)
    reference = NumpyLlama(config, tensors, 128)
    fill, mixed = mixed_batch([30, 3], [1, 16, 17, 200], config.vocab_size, 5)
    decode = [StepSequence([7], e.start + 7, e.block_table) for e in mixed[:2]] + [
        StepSequence([9], e.start + 1, e.block_table) for e in mixed[2:]
    ]
    steps = (("fill", fill), ("mixed", mixed), ("decode", decode))
    expected = {label: reference(batch) for label, batch in steps}
    for dtype, model in ((np.float32, "llama-small fp32"), (BFLOAT16_BITS, "llama-small bf16")):
        with guarded("forward", model=model, graphs_asked=graphs):
            gpu = gpu_llama(cp, config, tensors, dtype, num_kv_blocks=128, block_size=BLOCK,
                            max_model_len=512, max_num_seqs=8, graphs=graphs)  # fmt: skip
            for label, batch in steps:
                ref, got = expected[label], gpu.step(batch)
                emit("forward", model=model, step=label, graphs_asked=graphs, max_abs_error=float(
                    np.abs(ref - got).max()), argmax_equal=bool((ref.argmax(1) == got.argmax(1)).all()),
                    graphs=gpu.graphed, graph_failures=gpu.graph_failures)  # fmt: skip
    if graphs:
        return
    cpu, device = TinyLM(), TinyLM(device="gpu")
    cpu.load()
    device.load()
    emit("forward", model="tiny_lm", on_gpu=device.gpu is not None)
    fill, mixed = mixed_batch([30, 3], [1, 16, 17, 200], 256, 6)
    for label, batch in (("fill", fill), ("mixed", mixed)):
        ref, got = cpu.step(batch), device.step(batch)
        emit("forward", model="tiny_lm", step=label, max_abs_error=float(np.abs(ref - got).max()))


class RandomLlama(ServedOnDevice, GenerativeModel):  # type: ignore[misc]
    """The random 1 B model for the engine: tokens are byte values, its forward given;
    ``device_draws`` False: random draws on the host (a comparison)."""

    def __init__(self, forward: GpuForward, max_num_seqs: int, num_blocks: int) -> None:
        super().__init__("random_llama", eos_token_id=0, max_model_len=2048,
                         num_kv_blocks=num_blocks, block_size=BLOCK, max_num_seqs=max_num_seqs,
                         device="gpu")  # fmt: skip
        self.gpu: GpuForward | None = forward
        self.device_draws = True

    @property
    def sampling_on_device(self) -> bool:
        return self.device_draws and super().sampling_on_device

    def load(self) -> None:
        pass  # loaded already

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)

    def step(self, batch: Sequence[StepSequence]) -> np.ndarray:
        assert self.gpu is not None
        return self.gpu.step(batch)


def load_1b(cp: Any, graphs: bool) -> tuple[LlamaConfig, Any, GpuForward, int]:
    """The random 1 B model in float16: its config, host tensors, forward, cache blocks."""
    config = LlamaConfig.from_hf(ONE_B)
    started = time.perf_counter()
    try:
        tensors = random_tensors(ONE_B, 7, np.float16, cp)
    except Exception as exc:  # a cupy without the Generator API: numpy draws them
        emit("setup", model="llama-1b fp16", device_random=repr(exc))
        tensors = random_tensors(ONE_B, 7, np.float16)
    emit("setup", model="llama-1b fp16", weights_seconds=round(time.perf_counter() - started, 1))
    num_blocks = SEQUENCES * -(-(CONTEXT + 96) // BLOCK) + 64
    started = time.perf_counter()
    gpu = gpu_llama(cp, config, tensors, np.float16, num_kv_blocks=num_blocks, block_size=BLOCK,
                    max_model_len=2048, max_num_seqs=SEQUENCES, graphs=graphs)  # fmt: skip
    emit("setup", model="llama-1b fp16", load_seconds=round(time.perf_counter() - started, 1),
         graphs_asked=graphs, graphs=gpu.graphed, graph_failures=gpu.graph_failures,
         direct_cublas=gpu.gemm.direct, sampling_failure=gpu.sampling_failure)  # fmt: skip
    return config, tensors, gpu, num_blocks


def prompts_1b(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(8)
    return [rng.integers(3, vocab, n).tolist() for n in (5, 17, 33, 64)]


def check_1b(cp: Any, steps: int, engine_seconds: float) -> None:
    """The 1 B model, eager: greedy tokens against transformers and numpy, timings,
    the engine."""
    config, tensors, gpu, num_blocks = load_1b(cp, graphs=False)
    prompts = prompts_1b(config.vocab_size)
    on_gpu: list[list[int]] = []
    margins: list[list[float]] = []
    with guarded("greedy", model="llama-1b fp16"):
        on_gpu = greedy(lambda b: gpu.step(b, greedy=True), prompts, steps, tokens_only=True)
        on_gpu_logits = greedy(gpu.step, prompts, steps, margins=margins)
        emit("greedy", model="llama-1b fp16", against="gpu logits path",
             **agreement(on_gpu, on_gpu_logits))  # fmt: skip
        with guarded("greedy", model="llama-1b", against="transformers fp16"):
            emit("greedy", model="llama-1b fp16", against="transformers fp16",
                 **agreement(on_gpu, transformers_greedy(tensors, prompts, steps), margins))  # fmt: skip
    with guarded("sampling", model="llama-1b fp16"):
        check_sampling(cp, gpu)
    with guarded("timing", model="llama-1b fp16"):
        time_model(gpu, config.vocab_size, "llama-1b fp16")
    with guarded("engine", model="llama-1b fp16"):
        run_engine(RandomLlama(gpu, SEQUENCES, num_blocks), engine_seconds)
    with guarded("greedy", model="llama-1b", against="numpy fp32"):  # the slowest, last
        blocks = sum(len(t) for t in tables([len(p) + steps for p in prompts]))
        reference = NumpyLlama(config, tensors, blocks)
        emit("greedy", model="llama-1b fp16", against="numpy fp32",
             **agreement(on_gpu, greedy(reference, prompts, steps), margins))  # fmt: skip


def check_graphs(cp: Any, steps: int, engine_seconds: float) -> None:
    """The decode graphs (run in a process of their own: see main): capture, replay
    against numpy and the eager forward, timings, the engine on them."""
    with guarded("forward", graphs=True):
        check_forwards(cp, graphs=True)
    with guarded("tiny_lm", graphs=True):
        device = TinyLM(device="gpu")
        device.load()
        eager = device.gpu
        device.gpu = device.gpu_forward(graphs=True)
        emit("setup", model="tiny_lm", graphs=device.gpu.graphed,
             graph_failures=device.gpu.graph_failures)  # fmt: skip
        blocks = tables([96] * 64)
        for b in (1, 16, 64):
            batch = [StepSequence([5], 64, t) for t in blocks[:b]]
            timed = {}
            for label, forward in (("graphs", device.gpu), ("eager", eager)):
                forward.step([StepSequence(list(range(64)), 0, t) for t in blocks[:b]])
                step = partial(forward.step, batch, greedy=True)
                timed[f"{label}_tokens_back_ms"] = median_ms(step, lambda: None)
            emit("timing", model="tiny_lm", what="decode step", batch=b, **timed)
    with guarded("llama-1b", graphs=True):
        config, _, gpu, num_blocks = load_1b(cp, graphs=True)
        if not gpu.graphed:
            return
        prompts = prompts_1b(config.vocab_size)
        with guarded("greedy", model="llama-1b fp16", graphs=True):
            step = lambda b: gpu.step(b, greedy=True)  # noqa: E731
            through_graphs = greedy(step, prompts, steps, tokens_only=True)
            gpu.use_graphs = False
            eager = greedy(step, prompts, steps, tokens_only=True)
            gpu.use_graphs = True
            emit("greedy", model="llama-1b fp16", graphs=True, against="eager",
                 **agreement(through_graphs, eager))  # fmt: skip
        with guarded("timing", model="llama-1b fp16", graphs=True):
            time_model(gpu, config.vocab_size, "llama-1b fp16", graphs=(True, False))
        with guarded("engine", model="llama-1b fp16", graphs=True):
            run_engine(RandomLlama(gpu, SEQUENCES, num_blocks), engine_seconds)


def transformers_greedy(tensors: Any, prompts: list[list[int]], steps: int) -> list[list[int]]:
    import torch
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in ONE_B.items() if k != "model_type"})
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).half().eval()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in tensors.items()})
    made = []
    with torch.no_grad():
        for prompt in prompts:  # one at a time: no padding to differ in
            ids = torch.tensor([prompt], device="cuda")
            out = model(ids, use_cache=True)
            past, tokens = out.past_key_values, []
            for _ in range(steps):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                out = model(torch.tensor([[token]], device="cuda"), past_key_values=past,
                            use_cache=True)  # fmt: skip
                past = out.past_key_values
            made.append(tokens)
    del model
    torch.cuda.empty_cache()
    return made


def time_model(gpu: GpuForward, vocab: int, label: str,
               graphs: Sequence[bool] = (False,)) -> None:  # fmt: skip
    rng = np.random.default_rng(9)
    blocks = tables([CONTEXT + 64] * SEQUENCES)
    prompts = [StepSequence(rng.integers(3, vocab, CONTEXT).tolist(), 0, t) for t in blocks]
    sync = gpu.stream.synchronize
    prefill = median_ms(lambda: gpu.step(prompts, greedy=True), sync, count=5)
    emit("timing", model=label, what=f"prefill {SEQUENCES} x {CONTEXT} tokens", ms=prefill,
         tokens_per_s=round(SEQUENCES * CONTEXT / prefill * 1000))  # fmt: skip
    batches = {b: [StepSequence([5], CONTEXT, t) for t in blocks[:b]] for b in (1, 16, 64)}
    for use in graphs:
        gpu.use_graphs = use
        for b, batch in batches.items():
            greedy_ms = median_ms(lambda: gpu.step(batch, greedy=True), sync)  # noqa: B023
            logits_ms = median_ms(lambda: gpu.step(batch), sync)  # noqa: B023
            draws = sampled_draws(b)
            logits32 = gpu._bucket(b)[0].logits32
            fields: dict[str, Any] = {
                "sampled_ms": median_ms(partial(gpu.sample, batch, draws), sync),
                "sampler_only_ms": median_ms(partial(gpu.sampler.sample, logits32, draws), sync),
            }
            graph = gpu.graph(b)
            if use and graph is not None:
                fields["graph_only_ms"] = median_ms(lambda: graph.launch(gpu.stream), sync)  # noqa: B023
            emit("timing", model=label, what="decode step", batch=b, graphs=use,
                 tokens_back_ms=greedy_ms, logits_back_ms=logits_ms, **fields)  # fmt: skip
    gpu.use_graphs = True


def sampled_draws(count: int, temperature: float = 0.8, top_p: float = 0.9) -> list[DeviceDraw]:
    """One random draw per sequence, as a served request at these settings asks."""
    return [DeviceDraw(row=i, temperature=temperature, top_k=0, top_p=top_p, min_p=0.0, seed=i,
                       stream=0, position=CONTEXT, logprobs=-1) for i in range(count)]  # fmt: skip


def check_sampling(cp: Any, gpu: GpuForward) -> None:
    """The device sampler (``gpu``'s) against its numpy reference on a 32,000-token
    vocabulary, and its draws' histogram against the softmax."""
    emit("sampling", load_check="passed" if gpu.samples_on_device else gpu.sampling_failure)
    rng = np.random.default_rng(11)
    vocab = gpu.shape.vocab
    logits = (rng.standard_normal((64, vocab)) * 3).astype(np.float32)
    rules = [(0.0, 0, 1.0, 0.0), (0.8, 0, 0.9, 0.0), (1.0, 50, 1.0, 0.0), (0.7, 0, 1.0, 0.05),
             (1.2, 40, 0.95, 0.02), (1.0, 0, 1.0, 0.0)]  # fmt: skip
    draws = [DeviceDraw(row=i % 64, temperature=t, top_k=k, top_p=p, min_p=m, seed=i, stream=0,
                        position=i, logprobs=(-1, 5)[i % 2])
             for i, (t, k, p, m) in enumerate(rules * 43)]  # fmt: skip
    for i in range(3, len(draws), 7):  # penalties over a 500-token history
        seen = rng.choice(vocab, min(500, vocab), replace=False).tolist()
        draws[i] = dataclasses.replace(
            draws[i], seen=seen, output_counts=rng.integers(0, 3, len(seen)).tolist(),
            presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.2,
        )  # fmt: skip
    with gpu.stream:
        got = gpu.sampler.sample(cp.asarray(logits), draws)
    wanted = reference_draws(logits, draws)
    asked = [i for i, d in enumerate(draws) if d.logprobs >= 0]
    assert got.logprobs is not None
    assert wanted.logprobs is not None
    emit("sampling", vocab=vocab, draws=len(draws),
         tokens_agreeing=int((np.asarray(got.tokens) == wanted.tokens).sum()),
         logprob_max_abs_error=float(np.abs(got.logprobs[asked] - wanted.logprobs[asked]).max()))  # fmt: skip
    small = np.array([[1.0, 2.5, 0.3, 2.4, -1.0, 0.9, 1.7, -0.2, 2.0, 0.0]], np.float32)
    count = 20_000
    many = [DeviceDraw(row=0, temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=5, stream=0,
                       position=p, logprobs=-1) for p in range(count)]  # fmt: skip
    gpu.sampler.vocab = small.shape[1]
    try:
        with gpu.stream:
            drawn = gpu.sampler.sample(cp.asarray(small), many).tokens
    finally:
        gpu.sampler.vocab = vocab
    observed = np.bincount(np.asarray(drawn), minlength=small.shape[1])
    e = np.exp(small[0].astype(np.float64) / 0.8 - (small[0] / 0.8).max())
    expected = count * e / e.sum()
    emit("sampling", what="chi-square of 20,000 draws, 9 degrees of freedom (0.999: 27.88)",
         chi_square=round(float(((observed - expected) ** 2 / expected).sum()), 2))  # fmt: skip


def check_tiny(cp: Any) -> None:
    """tiny_lm: greedy tokens and decode steps, GPU against CPU."""
    cpu, device = TinyLM(), TinyLM(device="gpu")
    cpu.load()
    device.load()
    assert device.gpu is not None, "tiny_lm did not take the GPU forward"
    prompts = [list(b"paged attention"), list(b"on the device, in one graph"), list(b"x")]
    emit("greedy", model="tiny_lm", against="numpy fp32",
         **agreement(greedy(device.step_greedy, prompts, 32, tokens_only=True),
                     greedy(cpu.step, prompts, 32)))  # fmt: skip
    rng = np.random.default_rng(10)
    blocks = tables([96] * 64)
    for b in (1, 16, 64):
        prompts_b = [StepSequence(rng.integers(0, 256, 64).tolist(), 0, t) for t in blocks[:b]]
        cpu.step(prompts_b)
        device.step(prompts_b)
        batch = [StepSequence([5], 64, t) for t in blocks[:b]]
        emit("timing", model="tiny_lm", what="decode step", batch=b,
             gpu_tokens_back_ms=median_ms(lambda: device.step_greedy(batch), lambda: None),  # noqa: B023
             gpu_logits_back_ms=median_ms(lambda: device.step(batch), lambda: None),  # noqa: B023
             cpu_ms=median_ms(lambda: cpu.step(batch), lambda: None))  # noqa: B023  # fmt: skip


def run_engine(model: GenerativeModel, seconds: float) -> None:
    """The engine serving ``model`` in-process: greedy 64-token streams."""
    try:
        import trio
    except ImportError:
        emit("engine", skipped="trio is not installed: put the wheels of trio, outcome and "
             "sniffio (pip download --no-deps trio outcome sniffio) on PYTHONPATH")  # fmt: skip
        return

    sys.path.insert(0, str(Path(__file__).parent))
    # what the bench imports from the packages' faces, which bare_packages left empty
    sys.modules["trioserve"].GenerativeModel = GenerativeModel  # type: ignore[attr-defined]
    sys.modules["trioserve"].StepSequence = StepSequence  # type: ignore[attr-defined]
    sys.modules["trioserve.models"].TinyLM = TinyLM  # type: ignore[attr-defined]
    from llm_engine_bench import load_run

    runs = [("greedy", 0.0, True), ("T0.8 top-p 0.9, device draws", 0.8, True),
            ("T0.8 top-p 0.9, host draws", 0.8, False)]  # fmt: skip
    for sampling, temperature, device_draws in runs:
        if isinstance(model, RandomLlama):
            model.device_draws = device_draws
        elif not device_draws:
            continue
        for concurrency in (1, 64):
            top_p = 0.9 if temperature else 1.0
            result = trio.run(load_run, concurrency, seconds, 64, model, temperature, top_p)
            emit("engine", model=model.name, streams=concurrency, sampling=sampling,
                 **{k: round(v, 1) for k, v in result.items()})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--skip-1b", action="store_true")
    parser.add_argument("--engine-seconds", type=float, default=6.0)
    parser.add_argument("--skip-graphs", action="store_true")
    parser.add_argument("--graphs-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    started = time.perf_counter()
    import cupy as cp

    if args.graphs_only:
        check_graphs(cp, args.steps, args.engine_seconds / 2)
        return
    with guarded("env"):
        emit("env", cupy=cp.__version__, device=cp.cuda.runtime.getDeviceProperties(0)["name"],
             cuda_runtime=cp.cuda.runtime.runtimeGetVersion(), python=sys.version.split()[0])  # fmt: skip
        for package in ("torch", "transformers"):
            try:
                emit("env", **{package: __import__(package).__version__})
            except ImportError:
                emit("env", **{package: None})
    for dtype, name in ((np.float32, "float32"), (np.float16, "float16"),
                        (BFLOAT16_BITS, "bfloat16")):  # fmt: skip
        with guarded("kernel", dtype=name):
            check_kernels(cp, dtype)
    with guarded("forward"):
        check_forwards(cp)
    with guarded("tiny_lm"):
        check_tiny(cp)
    if not args.skip_1b:
        with guarded("llama-1b"):
            check_1b(cp, args.steps, args.engine_seconds)
    if not args.skip_graphs:
        # In a process of its own: the capture calls libcublas through ctypes, and what
        # goes wrong there may take the process with it (it prints its own lines).
        command = [sys.executable, __file__, "--graphs-only", "--steps", str(args.steps),
                   "--engine-seconds", str(args.engine_seconds)]  # fmt: skip
        sys.stdout.flush()
        finished = subprocess.run(command, check=False)
        emit("graphs", exit_code=finished.returncode)
    emit("done", seconds=round(time.perf_counter() - started, 1))


if __name__ == "__main__":
    main()
