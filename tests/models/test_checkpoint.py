"""A tiny random Llama-family checkpoint, written here in Hugging Face's format, served
through the engine and checked token for token against a dense reference written below
(and against ``transformers`` when it is installed)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from trioserve import ServerConfig, serve
from trioserve._cli import _parser, config_from_args
from trioserve._served import ModelRepository
from trioserve.models import CheckpointError, CheckpointLM, _checkpoint, load_checkpoint_model
from trioserve.repository import ConfigError
from trioserve.repository._reading import read_model

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from . import fake_device

TIMEOUT = 60
WORDS = [f"w{i}" for i in range(61)]
VOCAB = ["<unk>", "<s>", "</s>", *WORDS]  # 64 tokens; BOS 1, EOS 2

BASE_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": len(VOCAB),
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "llama-gqa": {},
    "tied-mha": {"tie_word_embeddings": True, "num_key_value_heads": 4},
    "rope-linear": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "rope-llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "rope-yarn": {
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    },
    "rope-dynamic": {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
    # transformers 5 writes rope_parameters only; here beside a legacy rope_theta it must
    # win over, as it does in transformers.
    "rope-parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
    "rope-parameters-llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "qwen2-bias": {"model_type": "qwen2", "num_key_value_heads": 1},
    "mistral-head-dim": {"model_type": "mistral", "head_dim": 16},
}


def write_checkpoint(
    folder: Path, config: dict[str, Any], *, seed: int = 0, bf16: bool = False
) -> dict[str, np.ndarray[Any, Any]]:
    """config.json, model.safetensors, tokenizer.json and tokenizer_config.json; returns
    the weights as the reference reads them (float64, after any bf16 rounding)."""
    rng = np.random.default_rng(seed)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim", hidden // heads)
    ff, vocab = config["intermediate_size"], config["vocab_size"]
    tensors: dict[str, np.ndarray[Any, Any]] = {
        "model.embed_tokens.weight": rng.normal(0, 1, (vocab, hidden)),
        "model.norm.weight": 1 + rng.normal(0, 0.1, hidden),
    }
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rng.normal(0, hidden**-0.5, (vocab, hidden))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (heads * head_dim, hidden),
            "self_attn.k_proj.weight": (kv * head_dim, hidden),
            "self_attn.v_proj.weight": (kv * head_dim, hidden),
            "self_attn.o_proj.weight": (hidden, heads * head_dim),
            "mlp.gate_proj.weight": (ff, hidden),
            "mlp.up_proj.weight": (ff, hidden),
            "mlp.down_proj.weight": (hidden, ff),
        }
        for name, shape in shapes.items():
            tensors[p + name] = rng.normal(0, shape[1] ** -0.5, shape)
        if config["model_type"] == "qwen2":
            for x, width in (("q", heads), ("k", kv), ("v", kv)):
                tensors[f"{p}self_attn.{x}_proj.bias"] = rng.normal(0, 0.5, width * head_dim)
        tensors[p + "input_layernorm.weight"] = 1 + rng.normal(0, 0.1, hidden)
        tensors[p + "post_attention_layernorm.weight"] = 1 + rng.normal(0, 0.1, hidden)
    if bf16:
        import ml_dtypes

        stored = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    else:
        stored = {k: v.astype(np.float32) for k, v in tensors.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer(folder)
    return {k: v.astype(np.float64) for k, v in stored.items()}


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json (word level, BOS first) and tokenizer_config.json."""
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "</s>"},
                "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }} "
                "{% endfor %}",
            }
        )
    )


# --- the dense reference: whole sequences, no cache, float64 ---------------------------


def reference_greedy(
    tensors: dict[str, np.ndarray[Any, Any]], config: dict[str, Any], prompt: list[int], steps: int
) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(np.argmax(dense_logits(tensors, config, ids)[-1])))
    return ids[len(prompt) :]


def dense_logits(
    t: dict[str, np.ndarray[Any, Any]], config: dict[str, Any], ids: list[int]
) -> np.ndarray[Any, Any]:
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config.get("head_dim", config["hidden_size"] // heads)
    eps = config["rms_norm_eps"]
    n = len(ids)
    frequencies, attention_factor = reference_frequencies(config, dim)
    angles = np.outer(np.arange(n), frequencies)

    def rms(x: Any, w: Any) -> Any:
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w

    def rope(x: Any) -> Any:  # pairs (i, i + dim/2)
        first, second = x[..., : dim // 2], x[..., dim // 2 :]
        c = np.cos(angles)[:, None, :] * attention_factor
        s = np.sin(angles)[:, None, :] * attention_factor
        return np.concatenate([first * c - second * s, second * c + first * s], axis=-1)

    x = t["model.embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])

        def project(name: str, h: Any = h, p: str = p) -> Any:
            y = h @ t[f"{p}self_attn.{name}_proj.weight"].T
            bias = t.get(f"{p}self_attn.{name}_proj.bias")
            return y if bias is None else y + bias

        q = rope(project("q").reshape(n, heads, dim))
        k = np.repeat(rope(project("k").reshape(n, kv, dim)), heads // kv, axis=1)
        v = np.repeat(project("v").reshape(n, kv, dim), heads // kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attended = np.einsum("hqk,khd->qhd", weights, v).reshape(n, heads * dim)
        x = x + attended @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        up = h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return rms(x, t["model.norm.weight"]) @ head.T  # type: ignore[no-any-return]


def reference_frequencies(config: dict[str, Any], dim: int) -> tuple[list[float], float]:
    """Each pair's frequency and the factor on cos and sin, one frequency at a time from
    the published recipes."""
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = scaling.get("rope_theta", config["rope_theta"])
    base = [1 / theta ** (2 * i / dim) for i in range(dim // 2)]
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return [f / scaling["factor"] for f in base], 1.0
    if kind == "yarn":
        return reference_yarn(base, theta, dim, scaling)
    if kind != "llama3":  # default, and dynamic within max_position_embeddings
        return base, 1.0
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    scaled = []
    for freq in base:  # Llama 3.1's published recipe, one frequency at a time
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            scaled.append(freq)
        elif wavelength > old / low:
            scaled.append(freq / factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
    return scaled, 1.0


def reference_yarn(
    base: list[float], theta: float, dim: int, scaling: dict[str, Any]
) -> tuple[list[float], float]:
    """YaRN's NTK-by-parts (beta_fast 32, beta_slow 1, bounds rounded outwards)."""
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]

    def pair_turning(rotations: float) -> float:  # where a pair turns this often over `old`
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_turning(32)), 0)
    high = min(math.ceil(pair_turning(1)), dim - 1)
    scaled = []
    for i, freq in enumerate(base):
        interpolated = min(max((i - low) / (high - low), 0.0), 1.0)
        scaled.append(freq / factor * interpolated + freq * (1 - interpolated))
    return scaled, 0.1 * math.log(factor) + 1


# --- the tests ---------------------------------------------------------------------------

PROMPTS = [
    [1, 5, 9, 12],
    [1, *range(3, 30)],  # longer than a step's token budget: prefilled in chunks
    [1, 40],
    [1, 7, 7, 7, 7, 7, 7, 7, 7, 7],
]
STEPS = 12


async def served_words(folder: Path, nursery: trio.Nursery, device: str = "cpu") -> list[list[str]]:
    """Each of PROMPTS completed greedily for STEPS tokens by the checkpoint in
    ``folder``, served, as words."""
    # Small blocks and a small token budget: many blocks per sequence, chunked prefill,
    # prefill chunks and decodes in one step.
    model = load_checkpoint_model(
        folder,
        "tiny_llama",
        max_model_len=64,
        num_kv_blocks=80,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        device=device,
    )
    server = await nursery.start(serve, ServerConfig(models=[model], http_port=0, grpc_port=None))
    body = {"model": "tiny_llama", "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    answers: dict[int, str] = {}
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{server.http_port}", timeout=TIMEOUT
    ) as http:

        async def complete(i: int) -> None:
            answer = await http.post("/v1/completions", json={**body, "prompt": PROMPTS[i]})
            assert answer.status_code == 200, answer.text
            answers[i] = answer.json()["choices"][0]["text"]

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as requests:  # together: batched steps
                for i in range(len(PROMPTS)):
                    requests.start_soon(complete, i)
    return [answers[i].split() for i in range(len(PROMPTS))]


def words_of(tokens: list[int]) -> list[str]:
    """Word-level tokens decode to their words, space-separated; EOS and BOS vanish."""
    return [VOCAB[t] for t in tokens if t not in (1, 2)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
async def test_served_greedy_tokens_match_the_reference(
    tmp_path: Path, nursery: trio.Nursery, variant: str
) -> None:
    config = {**BASE_CONFIG, **VARIANTS[variant]}
    tensors = write_checkpoint(tmp_path / variant, config, bf16=variant == "tied-mha")
    served = await served_words(tmp_path / variant, nursery)
    for i, prompt in enumerate(PROMPTS):
        expected = reference_greedy(tensors, config, prompt, STEPS)
        assert served[i] == words_of(expected), f"prompt {i}"


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "rope-yarn", "mistral-head-dim"])
async def test_the_gpu_forward_serves_the_reference_tokens(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    """Served with ``device="gpu"``: the GPU forward, on the numpy stand-in for cupy
    (``fake_device``: its host side, graphs and greedy tokens chosen by the model)."""
    monkeypatch.setattr(
        _checkpoint, "array_module", lambda device: fake_device if device == "gpu" else np
    )
    fake_device.state.launches = 0
    config = {**BASE_CONFIG, **VARIANTS[variant]}
    tensors = write_checkpoint(tmp_path / variant, config)
    served = await served_words(tmp_path / variant, nursery, device="gpu")
    for i, prompt in enumerate(PROMPTS):
        expected = reference_greedy(tensors, config, prompt, STEPS)
        assert served[i] == words_of(expected), f"prompt {i}"
    assert fake_device.state.launches > 0  # the GPU forward's kernels ran


def test_a_gpu_stores_a_checkpoint_in_its_own_dtype(tmp_path: Path) -> None:
    dtype = _checkpoint.gpu_dtype  # of the safetensors dtypes; integer ones do not count
    assert dtype({"F32"}) == dtype({"F32", "I64"}) == np.float32
    assert dtype({"F16"}) == dtype({"F16", "F32"}) == dtype({"F16", "BF16"}) == np.float16
    assert dtype({"BF16"}) == dtype({"BF16", "F32", "I64"}) == np.uint16  # bfloat16's bits
    assert dtype({"F64"}) == np.float16
    write_checkpoint(tmp_path, BASE_CONFIG, bf16=True)
    assert _checkpoint.stored_dtypes([tmp_path / "model.safetensors"]) == {"BF16"}


def test_tokenizer_chat_template_and_special_tokens(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, BASE_CONFIG)
    model = CheckpointLM(tmp_path, "m")
    assert model.encode("w0 w1") == [1, 3, 4]  # the tokenizer adds BOS
    assert model.encode_chat("<s>w0 w1") == [1, 3, 4]  # the template wrote it already
    assert model.decode([1, 3, 4, 2]) == "w0 w1"
    assert model.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert model.chat_template is not None and "bos_token" in model.chat_template
    assert (model.eos_token_id, model.vocab_size, model.max_model_len) == (2, 64, 128)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not served"),
        ({"rope_scaling": {"type": "longrope"}}, "rope type 'longrope' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' needs"),
        ({"rope_parameters": []}, "rope_parameters .or rope_scaling. must be an object"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_size": None}, "config.json lacks or garbles"),
    ],
)
def test_bad_checkpoints_are_refused(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    write_checkpoint(tmp_path, BASE_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps({**BASE_CONFIG, **change}))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint_model(tmp_path, "m")


def test_dynamic_rope_is_served_up_to_max_position_embeddings(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, {**BASE_CONFIG, **VARIANTS["rope-dynamic"]})
    assert CheckpointLM(tmp_path, "m", max_model_len=128).max_model_len == 128
    with pytest.raises(CheckpointError, match=r"served up to max_position_embeddings \(128 tokens"):
        CheckpointLM(tmp_path, "m", max_model_len=129)


def test_cli_checkpoint_flag(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", BASE_CONFIG)
    args = _parser().parse_args(["run", "--checkpoint", f"llama={tmp_path / 'ckpt'}"])
    [model] = config_from_args(args).models
    assert isinstance(model, CheckpointLM) and model.name == "llama"
    assert model.device == "cpu"
    on_gpu = ["run", "--checkpoint", f"llama={tmp_path / 'ckpt'}", "--checkpoint-device", "gpu"]
    [model] = config_from_args(_parser().parse_args(on_gpu)).models
    assert isinstance(model, CheckpointLM) and model.device == "gpu"
    with pytest.raises(ValueError, match="NAME=PATH"):
        config_from_args(_parser().parse_args(["run", "--checkpoint", "nopath"]))


@pytest.mark.parametrize(
    "variant",
    [
        "llama-gqa",
        "qwen2-bias",
        "rope-llama3",
        "rope-yarn",
        "rope-dynamic",
        "rope-parameters-llama3",
    ],
)
def test_matches_transformers(tmp_path: Path, variant: str) -> None:
    """The reference above against the ecosystem's own implementation."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = {**BASE_CONFIG, **VARIANTS[variant]}
    tensors = write_checkpoint(tmp_path, config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), torch_dtype=torch.float64, attn_implementation="eager"
    )
    for prompt in PROMPTS:
        expected = reference_greedy(tensors, config, prompt, STEPS)
        assert transformers_greedy(hf, prompt) == expected


@pytest.mark.parametrize("rope", ["rope-parameters-llama3", "rope-yarn"])
async def test_a_checkpoint_saved_by_transformers_serves_its_tokens(
    tmp_path: Path, nursery: trio.Nursery, rope: str
) -> None:
    """transformers writes the folder (its config.json as its version writes it: only
    ``rope_parameters`` from version 5) and generates; the server gives the same tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    settings = {**BASE_CONFIG, **VARIANTS[rope]}
    settings.pop("model_type")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()
    with torch.no_grad():  # weights as write_checkpoint draws them: large enough that
        for name, weight in hf.named_parameters():  # positions change the tokens
            if name.endswith("norm.weight"):
                weight.copy_(1 + 0.1 * torch.randn_like(weight))
            elif "embed" in name:
                weight.normal_(0, 1)
            else:
                weight.normal_(0, weight.shape[-1] ** -0.5)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    write_tokenizer(tmp_path)
    served = await served_words(tmp_path, nursery)
    for i, prompt in enumerate(PROMPTS):
        assert served[i] == words_of(transformers_greedy(hf, prompt)), f"prompt {i}"


def transformers_greedy(hf: Any, prompt: list[int]) -> list[int]:
    """STEPS tokens after ``prompt``, greedily, by a transformers model."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


# --- a checkpoint in a Triton model repository -------------------------------------------

REPOSITORY_CONFIG = """
backend: "hf_checkpoint"
parameters { key: "max_model_len" value { string_value: "64" } }
parameters { key: "num_kv_blocks" value { string_value: "40" } }
parameters { key: "block_size" value { string_value: "4" } }
parameters { key: "enable_prefix_caching" value { string_value: "false" } }
"""


def write_repository_model(repository: Path, *, in_version_folder: bool) -> dict[str, Any]:
    """``repository/llm``: config.pbtxt and the checkpoint in ``1/`` or beside it."""
    folder = repository / "llm"
    tensors = write_checkpoint(folder / "1" if in_version_folder else folder, BASE_CONFIG)
    (folder / "config.pbtxt").write_text(REPOSITORY_CONFIG)
    return tensors


def metric(text: str, line_start: str) -> float:
    [line] = [line for line in text.splitlines() if line.startswith(line_start)]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("in_version_folder", [True, False], ids=["version-folder", "model-folder"])
async def test_model_repository_serves_a_checkpoint(
    tmp_path: Path, nursery: trio.Nursery, in_version_folder: bool
) -> None:
    import openai

    tensors = write_repository_model(tmp_path / "repo", in_version_folder=in_version_folder)
    args = _parser().parse_args(["run", "--model-repository", str(tmp_path / "repo")])
    config = dataclasses.replace(config_from_args(args), http_port=0, grpc_port=None)
    server = await nursery.start(serve, config)
    base = f"http://127.0.0.1:{server.http_port}"

    def complete() -> Any:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
            return client.completions.create(
                model="llm", prompt=PROMPTS[0], max_tokens=STEPS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

    with trio.fail_after(TIMEOUT):
        answer = await trio.to_thread.run_sync(complete)
    expected = reference_greedy(tensors, BASE_CONFIG, PROMPTS[0], STEPS)
    assert answer.choices[0].text.split() == [VOCAB[t] for t in expected if t not in (1, 2)]
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as http:
        text = (await http.get("/metrics")).text
    # The engine is the one config.pbtxt sizes, and its vLLM families are exported (the
    # counts follow the engine's steps a moment after the answer: only their series).
    info = 'vllm:cache_config_info{block_size="4",cache_dtype="auto",'
    info += 'enable_prefix_caching="False",model_name="llm",num_gpu_blocks="40"}'
    assert metric(text, info) == 1
    assert (
        metric(text, 'vllm:request_success_total{finished_reason="length",model_name="llm"}') >= 0
    )


async def test_a_checkpoint_loads_and_unloads_through_the_repository_api(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    tensors = write_repository_model(tmp_path, in_version_folder=True)
    expected = reference_greedy(tensors, BASE_CONFIG, [1, 3, 4], 3)  # "w0 w1" with BOS
    config = ServerConfig(
        model_repositories=[tmp_path], model_control_mode="explicit", http_port=0, grpc_port=None
    )
    server = await nursery.start(serve, config)
    parameters = {"max_tokens": 3, "ignore_eos": True, "temperature": 0}
    body = {"text_input": "w0 w1", "parameters": parameters}
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{server.http_port}", timeout=TIMEOUT
    ) as http:
        assert (await http.post("/v2/models/llm/generate", json=body)).status_code == 404
        for _ in range(2):  # a reload joins the families the first load registered
            loaded = await http.post("/v2/repository/models/llm/load")
            assert loaded.status_code == 200, loaded.text
            generated = await http.post("/v2/models/llm/generate", json=body)
            assert generated.status_code == 200, generated.text
            words = [VOCAB[t] for t in expected if t not in (1, 2)]
            assert generated.json()["text_output"].split() == words
            text = (await http.get("/metrics")).text
            assert metric(text, 'vllm:num_requests_running{model_name="llm"}') >= 0
            assert metric(text, 'vllm:cache_config_info{block_size="4",cache_dtype="auto",') == 1
            unloaded = await http.post("/v2/repository/models/llm/unload")
            assert unloaded.status_code == 200, unloaded.text
            assert (await http.post("/v2/models/llm/generate", json=body)).status_code != 200


def test_a_checkpoint_folder_needs_no_config_pbtxt(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "llm" / "1", BASE_CONFIG)
    [model] = read_model(tmp_path / "llm", ModelRepository([]), checkpoint_loader=CheckpointLM)
    assert isinstance(model, CheckpointLM) and model.name == "llm"
    assert (model.versions, model.max_model_len, model.device) == (("1",), 128, "cpu")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('parameters { key: "max_len" value { string_value: "8" } }', "'max_len' is not known"),
        (
            'parameters { key: "num_kv_blocks" value { string_value: "many" } }',
            "'many' is not a positive integer",
        ),
        (
            'parameters { key: "enable_prefix_caching" value { string_value: "yes" } }',
            "'yes' is not true or false",
        ),
        (
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]',
            "serves the engine's own",
        ),
        (
            'parameters { key: "max_model_len" value { string_value: "4096" } }'
            'parameters { key: "num_kv_blocks" value { string_value: "2" } }',
            "exceeds the KV cache",
        ),
        ("", "tokenizer.json is missing"),
    ],
)
def test_bad_checkpoint_configs_fail_that_model(tmp_path: Path, extra: str, message: str) -> None:
    write_checkpoint(tmp_path / "llm" / "1", BASE_CONFIG)
    if not extra:
        (tmp_path / "llm" / "1" / "tokenizer.json").unlink()
    (tmp_path / "llm" / "config.pbtxt").write_text(f'backend: "hf_checkpoint"\n{extra}')
    with pytest.raises(ConfigError, match=message):
        read_model(tmp_path / "llm", ModelRepository([]), checkpoint_loader=CheckpointLM)
