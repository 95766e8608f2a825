"""Write a Hugging Face tokenizer folder that counts tokens as ``tiny_lm`` does: one
token per UTF-8 byte, no special tokens.

    python tools/tokenizer_folder.py DIR

LLM benchmarks (aiperf, genai-perf) count prompt and output tokens with a Hugging Face
tokenizer they load by name or from a folder; pointed at DIR they need no network and
count what the built-in model counts. Needs the ``tokenizers`` package (the extra
``trioserve[checkpoints]``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE without merges: each byte of the text is one token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # a character for each byte
    tokenizer = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    sample = "Hello, wörld"
    count = len(tokenizer.encode(sample).ids)
    assert count == len(sample.encode()), count
    print(f"wrote {folder}: {tokenizer.get_vocab_size()} tokens, one per byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
