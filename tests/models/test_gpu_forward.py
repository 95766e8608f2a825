"""The GPU forward's host side, run on a numpy stand-in for cupy (``fake_device``).

What runs here is everything but the CUDA code: the step packing and bucket padding,
the buffers and the order of every launch with its arguments checked against the
kernels' CUDA signatures, graph capture and replay (a replayed graph reads only its
captured buffers), the greedy path. The kernels' own arithmetic is the numpy reference
here; ``tools/gpu_decode_check.py`` checks the CUDA kernels against it on a device, and
``test_cuda_source.py`` compiles them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from trioserve import StepSequence
from trioserve.models import _tiny_lm
from trioserve.models._gpu_forward import GpuForward
from trioserve.models._gpu_inputs import bucket_for, decode_buckets, pack_step
from trioserve.models._llama import LlamaConfig, LlamaForward, LlamaWeights, gpu_parts
from trioserve.models._tiny_lm import TinyLM

from . import fake_device
from .on_device import on_a_device

BLOCK = 4
CONFIG = {
    "model_type": "llama",
    "vocab_size": 50,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000.0,
    "max_position_embeddings": 64,
}
VARIANTS = {
    "gqa": {},
    "qwen2-bias": {"model_type": "qwen2"},
    "tied-mha": {"tie_word_embeddings": True, "num_key_value_heads": 4},
    "yarn": {
        "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
    },
}


def llama_tensors(config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    h, ff, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h)}.items():
            shapes[f"{p}self_attn.{name}_proj.weight"] = shape
            shapes[f"{p}self_attn.{name}_proj.bias"] = shape[:1]
        for name, shape in {"gate": (ff, h), "up": (ff, h), "down": (h, ff)}.items():
            shapes[f"{p}mlp.{name}_proj.weight"] = shape
    tensors = {k: rng.normal(0, shape[-1] ** -0.5, shape) for k, shape in shapes.items()}
    for name in ["model.norm.weight"] + [
        f"model.layers.{i}.{n}_layernorm.weight"
        for i in range(config["num_hidden_layers"])
        for n in ("input", "post_attention")
    ]:
        tensors[name] = 1 + rng.normal(0, 0.1, h)
    return {k: t.astype(np.float32) for k, t in tensors.items()}


@pytest.fixture(autouse=True)
def fresh_device() -> None:
    fake_device.state.launches = fake_device.state.graph_launches = 0


def forwards(
    variant: str,
    dtype: Any = np.float32,
    max_num_seqs: int = 4,
    xp: Any = fake_device,
    graphs: bool = True,
) -> tuple[GpuForward, Any]:
    """The GPU forward on ``xp`` (the stand-in), and the numpy forward as a step function."""
    document = {**CONFIG, **VARIANTS[variant]}
    config = LlamaConfig.from_hf(document)
    tensors = llama_tensors(document)
    weights = LlamaWeights(xp, config, tensors, dtype)
    gpu = GpuForward(
        xp, *gpu_parts(xp, config, weights), num_layers=2,
        num_kv_blocks=40, block_size=BLOCK, max_model_len=64, max_num_seqs=max_num_seqs,
        graphs=graphs,
    )  # fmt: skip
    fake_device.state.launches = fake_device.state.graph_launches = 0  # the load's own
    reference = LlamaForward(np, config, LlamaWeights(np, config, tensors), BLOCK)
    cache = (2, 40, BLOCK, config.num_kv_heads, config.head_dim)
    k, v = np.zeros(cache, np.float32), np.zeros(cache, np.float32)
    return gpu, lambda batch: reference(batch, k, v)


def steps() -> list[list[StepSequence]]:
    """Prompts (one split in two chunks), then a mixed step, then decodes."""
    tables = [[3, 7, 1], [0, 2, 9, 4, 5], [6]]
    return [
        [StepSequence([1, 2, 3, 4, 5], 0, tables[0]), StepSequence(list(range(10, 16)), 0, tables[1])],
        [StepSequence(list(range(20, 29)), 6, tables[1]), StepSequence([7], 5, tables[0]),
         StepSequence([8, 9], 0, tables[2])],
        [StepSequence([11], 6, tables[0]), StepSequence([12], 15, tables[1]),
         StepSequence([13], 2, tables[2])],
        [StepSequence([14], 7, tables[0]), StepSequence([15], 16, tables[1])],
    ]  # fmt: skip


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_steps_match_the_numpy_forward(variant: str) -> None:
    gpu, reference = forwards(variant)
    assert gpu.graphed == [1, 2, 4]  # every bucket captured
    for batch in steps():
        launched = fake_device.state.graph_launches
        expected = reference(batch)
        np.testing.assert_allclose(gpu.step(batch), expected, rtol=1e-4, atol=1e-4)
        decode = all(len(s.token_ids) == 1 for s in batch)
        # a decode step is one graph launch; the greedy call below is a second one
        assert fake_device.state.graph_launches - launched == decode
        tokens = gpu.step(batch, greedy=True) if not decode else None
        if tokens is not None:
            assert tokens.tolist() == expected.argmax(axis=1).tolist()


@on_a_device
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_on_a_device_steps_match_the_numpy_forward(variant: str) -> None:
    import cupy

    gpu, reference = forwards(variant, xp=cupy)
    assert gpu.graph_failures == {} and gpu.graphed == [1, 2, 4]
    for batch in steps():
        expected = reference(batch)
        np.testing.assert_allclose(gpu.step(batch), expected, rtol=1e-3, atol=1e-3)
        # the same step again (it writes the same K/V), its tokens chosen on the device
        assert gpu.step(batch, greedy=True).tolist() == expected.argmax(axis=1).tolist()
    half, _ = forwards(variant, dtype=np.float16, xp=cupy)
    for batch in steps():
        np.testing.assert_allclose(half.step(batch), reference(batch), atol=0.05)


def test_greedy_decode_through_a_graph_gives_the_argmax() -> None:
    gpu, reference = forwards("gqa")
    for batch in steps()[:2]:
        gpu.step(batch)
        reference(batch)
    decode = steps()[2]
    tokens = gpu.step(decode, greedy=True)
    assert fake_device.state.graph_launches == 1
    assert tokens.dtype == np.int32
    assert tokens.tolist() == reference(decode).argmax(axis=1).tolist()


def test_padding_rows_write_no_cache_slot() -> None:
    gpu, _ = forwards("gqa")
    gpu.step(steps()[0])
    before = np.array(gpu.k_cache), np.array(gpu.v_cache)
    decode = steps()[2]  # three sequences: padded to the bucket of four
    gpu.step(decode)
    for cache, old in zip((gpu.k_cache, gpu.v_cache), before, strict=True):
        changed = np.argwhere((np.asarray(cache) != old).any(axis=(3, 4)))
        slots = {(int(block), int(offset)) for _, block, offset in changed}
        written = {(s.block_table[s.start // BLOCK], s.start % BLOCK) for s in decode}
        assert slots == written


def test_an_allocation_during_capture_leaves_that_bucket_eager(monkeypatch) -> None:
    launch = GpuForward._launch

    def allocating(self: GpuForward, ws: Any) -> None:
        self.xp.empty(1, np.float32)  # an operation that takes memory from the pool
        launch(self, ws)

    monkeypatch.setattr(GpuForward, "_launch", allocating)
    gpu, reference = forwards("gqa")
    assert gpu.graphed == [] and sorted(gpu.graph_failures) == [1, 2, 4]
    assert "allocated 4 bytes during graph capture" in gpu.graph_failures[1]
    for batch in steps():
        np.testing.assert_allclose(gpu.step(batch), reference(batch), rtol=1e-4, atol=1e-4)
    assert fake_device.state.graph_launches == 0


def test_a_graph_whose_replay_differs_is_not_used(monkeypatch) -> None:
    """A product run at capture time instead of recorded (as a cuBLAS call on another
    stream would be): the replay reads what the NaN-filled buffers hold, and the check
    after capture refuses the graph."""

    monkeypatch.setattr(fake_device.cuda.cublas, "gemmEx", fake_device.gemm_now)
    gpu, reference = forwards("gqa")
    assert gpu.graphed == []
    assert "replay differs from the eager forward" in gpu.graph_failures[1]
    for batch in steps():
        np.testing.assert_allclose(gpu.step(batch), reference(batch), rtol=1e-4, atol=1e-4)


def test_eager_unless_asked() -> None:
    gpu, reference = forwards("gqa", graphs=False)
    assert gpu.graphed == [] and gpu.graph_failures == {}
    for batch in steps():
        np.testing.assert_allclose(gpu.step(batch), reference(batch), rtol=1e-4, atol=1e-4)
    assert fake_device.state.graph_launches == 0
    # A decode step runs over its bucket's buffers, made once: it allocates nothing.
    before = fake_device.state.allocations
    gpu.step(steps()[3], greedy=True)
    assert fake_device.state.allocations == before


def test_float16_storage_follows_the_float32_forward() -> None:
    gpu, reference = forwards("gqa", dtype=np.float16)
    assert gpu.dtype == np.float16 and gpu.k_cache.dtype == np.float16
    for batch in steps():
        got, expected = gpu.step(batch), reference(batch)
        assert got.dtype == np.float32  # handed to the engine as float32
        np.testing.assert_allclose(got, expected, atol=0.05)


def test_a_batch_larger_than_every_bucket_runs_eagerly() -> None:
    gpu, reference = forwards("gqa", max_num_seqs=2)
    for batch in steps()[:2]:
        gpu.step(batch)
        reference(batch)
    np.testing.assert_allclose(gpu.step(steps()[2]), reference(steps()[2]), atol=1e-4)
    assert fake_device.state.graph_launches == 0


def test_tiny_lm_takes_the_gpu_forward(monkeypatch) -> None:
    monkeypatch.setattr(
        _tiny_lm, "array_module", lambda device: fake_device if device == "gpu" else np
    )
    sizes = {"num_kv_blocks": 40, "block_size": BLOCK, "max_model_len": 64, "max_num_seqs": 4}
    cpu, gpu = TinyLM(**sizes), TinyLM(**sizes, device="gpu")
    cpu.load()
    gpu.load()
    assert gpu.gpu is not None and gpu.greedy_on_device and not cpu.greedy_on_device
    assert gpu.sampling_on_device and not cpu.sampling_on_device
    for batch in steps():
        expected = cpu.step(batch)
        np.testing.assert_allclose(gpu.step(batch), expected, rtol=1e-4, atol=1e-4)
    gpu.unload()
    assert gpu.gpu is None and not gpu.greedy_on_device and not gpu.sampling_on_device


def test_decode_buckets() -> None:
    assert decode_buckets(1) == (1,)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert [bucket_for(n, decode_buckets(48)) for n in (1, 3, 33, 48, 49)] == [1, 4, 48, 48, None]


def test_pack_step_layout() -> None:
    batch = [StepSequence([5, 6, 7], 2, [4, 9]), StepSequence([8], 5, [1, 3])]
    packed = pack_step(batch, BLOCK)
    assert (packed.rows, packed.entries, packed.width) == (4, 2, 2)
    assert packed.part("tokens").tolist() == [5, 6, 7, 8]
    assert packed.part("positions").tolist() == [2, 3, 4, 5]
    # position p of a sequence: block_table[p // 4] * 4 + p % 4
    assert packed.part("slots").tolist() == [4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 0, 3 * 4 + 1]
    assert packed.part("token_rows").tolist() == [0, 0, 0, 1]
    assert packed.part("last_rows").tolist() == [2, 3]
    assert packed.part("block_tables").tolist() == [[4, 9], [1, 3]]


def test_pack_step_pads_a_decode_step_to_its_bucket() -> None:
    batch = [StepSequence([8], 5, [1, 3]), StepSequence([9], 0, [2])]
    packed = pack_step(batch, BLOCK, pad_to=4, width=3)
    assert packed.part("tokens").tolist() == [8, 9, 0, 0]
    assert packed.part("slots").tolist() == [13, 8, -1, -1]  # padding is written nowhere
    assert packed.part("token_rows").tolist() == [0, 1, 2, 3]
    assert packed.part("last_rows").tolist() == [0, 1, 2, 3]
    assert packed.part("block_tables").tolist() == [[1, 3, 0], [2, 0, 0], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="only a decode step"):
        pack_step([StepSequence([1, 2], 0, [0])], BLOCK, pad_to=4)
    with pytest.raises(ValueError, match="exceeds the width 1"):
        pack_step(batch, BLOCK, width=1)
