"""``tools/tokenizer_folder.py``: the folder it writes loads as a Hugging Face tokenizer
and counts tokens exactly as ``tiny_lm`` does, so benchmarks report the model's lengths."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer

from trioserve.models import TinyLM

TOOL = Path(__file__).resolve().parent.parent / "tools" / "tokenizer_folder.py"
TEXTS = ["", "Hello", "Hello, wörld", "日本語のテキスト", "tabs\tand\nnewlines  ", "🙂" * 5]


def test_the_folder_counts_as_tiny_lm(tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    subprocess.run([sys.executable, str(TOOL), str(folder)], check=True, capture_output=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 256
    model = TinyLM(num_kv_blocks=64)
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert len(ids) == len(model.encode(text)), text
        assert tokenizer.decode(ids) == text
