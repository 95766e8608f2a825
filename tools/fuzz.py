"""The long fuzzing run: the properties of ``tests/test_fuzz*.py`` with many random examples.

    python tools/fuzz.py --minutes 5
    python tools/fuzz.py --minutes 60 --examples 2000

Runs the fuzz test modules in rounds until the time is up, each round with a fresh random
seed and ``--examples`` examples per property (the test suite runs the same properties
with a few derandomized examples). Stops after the first round that fails and prints its
report: hypothesis shrinks each failing input and prints it; ``--seed`` replays that round.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [ROOT / "tests" / "test_fuzz.py", ROOT / "tests" / "test_fuzz_parameters.py"]


def run_round(examples: int, seed: int) -> tuple[bool, str]:
    env = {**os.environ, "TRIOSERVE_FUZZ_EXAMPLES": str(examples)}
    command = [
        sys.executable, "-m", "pytest", *map(str, TESTS), "-q", "-p", "no:cacheprovider",
        f"--hypothesis-seed={seed}", "--hypothesis-show-statistics",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    return done.returncode == 0, done.stdout + done.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz")
    parser.add_argument("--examples", type=int, default=500, help="examples per property per round")
    parser.add_argument("--seed", type=int, help="run one round with this seed")
    args = parser.parse_args()
    deadline = time.monotonic() + args.minutes * 60
    rounds = 0
    while True:
        seed = args.seed if args.seed is not None else random.randrange(2**32)
        started = time.monotonic()
        passed, output = run_round(args.examples, seed)
        rounds += 1
        took = time.monotonic() - started
        print(f"round {rounds}: seed {seed}, {args.examples} examples per property, "
              f"{took:.0f} s: {'passed' if passed else 'FAILED'}", flush=True)  # fmt: skip
        if not passed:
            print(output)
            return 1
        if args.seed is not None or time.monotonic() + took > deadline:
            print(f"{rounds} rounds, {rounds * args.examples} examples per property, no failure")
            return 0


if __name__ == "__main__":
    sys.exit(main())
