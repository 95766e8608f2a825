"""What the process transport (``trioserve.ipc``) costs: round trips to a child process.

The parent (trio) sends a control frame naming a block of its arena; the child (a
blocking thread, as a model process reads) maps it, answers with a block of its own
arena holding the same bytes doubled-up in place (a write of the whole tensor), and
the parent frees its block. Reported per tensor size and calls in flight: round trips
per second, microseconds of parent CPU per call, and MB/s of tensor bytes.

    python tools/ipc_bench.py --sizes 64,1048576,16777216 --in-flight 1,8 --seconds 3
"""

from __future__ import annotations

import argparse
import resource
import sys
import textwrap
import time

import numpy as np
import trio

from trioserve.ipc import Arena, Replies, SegmentMap, TrioChannel, channel_pair

_CHILD = textwrap.dedent(
    """
    import socket, sys
    from trioserve.ipc import Arena, BlockingChannel, SegmentMap
    channel = BlockingChannel(socket.socket(fileno=int(sys.argv[1])))
    theirs, mine, held = SegmentMap(), Arena(1 << 20, 1 << 20), {}
    while True:
        (call, segments, block, done), fds = channel.receive()
        for (segment, size), fd in zip(segments, fds):
            theirs.add(segment, fd, size)
        for old in done:
            mine.free(held.pop(old))
        if call is None:
            break
        answer = mine.allocate(block.size)
        mine.view(answer)[:] = theirs.view(block)
        held[call] = answer
        fresh = mine.unannounced([answer])
        channel.send((call, [(s, n) for s, _, n in fresh], answer), [fd for _, fd, _ in fresh])
    """
)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(size: int, in_flight: int, seconds: float) -> dict[str, float]:
    parent, child = channel_pair()
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", _CHILD, str(child.fileno())], pass_fds=[child.fileno()]
    )
    child.close()
    channel = TrioChannel(parent)
    arena, answers, replies = Arena(1 << 20, 1 << 20), SegmentMap(), Replies[object]()
    payload = np.random.default_rng(0).bytes(size)
    done: list[int] = []
    calls = 0

    async def receive_loop() -> None:
        while True:
            for (call, segments, block), fds in await channel.receive():
                for (segment, mapped), fd in zip(segments, fds, strict=True):
                    answers.add(segment, fd, mapped)
                replies.deliver(call, block)

    async def caller(deadline: float) -> None:
        nonlocal calls
        while time.monotonic() < deadline:
            block = arena.write(payload)
            call, answer = replies.open()
            fresh = arena.unannounced([block])
            release, done[:] = list(done), []
            await channel.send(
                (call, [(s, n) for s, _, n in fresh], block, release), [fd for _, fd, _ in fresh]
            )
            reply = await answer.receive()
            assert answers.view(reply)[:1] == payload[:1]  # type: ignore[arg-type]
            arena.free(block)
            done.append(call)
            calls += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_loop)
        start, cpu = time.monotonic(), _cpu()
        async with trio.open_nursery() as callers:
            for _ in range(in_flight):
                callers.start_soon(caller, start + seconds)
        elapsed, cpu = time.monotonic() - start, _cpu() - cpu
        nursery.cancel_scope.cancel()
    await channel.send((None, [], None, []))
    await process.wait()
    channel.close()
    return {
        "calls_per_s": calls / elapsed,
        "parent_cpu_us_per_call": cpu / calls * 1e6,
        "mb_per_s": calls * size / elapsed / 1e6,
        "frames_per_write": channel.frames_sent / channel.writes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,1048576,16777216")
    parser.add_argument("--in-flight", default="1,8")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]} ({sys.executable})")
    for size in (int(s) for s in args.sizes.split(",")):
        for in_flight in (int(n) for n in args.in_flight.split(",")):
            got = trio.run(_measure, size, in_flight, args.seconds)
            print(
                f"size={size:>9} in_flight={in_flight:>3}  {got['calls_per_s']:>9.0f} calls/s  "
                f"{got['parent_cpu_us_per_call']:>7.1f} us parent CPU/call  "
                f"{got['mb_per_s']:>8.0f} MB/s  {got['frames_per_write']:.1f} frames/write"
            )


if __name__ == "__main__":
    main()
