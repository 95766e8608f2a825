"""bfloat16 storage in the GPU forward: a bfloat16 checkpoint's weights, activations and
KV cache stay bfloat16 (``uint16`` bit patterns on the device, ``_storage.py``).

On the numpy stand-in for cupy (``fake_device``, whose kernels round to bfloat16 where
the CUDA ones do, with the same integer arithmetic) and, where there is one, on a device.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trioserve import StepSequence
from trioserve.models import CheckpointLM, _checkpoint
from trioserve.models._cublas import Gemm
from trioserve.models._storage import BFLOAT16_BITS, nan_of, to_storage

from . import fake_device
from .on_device import on_a_device
from .test_checkpoint import BASE_CONFIG, VARIANTS, write_checkpoint
from .test_gpu_forward import BLOCK, forwards, steps
from .test_gpu_forward import VARIANTS as FORWARD_VARIANTS

ml_dtypes = pytest.importorskip("ml_dtypes")

# bfloat16 keeps 8 bits of mantissa (float16 11): a relative step of 2**-8 at each
# rounding, over two layers, on logits of magnitude up to about 4 (the stand-in's
# errors: about 0.03). A device rounds at more points (each ``rnd`` of the CUDA source,
# which the stand-in skips).
LOGITS_TOLERANCE = 0.1
DEVICE_TOLERANCE = 0.2


def test_rounding_to_bfloat16_is_ml_dtypes_round_to_nearest_even() -> None:
    """``fake_device.bfloat16_bits`` is ``from_f`` of the CUDA source's ``TS_BF16``
    branch, the same integer arithmetic; here against ml_dtypes over every class of
    float32: ties (kept part even and odd), subnormals, the largest finite values (some
    round to infinity), infinities, zeros, NaNs, and a million random bit patterns."""
    rng = np.random.default_rng(0)
    kept = rng.integers(0, 1 << 16, 4096, dtype=np.uint32) << 16
    special = np.array(
        [0, 0x80000000, 1, 0x8000, 0x8001, 0x7FFF, 0x18000, 0x17FFF, 0x7FFFFF, 0x807FFFFF,
         0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,
         0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0xFFFFFFFF, 0x7FFF8000],
        np.uint32,
    )  # fmt: skip
    bits = np.concatenate([
        special,
        kept | 0x8000, kept | 0x7FFF, kept | 0x8001,  # ties, either side of them
        rng.integers(0, 1 << 32, 1_000_000, dtype=np.uint32),
        rng.integers(0, 1 << 23, 10_000, dtype=np.uint32),  # subnormals
    ])  # fmt: skip
    values = bits.view(np.float32)
    got = fake_device.bfloat16_bits(values)
    with np.errstate(invalid="ignore", over="ignore"):  # NaNs, and rounding to infinity
        wanted = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(values)
    assert nan.sum() > 1000 and (got[~nan] == wanted[~nan]).all()
    # A NaN stays a quiet NaN of its sign (ml_dtypes drops the payload; the CUDA code
    # keeps its upper bits).
    assert ((got[nan] & 0x7FC0) == 0x7FC0).all()
    assert ((got[nan] >> 15) == (bits[nan] >> 31)).all()
    assert fake_device.bfloat16_bits(np.float32([1 + 2**-8, 1 + 3 * 2**-8])).tolist() == [
        0x3F80,  # a tie, rounded to the even 1.0
        0x3F82,  # a tie, rounded to the even 1 + 2**-6
    ]
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    decoded = fake_device.bfloat16_values(every)
    np.testing.assert_array_equal(decoded, every.view(ml_dtypes.bfloat16).astype(np.float32))


def test_host_conversion_to_storage() -> None:
    values = np.float32([1.0, 1 + 2**-8, -3.3e38, 1e-40, np.inf])
    bits = to_storage(values, BFLOAT16_BITS)
    assert bits.dtype == BFLOAT16_BITS
    np.testing.assert_array_equal(bits, fake_device.bfloat16_bits(values))  # the kernels'
    stored = values.astype(ml_dtypes.bfloat16)  # as safetensors reads a BF16 tensor
    assert np.shares_memory(to_storage(stored, BFLOAT16_BITS), stored)  # no second rounding
    assert to_storage(values[:2], np.float16).dtype == np.float16
    assert nan_of(BFLOAT16_BITS) == 0x7FC0 and np.isnan(nan_of(np.float16))


def test_direct_products_are_laid_out_as_cublas_reads_them() -> None:
    """The stand-in's gemmEx reads its pointers column-major, as cuBLAS does: a product
    comes out right only if Gemm hands over the arguments cuBLAS expects."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 5)), rng.standard_normal((5, 7))
    for storage, tolerance in ((np.float32, 1e-5), (np.float16, 1e-2), (BFLOAT16_BITS, 5e-2)):
        gemm = Gemm(fake_device, fake_device.cuda.Stream(), np.dtype(storage))
        assert gemm.direct
        out = fake_device.empty((3, 7), storage)
        gemm(*(fake_device.asarray(to_storage(x, storage)) for x in (a, b)), out)
        got = fake_device.bfloat16_values(out) if storage == BFLOAT16_BITS else out
        np.testing.assert_allclose(got, a @ b, atol=tolerance)


def test_without_direct_cublas_bfloat16_products_are_refused(monkeypatch) -> None:
    """cupy.matmul would multiply bfloat16 bit patterns as integers: float products fall
    back to it, bfloat16 ones refuse, and such a model fails to load, saying why."""
    monkeypatch.delattr(fake_device.cuda, "cublas")
    gemm = Gemm(fake_device, fake_device.cuda.Stream(), np.dtype(np.float32))
    assert not gemm.direct and "cublas" in gemm.unavailable
    refusal = "bfloat16 products need cuBLAS GemmEx, which is unavailable: AttributeError"
    with pytest.raises(RuntimeError, match=refusal):
        gemm(*(fake_device.zeros((2, 2), BFLOAT16_BITS) for _ in range(3)))
    with pytest.raises(RuntimeError, match=refusal):
        forwards("gqa", dtype=BFLOAT16_BITS)
    gpu, reference = forwards("gqa")  # float32 through cupy.matmul, as before
    for batch in steps():
        np.testing.assert_allclose(gpu.step(batch), reference(batch), rtol=1e-4, atol=1e-4)


def test_a_wrong_bfloat16_product_fails_the_load(monkeypatch) -> None:
    """A GemmEx that takes CUDA_R_16BF for another type: the check at load sees it."""
    monkeypatch.setitem(fake_device._CUDA_TYPES, 14, np.float16)
    with pytest.raises(RuntimeError, match="bfloat16 product differs from the host's"):
        forwards("gqa", dtype=BFLOAT16_BITS)


def run_greedy(
    gpu_tokens: Callable[[list[StepSequence]], Any],
    reference: Callable[[list[StepSequence]], np.ndarray[Any, Any]],
    prompts: Sequence[list[int]],
    count: int,
) -> list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """``count`` greedy steps of ``prompts`` in one batch, each step run by both forwards
    (continuing from the GPU's tokens): the GPU's tokens and the reference's logits."""
    tables = [list(range(5 * i, 5 * i + 5)) for i in range(len(prompts))]
    batch = [StepSequence(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    made: list[list[int]] = [[] for _ in prompts]
    found = []
    for _ in range(count):
        tokens, logits = np.asarray(gpu_tokens(batch)), reference(batch)
        found.append((tokens, logits))
        for m, token in zip(made, tokens.tolist(), strict=True):
            m.append(token)
        batch = [StepSequence([m[-1]], len(p) + len(m) - 1, t)
                 for p, m, t in zip(prompts, made, tables, strict=True)]  # fmt: skip
    return found


PROMPTS = [[1, 5, 9, 12, 3], [1, *range(20, 28)], [1, 40]]


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias"])
def test_a_bfloat16_checkpoint_is_served_in_bfloat16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    monkeypatch.setattr(
        _checkpoint, "array_module", lambda device: fake_device if device == "gpu" else np
    )
    config = {**BASE_CONFIG, **VARIANTS[variant]}
    write_checkpoint(tmp_path, config, bf16=True)
    # The default cache holds as many bytes: twice the blocks in bfloat16 as in float32.
    default = CheckpointLM(tmp_path, "m", device="gpu").num_kv_blocks
    assert default == 2 * CheckpointLM(tmp_path, "m").num_kv_blocks
    sizes = {"num_kv_blocks": 40, "block_size": BLOCK, "max_model_len": 64, "max_num_seqs": 4}
    cpu, gpu = (
        CheckpointLM(tmp_path, "m", **sizes),
        CheckpointLM(tmp_path, "m", **sizes, device="gpu"),
    )
    cpu.load()
    gpu.load()
    assert gpu.gpu is not None and gpu.gpu.dtype == BFLOAT16_BITS and gpu.gpu.graphed == [1, 2, 4]
    assert gpu.k_cache.dtype == gpu.v_cache.dtype == BFLOAT16_BITS
    weights = gpu.gpu.weights
    assert weights.embed.dtype == weights.layers[0].qkv.dtype == BFLOAT16_BITS
    from safetensors.numpy import load_file

    stored = load_file(tmp_path / "model.safetensors")["model.embed_tokens.weight"]
    np.testing.assert_array_equal(weights.embed, stored.view(np.uint16))  # not rounded again
    for batch in steps():
        np.testing.assert_allclose(gpu.step(batch), cpu.step(batch), atol=LOGITS_TOLERANCE)
    for tokens, logits in run_greedy(gpu.step_greedy, cpu.step, PROMPTS, 8):
        assert tokens.tolist() == logits.argmax(axis=1).tolist()


def test_a_bfloat16_checkpoint_loads_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """The server's process has imported nothing that names numpy's bfloat16 type when
    it loads a checkpoint (this test module has): the load must not depend on that."""
    tensors = write_checkpoint(tmp_path, BASE_CONFIG, bf16=True)
    script = (
        "import sys\n"
        "from trioserve.models._checkpoint import load_checkpoint_model\n"
        "assert 'ml_dtypes' not in sys.modules\n"
        f"model = load_checkpoint_model({str(tmp_path)!r}, 'm')\n"
        "model.load()\n"
        "assert model.forward is not None\n"
        "print(repr(model.forward.weights.embed[:2].tolist()))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = ast.literal_eval(done.stdout)
    assert np.array_equal(rows, tensors["model.embed_tokens.weight"][:2])


def test_a_broken_safetensors_header_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, BASE_CONFIG)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(_checkpoint.CheckpointError, match="cannot read the header"):
        CheckpointLM(tmp_path, "m", device="gpu")


@on_a_device
@pytest.mark.parametrize("variant", sorted(FORWARD_VARIANTS))
def test_on_a_device_bfloat16_steps_follow_the_numpy_forward(variant: str) -> None:
    """The CUDA kernels and cuBLAS in bfloat16: logits within bfloat16's tolerance of
    the float32 forward's, and each greedy token the float32 argmax, but at a near tie
    (the two tokens' float32 logits within that tolerance, where rounding decides)."""
    import cupy

    gpu, reference = forwards(variant, dtype=BFLOAT16_BITS, xp=cupy)
    assert gpu.graph_failures == {} and gpu.graphed == [1, 2, 4]
    assert gpu.k_cache.dtype == BFLOAT16_BITS and gpu.gemm.direct
    for batch in steps():
        np.testing.assert_allclose(gpu.step(batch), reference(batch), atol=DEVICE_TOLERANCE)
    gpu, reference = forwards(variant, dtype=BFLOAT16_BITS, xp=cupy)  # a fresh cache
    step = lambda batch: gpu.step(batch, greedy=True)  # noqa: E731
    for tokens, logits in run_greedy(step, reference, PROMPTS, 8):
        chosen = logits[np.arange(len(tokens)), tokens]
        assert (logits.max(axis=1) - chosen <= DEVICE_TOLERANCE).all()
