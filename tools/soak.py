"""Soak: steady mixed traffic against trioserve, watching the server for leaks.

    python tools/soak.py --minutes 5 --interval 30
    python tools/soak.py --minutes 30 --rate 40 --workers 4 --json soak.json
    python tools/soak.py --url 127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --server-pid PID

Starts ``trioserve run`` (the built-in models) on free ports of 127.0.0.1, or drives a
running server, and sends ``--rate`` requests per second from ``--workers`` threads, each
with its own clients: REST JSON and binary, 1 MiB tensors over REST and gRPC, gRPC unary
and streaming (decoupled and generative), system shared memory (register, infer,
unregister), ``generate_stream`` (the LLM's, and a decoupled Python model's on its own
tensors) and OpenAI's streamed chat completions, ``/metrics``,
raw connections closed mid-request (a 1 MiB body among them) and mid-stream, gRPC calls
cancelled and timed out (``soak_traffic.py`` has one function per kind). Every
``--interval`` seconds it prints the RSS, open file descriptors and threads (from /proc)
of the server and its child processes together (``trioserve run --workers``' front ends,
model processes), the trio tasks of the server's process (the ``trioserve_tasks`` gauge
of /metrics), and the requests done so far per kind.

At the end it compares the sample taken when the warm-up ended (the first fifth of the
run, at least one interval) with the last one, and the idle server before and after the traffic, and exits 1
if RSS, descriptors or tasks grew past the thresholds, if a child process exited (one
restarted after a crash has a new process id), if any request failed in a way it should
not have, or if the server it started logged an error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from soak_traffic import KINDS, Clients

OUTCOMES = ("ok", "cancelled", "errors")
ERROR_EXAMPLES = 3  # per kind, printed at the end


@dataclass
class Sample:
    phase: str  # "idle before", "load" or "idle after"
    elapsed_s: float
    rss_mib: float  # these three: summed over the server and its child processes
    fds: int
    threads: int
    tasks: int | None  # None: the server exports no trioserve_tasks
    processes: list[int] = field(default_factory=list)  # the server's, then its children's
    done: dict[str, dict[str, int]] = field(default_factory=dict)  # outcome -> kind -> count

    def line(self) -> str:
        tasks = "-" if self.tasks is None else str(self.tasks)
        parts = [
            f"{self.elapsed_s:7.0f}s rss={self.rss_mib:.1f}MiB fds={self.fds} "
            f"threads={self.threads} tasks={tasks} processes={len(self.processes)}"
        ]
        for outcome in OUTCOMES:
            counts = self.done.get(outcome, {})
            text = " ".join(f"{kind}={n}" for kind, n in counts.items())
            parts.append(f"{outcome} {text or 'none'}")
        return " | ".join(parts)


class Tally:
    """Outcomes per kind, shared by the workers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {outcome: Counter[str]() for outcome in OUTCOMES}
        self.examples: dict[str, list[str]] = {}

    def add(self, kind: str, outcome: str, error: BaseException | None = None) -> None:
        with self._lock:
            self._counts[outcome][kind] += 1
            if error is not None:
                examples = self.examples.setdefault(kind, [])
                if len(examples) < ERROR_EXAMPLES:
                    examples.append(f"{type(error).__name__}: {error}")

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                outcome: {k: counts[k] for k in KINDS if counts[k]}
                for outcome, counts in self._counts.items()
            }


class Pacer:
    """Hands out evenly spaced start times, ``rate`` a second, to all workers; a worker
    that falls behind starts at once but never in a burst to catch up."""

    def __init__(self, rate: float) -> None:
        self._gap = 1 / rate
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self, stop: threading.Event) -> None:
        with self._lock:
            slot = max(time.monotonic(), self._next)
            self._next = slot + self._gap
        stop.wait(max(0.0, slot - time.monotonic()))


def schedule(kinds: list[str], seed: int) -> list[str]:
    """One round of ``kinds``, each as often as its weight, in a fixed shuffled order."""
    kinds = [kind for kind in kinds for _ in range(KINDS[kind][0])]
    random.Random(seed).shuffle(kinds)
    return kinds


def worker(clients: Clients, turns: itertools.cycle[str], pacer: Pacer, tally: Tally,
           stop: threading.Event) -> None:  # fmt: skip
    try:
        while True:
            pacer.wait(stop)
            if stop.is_set():
                return
            kind = next(turns)
            try:
                tally.add(kind, KINDS[kind][1](clients))
            except Exception as error:
                tally.add(kind, "errors", error)
    finally:
        clients.close()


def process_figures(pid: int) -> tuple[float, int, int]:
    """(RSS in MiB, open descriptors, threads) of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()

    def status_field(name: str) -> int:
        found = re.search(rf"^{name}:\s+(\d+)", status, re.MULTILINE)
        if found is None:  # a zombie has no VmRSS
            raise OSError(f"/proc/{pid}/status has no {name}")
        return int(found.group(1))

    rss_mib = status_field("VmRSS") / 1024
    return rss_mib, len(os.listdir(f"/proc/{pid}/fd")), status_field("Threads")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``trioserve run --workers``' workers, model processes),
    from the parent of each process in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            parent = int(stat.rpartition(")")[2].split()[1])  # the name may hold spaces
            children.setdefault(parent, []).append(int(entry))
    tree, index = [pid], 0
    while index < len(tree):
        tree += sorted(children.get(tree[index], []))
        index += 1
    return tree


def tree_figures(pid: int) -> tuple[float, int, int, list[int]]:
    """``process_figures`` summed over the process tree of ``pid``, and its processes
    (raises ``OSError`` if ``pid`` is gone)."""
    figures, alive = [process_figures(pid)], [pid]
    for child in process_tree(pid)[1:]:
        try:
            figures.append(process_figures(child))
        except OSError:  # exited since (a zombie until its parent reaps it): not counted
            continue
        alive.append(child)
    rss, fds, threads = (sum(column) for column in zip(*figures, strict=True))
    return rss, int(fds), int(threads), alive


def task_count(http_url: str) -> int | None:
    with urllib.request.urlopen(f"http://{http_url}/metrics", timeout=30) as reply:
        found = re.search(rb"^trioserve_tasks (\S+)$", reply.read(), re.M)
    return None if found is None else int(float(found.group(1)))


def sample(phase: str, pid: int, http_url: str, started: float, tally: Tally) -> Sample:
    try:
        rss, fds, threads, tree = tree_figures(pid)  # before the scrape opens a connection
        tasks = task_count(http_url)
    except OSError as error:
        raise SystemExit(f"soak: FAIL: the server is gone ({error})") from None
    elapsed = time.monotonic() - started
    return Sample(phase, elapsed, rss, fds, threads, tasks, tree, tally.snapshot())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    python: str, extra: list[str], log: Any
) -> tuple[subprocess.Popen[bytes], str, str]:
    http, grpc = free_port(), free_port()
    command = [python, "-m", "trioserve", "run", "--host", "127.0.0.1",
               "--http-port", str(http), "--grpc-port", str(grpc), "--log-level", "warning",
               *extra]  # fmt: skip
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    http_url = f"127.0.0.1:{http}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=2):
                return server, http_url, f"127.0.0.1:{grpc}"
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise SystemExit("soak: the server did not become ready") from None
            time.sleep(0.2)  # a tool polling a server it started


def stop_server(server: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then SIGKILL if it has not exited in 60 s; its exit status."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        return server.wait()


def idle_sample(phase: str, pid: int, http_url: str, started: float, tally: Tally) -> Sample:
    """A sample of the server with no traffic, after a pause for the connections the
    clients closed to end on the server's side too."""
    time.sleep(1)
    return sample(phase, pid, http_url, started, tally)


def growth(label: str, before: Sample, after: Sample, limits: dict[str, float]) -> list[str]:
    """Prints the figures of two samples; returns those that grew past their limit."""
    print(f"soak: {label}")
    failures = []
    for name in ("rss_mib", "fds", "threads", "tasks"):
        first, last = getattr(before, name), getattr(after, name)
        if first is None or last is None:
            print(f"  {name:8} not exported")
            continue
        grew, limit = last - first, limits.get(name)
        judged = "not judged" if limit is None else f"limit {limit:g}"
        print(f"  {name:8} {first:8.1f} -> {last:8.1f}  growth {grew:+7.1f}  ({judged})")
        if limit is not None and grew > limit:
            failures.append(f"{name} grew by {grew:.1f} ({label})")
    return failures


def soak(
    args: argparse.Namespace, pid: int, http_url: str, grpc_url: str
) -> tuple[list[Sample], list[str]]:
    host, http_port = http_url.rsplit(":", 1)
    grpc_port = int(grpc_url.rsplit(":", 1)[1])
    tally = Tally()
    before = idle_sample("idle before", pid, http_url, time.monotonic(), tally)
    print(f"soak: idle before the traffic: {before.line()}", flush=True)
    stop = threading.Event()
    turns = itertools.cycle(schedule(args.kinds, args.seed))
    pacer = Pacer(args.rate)
    threads = [
        threading.Thread(
            target=worker,
            args=(Clients(host, int(http_port), grpc_port, i), turns, pacer, tally, stop),
            daemon=True,
        )
        for i in range(args.workers)
    ]
    for thread in threads:
        thread.start()
    duration = args.minutes * 60
    warmup_ends = max(duration / 5, args.interval)
    started = time.monotonic()
    under_load: list[Sample] = []
    try:
        for tick in itertools.count(1):
            at = started + min(tick * args.interval, duration)
            time.sleep(max(0.0, at - time.monotonic()))
            under_load.append(sample("load", pid, http_url, started, tally))
            print(under_load[-1].line(), flush=True)
            if at >= started + duration:
                break
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    after = idle_sample("idle after", pid, http_url, started, tally)
    print(f"soak: idle after the traffic: {after.line()}")
    warm = next((s for s in under_load if s.elapsed_s >= warmup_ends), under_load[-1])
    limits = {"rss_mib": args.max_rss_growth_mib, "fds": args.max_fd_growth,
              "tasks": args.max_task_growth}  # fmt: skip
    label = f"warm-up end ({warm.elapsed_s:.0f} s) -> end, under load"
    failures = growth(label, warm, under_load[-1], limits)
    # Idle, descriptors and tasks come back to where they were; memory warms up meanwhile.
    idle_limits = {name: limits[name] for name in ("fds", "tasks")}
    failures += growth("idle before -> idle after the traffic", before, after, idle_limits)
    # A child process that crashed is restarted: the count holds, its process id does not.
    if exited := [str(p) for p in before.processes if p not in after.processes]:
        failures.append(f"the server's processes {', '.join(exited)} exited during the soak")
    done = after.done
    for kind in args.kinds:
        if not done.get("ok", {}).get(kind) and not done.get("cancelled", {}).get(kind):
            failures.append(f"no {kind} request completed")
    for kind, count in done.get("errors", {}).items():
        failures.append(f"{count} unexpected {kind} errors, e.g. {tally.examples[kind]}")
    return [before, *under_load, after], failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long the traffic runs")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--rate", type=float, default=40.0, help="requests a second, all kinds")
    parser.add_argument("--workers", type=int, default=4, help="client threads")
    parser.add_argument("--url", help="a running server's HTTP host:port")
    parser.add_argument("--grpc-url", help="a running server's gRPC host:port")
    parser.add_argument("--server-pid", type=int, help="a running server's process id")
    parser.add_argument("--server-python", default=sys.executable,
                        help="the interpreter that runs the server this tool starts")  # fmt: skip
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the server this tool starts (repeatable), e.g. "
        "--server-arg=--http-server --server-arg=hypercorn",
    )
    parser.add_argument("--max-rss-growth-mib", type=float, default=50.0)
    parser.add_argument("--max-fd-growth", type=int, default=10)
    parser.add_argument("--max-task-growth", type=int, default=50)
    parser.add_argument(
        "--kinds",
        type=lambda text: text.split(","),
        default=list(KINDS),
        metavar="KIND,...",
        help=f"only these kinds of requests (default all: {', '.join(KINDS)})",
    )
    parser.add_argument("--seed", type=int, default=0, help="orders the kinds of requests")
    parser.add_argument("--json", type=Path, help="write the samples and the verdict here")
    args = parser.parse_args()
    if unknown := set(args.kinds) - set(KINDS):
        parser.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    given = (args.url, args.grpc_url, args.server_pid)
    if any(x is not None for x in given) and None in given:
        parser.error("--url, --grpc-url and --server-pid go together")
    with tempfile.TemporaryFile() as log:
        server = None
        if args.url is None:
            server, http_url, grpc_url = start_server(args.server_python, args.server_arg, log)
            pid = server.pid
        else:
            http_url, grpc_url, pid = args.url, args.grpc_url, args.server_pid
        try:
            samples, failures = soak(args, pid, http_url, grpc_url)
        finally:
            if server is not None:
                stop_server(server)
        log.seek(0)
        logged = log.read().decode(errors="replace")
    errors = [line for line in logged.splitlines() if " ERROR " in line or "Traceback" in line]
    warnings = [line for line in logged.splitlines() if " WARNING " in line]
    if warnings:
        print(f"soak: the server logged {len(warnings)} warnings, first: {warnings[0]}")
    if errors:
        failures.append(f"the server logged {len(errors)} errors, first: {errors[0]}")
    if args.json is not None:
        document = {"samples": [asdict(s) for s in samples], "failures": failures}
        args.json.write_text(json.dumps(document, indent=1))
    for failure in failures:
        print(f"soak: FAIL: {failure}")
    print("soak: FAIL" if failures else "soak: PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
