"""CPU time the core process spends per forwarded inference, its link alone, with the
worker's end in a process of its own: on the core's CPU or on another, idle between
frames or busy as a worker is. What the placement costs the same work on this machine.

    python tools/core_link_time.py
    python tools/core_link_time.py --per-frame 8 --worker-work-us 0,1500 --rounds 3

The core's end of a link (``WorkerLink``, the built-in ``simple`` model behind it, the
cyclic collector tuned as ``trioserve run`` tunes the core's) runs in this process; a
forked process plays the worker: it writes a frame of ``--per-frame`` INFERs (alike ones
as one INFERS, as a worker writes them: ``core_link_count.infers_frame``), reads their
ANSWERs, and before its next frame spends ``--worker-work-us`` of CPU in Python, walking
``--worker-rows`` lists of 256 ints over and over (256: about half a MiB of objects, as a
worker's protocol work touches; a few: hardly any memory).
Each placement runs twice, 200 and 200 + ``--frames`` frames; the difference of the
core's CPU time (user and system) over the extra inferences is the figure, without
start-up. "same CPU" pins both processes to the last CPU this process may use (a worker
and the core sharing a core, as ``workers_bench.py`` runs them); "other CPU" pins the
worker to the first, so the core's CPU sleeps while the worker works (left out where
there is one CPU). Linux only (``os.sched_setaffinity``).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time
from functools import partial

from core_link_count import answered_in, infers_frame

_FEW = 200  # frames of the shorter run, whose time is taken out


def _worker(
    sock: socket.socket, frame: bytes, per_frame: int, frames: int, work_s: float, rows: int
) -> None:
    from trioserve.ipc import FrameReader

    reader = FrameReader()
    walked = [list(range(256)) for _ in range(rows)]
    for _ in range(frames):
        sock.sendall(frame)
        answered = 0
        while answered < per_frame:
            for message, _ in reader.feed(sock.recv(262144)):
                answered += answered_in(message)
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            for row in walked:
                sum(row)


def _core(sock: socket.socket, started: int) -> float:
    """Serve the link until the worker closes it; the CPU seconds that took."""
    import trio

    from trioserve import _gc
    from trioserve.ipc import TrioChannel
    from trioserve.models import reference_zoo
    from trioserve.testing import open_test_server
    from trioserve.workers._core_link import WorkerLink

    async def main() -> float:
        models = [model for model in reference_zoo() if model.name == "simple"]
        async with open_test_server(models) as server:
            assert server.context is not None
            link = WorkerLink(TrioChannel(sock), server.context, server.rest_app, {})
            _gc.tune()
            os.write(started, b"!")  # the worker's first frame comes now
            before = resource.getrusage(resource.RUSAGE_SELF)
            await link.serve([])  # returns once the worker closed the link
            after = resource.getrusage(resource.RUSAGE_SELF)
        return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    return trio.run(main)


def _run(
    per_frame: int, frames: int, core_cpu: int, worker_cpu: int, work_s: float, rows: int
) -> float:
    core_end, worker_end = socket.socketpair()
    wait_start, started = os.pipe()
    frame = infers_frame(per_frame)
    pid = os.fork()
    if pid == 0:  # the worker
        status = 1
        try:
            core_end.close()
            os.close(started)  # the core's alone: it closing unstarted is an end of file
            os.sched_setaffinity(0, {worker_cpu})
            if os.read(wait_start, 1):
                _worker(worker_end, frame, per_frame, frames, work_s, rows)
            status = 0
        finally:
            os._exit(status)
    worker_end.close()
    os.close(wait_start)
    os.sched_setaffinity(0, {core_cpu})
    try:
        spent = _core(core_end, started)
    finally:
        os.close(started)  # a core that failed before its start lets the worker go
        _, status = os.waitpid(pid, 0)
    if status != 0:
        raise SystemExit(f"the worker process failed (wait status {status})")
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-frame", type=int, default=8, help="INFERs in each frame")
    parser.add_argument("--frames", type=int, default=1500, help="frames counted")
    parser.add_argument(
        "--worker-work-us",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[0, 1500],
        metavar="US,...",
        help="the worker's CPU time between frames, in µs",
    )
    parser.add_argument("--worker-rows", type=int, default=256, help="lists the worker walks")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    core_cpu = cpus[-1]
    placements = (
        {"same CPU": core_cpu, "other CPU": cpus[0]} if len(cpus) > 1 else {"same CPU": core_cpu}
    )
    for number in range(1, args.rounds + 1):
        for work_us in args.worker_work_us:
            for name, worker_cpu in placements.items():
                run = partial(_run, args.per_frame, core_cpu=core_cpu, worker_cpu=worker_cpu,
                              work_s=work_us / 1e6, rows=args.worker_rows)  # fmt: skip
                few, many = run(frames=_FEW), run(frames=_FEW + args.frames)
                each = (many - few) / (args.frames * args.per_frame)
                print(
                    f"round {number}: worker on the {name}, {work_us} µs of work a frame: "
                    f"the core spends {each * 1e6:.1f} µs per inference",
                    flush=True,
                )


if __name__ == "__main__":
    main()
