"""Instructions the core process executes per forwarded inference, its link alone,
counted by valgrind's callgrind: the core's per-request work bounds what any number of
front-end workers can serve. Runs of one build usually differ by up to 2%, now and
then by 10% (trio's scheduler shuffles its batches at random), so compare builds over
several rounds.

    python tools/core_link_count.py /path/to/old/src src --rounds 2
    python tools/core_link_count.py src --per-frame 64

In one process, the core's end of a worker's link (``WorkerLink``, the built-in
``simple`` model behind it) is fed frames of ``--per-frame`` INFERs, as a worker's
coalesced writes carry them under load (about 6 at 8 connections, 60 at 64; alike ones
merged into INFERS, as the worker merges them, where the build does), and their
ANSWERs are read back; the cyclic collector is tuned as ``trioserve run`` tunes the
core's (``_gc.tune``: rare young collections). Each build runs twice under callgrind,
``--warm-up`` frames and then 50 or 50 + ``--frames`` more; the difference of the two
counts over the extra inferences is the figure, without start-up and warm-up. The
worker's end (reading the ANSWERs; the INFER frame is pickled once) is counted too,
alike for every build. Builds alternate within each round. Needs ``valgrind`` (apt).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys


def infers_frame(per_frame: int) -> bytes:
    """One frame of ``per_frame`` INFERs of ``simple``, as a worker writes them."""
    import numpy as np

    from trioserve.ipc import encode_frames
    from trioserve.workers._wire import INFER

    data = np.arange(16, dtype=np.int32).reshape(1, 16).tobytes()
    inputs = [(name, "INT32", (1, 16), data, {}) for name in ("INPUT0", "INPUT1")]
    infers = [
        (INFER, -call, "HTTP end point", "simple", "", "", {}, inputs, [], None, None)
        for call in range(1, per_frame + 1)
    ]
    written = [(message, []) for message in infers]
    try:  # as the worker writes them: alike INFERs as one INFERS
        from trioserve.workers._coalesce import grouped
    except ImportError:  # a build before INFERS: as they are
        pass
    else:
        written = grouped(written)
    return encode_frames(written)[0]


def answered_in(message: tuple[object, ...]) -> int:
    """How many INFERs an ANSWER message answers (a tuple of calls: an OUTCOME of all)."""
    from trioserve.workers._wire import ANSWER

    assert message[0] == ANSWER, message
    calls = message[1]
    assert isinstance(calls, list)
    return sum(len(call) if type(call) is tuple else 1 for call, _, _ in calls)


def _serve(per_frame: int, frames: int, warm_up: int) -> None:
    """The measured run (``--serve``): the link, fed ``warm_up`` then ``frames`` frames."""
    import trio

    from trioserve import _gc
    from trioserve.ipc import TrioChannel, channel_pair
    from trioserve.models import reference_zoo
    from trioserve.testing import open_test_server
    from trioserve.workers._core_link import WorkerLink

    frame = infers_frame(per_frame)

    async def main() -> None:
        models = [model for model in reference_zoo() if model.name == "simple"]
        async with open_test_server(models) as server, trio.open_nursery() as nursery:
            core, worker = channel_pair()
            assert server.context is not None
            link = WorkerLink(TrioChannel(core), server.context, server.rest_app, {})
            nursery.start_soon(link.serve, [])
            _gc.tune()  # as ``trioserve run`` tunes the core's collector once it serves
            answers = TrioChannel(worker)
            for _ in range(warm_up + frames):
                worker.send(frame)  # one write (the socket is empty): read whole
                answered = 0
                while answered < per_frame:
                    for message, _ in await answers.receive():
                        answered += answered_in(message)
            nursery.cancel_scope.cancel()

    trio.run(main)


def _count(python: str, src: str, per_frame: int, frames: int, warm_up: int) -> int:
    """Instructions of one run under callgrind."""
    command = [
        "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", python, __file__,
        "--serve", "--per-frame", str(per_frame), "--frames", str(frames),
        "--warm-up", str(warm_up),
    ]  # fmt: skip
    # One hash seed for every run: the dicts' layouts, hence their probes, alike.
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), PYTHONHASHSEED="0")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count:\n{done.stderr}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("srcs", nargs="*", help="each build's src folder")
    parser.add_argument("--per-frame", type=int, default=16, help="INFERs in each frame")
    parser.add_argument("--frames", type=int, default=200, help="frames counted")
    parser.add_argument("--warm-up", type=int, default=50, help="frames before them")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.per_frame, args.frames, args.warm_up)
        return
    for number in range(args.rounds):
        for src in args.srcs:
            short = _count(args.python, src, args.per_frame, 50, args.warm_up)
            long = _count(args.python, src, args.per_frame, 50 + args.frames, args.warm_up)
            each = (long - short) / (args.frames * args.per_frame)
            print(f"round {number + 1}: {src}: {each:,.0f} instructions per inference", flush=True)


if __name__ == "__main__":
    main()
