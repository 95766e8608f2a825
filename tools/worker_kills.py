"""Workers killed under load: ``trioserve run --workers 2`` must lose only their calls.

    python tools/worker_kills.py --kills 12 --every 2 --threads 3
    python tools/worker_kills.py --kills 4 --json kills.json --server-python /usr/bin/python3

Starts ``trioserve run --workers 2`` (the built-in models) on free ports of 127.0.0.1 and
sends it ``--threads`` streams of requests, one at a time each: ``identity_fp32`` on
1 MiB over REST and gRPC (its tensors travel in the shared-memory arenas' blocks) and
``simple`` over REST (``soak_traffic.py``'s ``large_tensor`` and ``rest_json``). Every
``--every`` seconds it kills one of the workers, the two in turn, with SIGKILL, and waits
for the core to start its successor. Requests in flight on a killed worker fail; the
tool counts them and judges nothing of them but that an answer is never wrong.

It exits 1 if the core process did not live through the kills, a worker was not
replaced, an answer was wrong, no request was answered after the last kill, the core's
descriptors or trio tasks after the traffic exceed those before it (idle both times,
after a warm-up of the same traffic), the core holds more shared-memory segments than it
has workers, the core logged a traceback, or the server did not exit 0 on SIGTERM.

The segments are counted apart from the other descriptors: the core gives each worker's
link an arena whose first segment (64 MiB) is made when an answer first needs a block, so
whether a worker has one yet depends on which worker the kernel handed the connections
to. This traffic never needs a second segment, so one per live worker is the bound; the
arenas of killed workers must be closed with their links.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from soak import process_figures, process_tree, start_server, stop_server, task_count
from soak_traffic import Clients, large_tensor, rest_json

WORKERS = 2
REPLACED_WITHIN_S = 60.0
KINDS = (large_tensor, large_tensor, rest_json)
SEGMENT_LINK = "/memfd:trioserve-ipc"  # how /proc names an arena segment's descriptor


class Traffic:
    """Client threads, each sending one request after another until stopped."""

    def __init__(self, http: int, grpc: int, threads: int) -> None:
        self._ports = (http, grpc)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.answered = self.failed = 0
        self.wrong: list[str] = []
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
        turn = 0
        try:
            while not self._stop.is_set():
                turn += 1
                try:
                    KINDS[turn % len(KINDS)](clients)
                except AssertionError as wrong:  # an answer, and not the right one
                    with self._lock:
                        self.wrong.append(str(wrong))
                except Exception:  # its worker was killed: a fresh connection next
                    with self._lock:
                        self.failed += 1
                    clients.close()
                    clients = Clients("127.0.0.1", *self._ports, index)
                else:
                    with self._lock:
                        self.answered += 1
        finally:
            clients.close()


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


def arena_segments(pid: int) -> int:
    """How many of the process's descriptors are shared-memory arena segments."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SEGMENT_LINK)
        except OSError:  # closed meanwhile
            continue
    return count


def core_figures(core: int, http: int) -> dict[str, Any]:
    rss_mib, fds, _ = process_figures(core)
    segments = arena_segments(core)
    return {
        "rss_mib": round(rss_mib, 1), "fds": fds - segments, "segments": segments,
        "tasks": task_count(f"127.0.0.1:{http}"),
    }  # fmt: skip


def kill_workers(args: argparse.Namespace, core: int, http: int, grpc: int) -> dict[str, Any]:
    """Warm up, sample the idle core, kill workers under traffic, sample it idle again."""
    failures = []
    if not serving(core, WORKERS):  # the ports answer once one worker serves
        return {"failures": ["the workers did not start"]}
    with Traffic(http, grpc, args.threads):
        time.sleep(args.every)  # the arenas and connections grown as the traffic needs
    time.sleep(1)  # the connections the clients closed, ended on the server's side too
    before = core_figures(core, http)
    answered_before_last = 0
    with Traffic(http, grpc, args.threads) as traffic:
        for kill in range(args.kills):
            time.sleep(args.every)
            victim = workers_of(core)[kill % WORKERS]
            os.kill(victim, signal.SIGKILL)
            if not serving(core, WORKERS, gone=victim):
                failures.append(f"worker {victim} was not replaced")
                break
            answered_before_last = traffic.answered
        time.sleep(args.every)
    if traffic.answered == answered_before_last:
        failures.append("no request was answered after the last kill")
    failures += [f"a wrong answer: {wrong}" for wrong in traffic.wrong[:3]]
    time.sleep(1)
    after = core_figures(core, http)
    for name in ("fds", "tasks"):
        if after[name] > before[name]:
            failures.append(f"the core's {name} grew from {before[name]} to {after[name]}")
    if after["segments"] > WORKERS:
        failures.append(f"the core holds {after['segments']} segments for {WORKERS} workers")
    return {
        "kills": args.kills, "answered": traffic.answered, "failed": traffic.failed,
        "wrong": len(traffic.wrong), "before": before, "after": after, "failures": failures,
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
