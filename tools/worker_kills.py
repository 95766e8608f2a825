"""Workers killed under load: ``trioserve run --workers 2`` must lose only their calls.

    python tools/worker_kills.py --kills 12 --every 2 --threads 3
    python tools/worker_kills.py --kills 4 --json kills.json --server-python /usr/bin/python3

Starts ``trioserve run --workers 2`` (the built-in models) on free ports of 127.0.0.1 and
sends it ``--threads`` streams of requests, one at a time each, in turn of
``soak_traffic.py``'s kinds: ``identity_fp32`` on 1 MiB over REST and gRPC (its tensors
travel in the shared-memory arenas' blocks), ``simple`` over REST and through a
registered shared-memory region, the decoupled ``repeat_int32`` over a gRPC stream, and
``tiny_lm``'s streams (``generate_stream``, OpenAI's chat completions, ModelStreamInfer).
Every ``--every`` seconds it kills one of the workers, the two in turn, with SIGKILL, and
waits for the core to start its successor.

A request in flight on a killed worker fails, and its thread starts new connections. So
each kill excuses one failure per thread, whenever it comes (a connection to the killed
worker that lay idle in a client's pool fails only when the thread next uses it), and
any more only within ``GRACE_S`` of the kill (grpcio shares a connection among channels
to one target, so a thread's fresh client can still meet the dying one). A failure
before the first kill (the warm-up's among them) or past those is unexcused. A stream
cut short is a failure; a stream that ends as if complete but is not, or any other
wrong answer, is wrong.

It exits 1 if the core process did not live through the kills, a worker was not
replaced, an answer was wrong, a failure was unexcused, no request was answered after
the last kill, the core's descriptors or trio tasks after the traffic exceed those
before it (idle both times, after a warm-up of the same traffic and once the regions a
killed client left registered are unregistered), the core holds more of its worker
links' shared-memory segments than it has workers, the core logged a traceback, or the
server did not exit 0 on SIGTERM.

The worker links' segments are counted apart from the other descriptors: the core gives
each link an arena whose first segment (64 MiB) is made when an answer first needs a
block, so whether a worker has one yet depends on which worker the kernel handed the
connections to. This traffic never needs a second segment, so one per live worker is the
bound; the arenas of killed workers must be closed with their links.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import tritonclient.http as httpclient

from soak import process_figures, process_tree, start_server, stop_server, task_count
from soak_traffic import (
    Clients,
    generate_stream,
    grpc_stream,
    grpc_stream_llm,
    large_tensor,
    openai_chat_stream,
    rest_json,
    shared_memory,
)
from trioserve.workers._wire import ARENA_LABEL

WORKERS = 2
REPLACED_WITHIN_S = 60.0
GRACE_S = 0.5  # how soon after a kill its in-flight clients fail (measured: within 0.1 s)
KINDS = (large_tensor, rest_json, grpc_stream, large_tensor, generate_stream, shared_memory,
         openai_chat_stream, grpc_stream_llm)  # fmt: skip
SEGMENT = f"/memfd:{ARENA_LABEL} (deleted)"  # how /proc names a link segment's descriptor


class Traffic:
    """Client threads, each sending one request after another until stopped."""

    def __init__(self, http: int, grpc: int, threads: int) -> None:
        self._ports = (http, grpc)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.answered = 0
        self.wrong: list[str] = []
        self.failures: list[tuple[float, int, str]] = []  # (when, which thread, what)
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _run(self, index: int) -> None:
        clients = Clients("127.0.0.1", *self._ports, index)
        turn = index  # the threads at different kinds
        try:
            while not self._stop.is_set():
                turn += 1
                kind = KINDS[turn % len(KINDS)]
                try:
                    kind(clients)
                except AssertionError as wrong:  # an answer, and not the right one
                    with self._lock:
                        self.wrong.append(f"{kind.__name__}: {wrong}")
                except Exception as error:  # its worker was killed: fresh connections next
                    with self._lock:
                        what = f"{kind.__name__}: {type(error).__name__}: {error}"
                        self.failures.append((time.monotonic(), index, what))
                    fresh = Clients("127.0.0.1", *self._ports, index)
                    fresh.serial = clients.serial  # its regions' names stay unique
                    clients.close()
                    clients = fresh
                else:
                    with self._lock:
                        self.answered += 1
        finally:
            clients.close()


def unexcused(failures: list[tuple[float, int, str]], kills: list[float]) -> list[str]:
    """The failures that no kill explains: before the first kill, or a thread's second
    (or later) after the last kill before it and more than ``GRACE_S`` after that kill."""
    found = []
    excused: set[tuple[int, float]] = set()  # (thread, kill): the kill's free failure taken
    for when, thread, what in sorted(failures):
        kill = last_kill(when, kills)
        if kill is None:
            found.append(f"{what} (thread {thread}, before any kill)")
        elif (thread, kill) not in excused:
            excused.add((thread, kill))
        elif when - kill > GRACE_S:
            found.append(f"{what} (thread {thread}, again {when - kill:.2f} s after a kill)")
    return found


def last_kill(when: float, kills: list[float]) -> float | None:
    """The last kill at or before ``when``; None if none was."""
    return max((kill for kill in kills if kill <= when), default=None)


def workers_of(core: int) -> list[int]:
    """The core's front-end workers (its children running ``trioserve.workers``)."""
    found = []
    for pid in process_tree(core)[1:]:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"trioserve.workers" in command:
            found.append(pid)
    return found


def serving(core: int, count: int, gone: int | None = None) -> bool:
    """Whether the core runs ``count`` workers, ``gone`` not among them, within 60 s."""
    deadline = time.monotonic() + REPLACED_WITHIN_S
    while time.monotonic() < deadline:
        workers = workers_of(core)
        if len(workers) == count and gone not in workers:
            return True
        time.sleep(0.05)  # a tool polling the processes of a server it started
    return False


def descriptor_kinds(pid: int) -> Counter[str]:
    """The process's descriptors by what /proc says they are (``socket``,
    ``anon_inode:[pidfd]``, a memory file's label...), without their inode numbers."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            kinds[re.sub(r":\[\d+\]$", "", os.readlink(f"/proc/{pid}/fd/{fd}"))] += 1
        except OSError:  # closed meanwhile
            continue
    return kinds


def core_figures(core: int, http: int) -> dict[str, Any]:
    rss_mib, _, _ = process_figures(core)
    kinds = descriptor_kinds(core)
    segments = kinds[SEGMENT]
    return {
        "rss_mib": round(rss_mib, 1), "fds": kinds.total() - segments, "segments": segments,
        "tasks": task_count(f"127.0.0.1:{http}"), "descriptors": dict(kinds),
    }  # fmt: skip


def unregister_regions(http: int) -> None:
    """Unregister the regions the clients of killed workers left registered."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
    try:
        client.unregister_system_shared_memory()
    finally:
        client.close()


def grown(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What the idle core holds after the kills that it did not before."""
    found = []
    if after["fds"] > before["fds"]:
        kinds = {kind: count for kind, count in after["descriptors"].items()
                 if kind != SEGMENT and count > before["descriptors"].get(kind, 0)}  # fmt: skip
        found.append(f"the core's fds grew from {before['fds']} to {after['fds']} ({kinds})")
    if after["tasks"] > before["tasks"]:
        found.append(f"the core's tasks grew from {before['tasks']} to {after['tasks']}")
    if after["segments"] > WORKERS:
        found.append(f"the core holds {after['segments']} segments for {WORKERS} workers")
    return found


def kill_workers(args: argparse.Namespace, core: int, http: int, grpc: int) -> dict[str, Any]:
    """Warm up, sample the idle core, kill workers under traffic, sample it idle again."""
    failures = []
    if not serving(core, WORKERS):  # the ports answer once one worker serves
        return {"failures": ["the workers did not start"]}
    with Traffic(http, grpc, args.threads) as warm_up:
        time.sleep(args.every)  # the arenas and connections grown as the traffic needs
    time.sleep(1)  # the connections the clients closed, ended on the server's side too
    before = core_figures(core, http)
    answered_before_last = 0
    kills: list[float] = []
    with Traffic(http, grpc, args.threads) as traffic:
        for kill in range(args.kills):
            time.sleep(args.every)
            victim = workers_of(core)[kill % WORKERS]
            kills.append(time.monotonic())
            os.kill(victim, signal.SIGKILL)
            if not serving(core, WORKERS, gone=victim):
                failures.append(f"worker {victim} was not replaced")
                break
            answered_before_last = traffic.answered
        time.sleep(args.every)
    if traffic.answered == answered_before_last:
        failures.append("no request was answered after the last kill")
    wrong = warm_up.wrong + traffic.wrong
    failures += [f"a wrong answer: {answer}" for answer in wrong[:3]]
    lost = unexcused(warm_up.failures, []) + unexcused(traffic.failures, kills)
    failures += [f"an unexcused failure: {failure}" for failure in lost[:3]]
    unregister_regions(http)
    time.sleep(1)
    after = core_figures(core, http)
    failures += grown(before, after)
    delays = [
        when - kill
        for when, _, _ in traffic.failures
        if (kill := last_kill(when, kills)) is not None
    ]
    return {
        "kills": args.kills, "answered": traffic.answered, "failed": len(traffic.failures),
        "latest_failure_s": round(max(delays, default=0.0), 3),
        "unexcused": len(lost), "wrong": len(wrong), "before": before, "after": after,
        "failures": failures,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--threads", type=int, default=3, help="client threads")
    parser.add_argument("--server-python", default=sys.executable)
    parser.add_argument("--json", type=Path, help="write the figures and the verdict here")
    args = parser.parse_args()
    with tempfile.TemporaryFile() as log:
        server, http_url, grpc_url = start_server(
            args.server_python, ["--workers", str(WORKERS)], log
        )
        http, grpc = (int(url.rsplit(":", 1)[1]) for url in (http_url, grpc_url))
        try:
            report = kill_workers(args, server.pid, http, grpc)
        except OSError as gone:  # the core's /proc entry, or its HTTP port
            report = {"failures": [f"the core process is gone ({gone})"]}
        finally:
            status = stop_server(server)
        log.seek(0)
        logged = log.read().decode(errors="replace")
    if status != 0:
        report["failures"].append(f"the server exited with status {status}")
    if "Traceback" in logged:
        report["failures"].append("the server logged a traceback:\n" + logged[-3000:])
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}))
    for failure in report["failures"]:
        print(f"worker_kills: FAIL: {failure}")
    print("worker_kills: FAIL" if report["failures"] else "worker_kills: PASS")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
