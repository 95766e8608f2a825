"""Round robin against ORCA-weighted balancing, on trioserve replicas of unequal capacity.

    python tools/orca_balance.py                               # 3 replicas: 4, 2, 1 instances
    python tools/orca_balance.py --instances 4,1 --rate 150 --duration 20

Each replica is a ``trioserve run`` process on 127.0.0.1 serving one model, ``work``,
whose every request costs ``--cost-ms`` of waiting (a sleep, so the CPU noise of a shared
machine barely moves the capacity) on ``instance_count`` instances: a replica with N
instances serves at most N * 1000 / cost-ms requests per second.

A client in this process sends an open-loop stream of ``--rate`` requests per second
(evenly spaced) through a client-side balancer, once per policy, each time against
fresh replicas:

- ``round-robin``: every replica in turn.
- ``orca-weighted``: Envoy's client-side weighted round robin. Every response carries
  ``endpoint-load-metrics: JSON {...}`` (asked for with
  ``endpoint-load-metrics-format: json``); a report sets the replica's weight to
  ``rps_fractional / (utilization + eps / rps_fractional * penalty)``, where utilization
  is ``application_utilization``, or ``cpu_utilization`` when that is 0. Every second the
  weights are applied: a replica's weight counts once it has reported for ``--blackout``
  seconds (Envoy's default is 10 s) and until its last report is ``--expiry`` seconds
  old; the others get the median of the valid weights. Picks follow the weights by
  earliest deadline first, as Envoy's scheduler does.

Prints, per policy, the throughput and the latency (p50, p99) of the requests sent in the
measured window (after ``--warmup``), and each replica's share of them.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

MODEL_PY = """
import trio
import trioserve

@trioserve.model(
    name="work",
    inputs=[trioserve.TensorSpec("X", "FP32", [1])],
    outputs=[trioserve.TensorSpec("Y", "FP32", [1])],
    instance_count={instances},
)
async def model(X):
    await trio.sleep({cost_s})
    return {{"Y": X}}
"""

BODY = json.dumps(
    {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
).encode()


# --- the replicas ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            url = f"http://127.0.0.1:{port}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)  # a tool polling a server it started; not a test
    raise RuntimeError(f"replica on port {port} did not become ready")


@contextmanager
def replica(workdir: Path, instances: int, cost_ms: float) -> Iterator[int]:
    """A ``trioserve run`` process serving ``work`` with ``instances``; yields its port."""
    repository = workdir / f"replica-{instances}-{_free_port()}"
    (repository / "work").mkdir(parents=True)
    (repository / "work" / "model.py").write_text(
        MODEL_PY.format(instances=instances, cost_s=cost_ms / 1000)
    )
    port = _free_port()
    command = [
        sys.executable, "-m", "trioserve", "run", "--model-repository", str(repository),
        "--host", "127.0.0.1", "--http-port", str(port), "--allow-grpc", "false",
        "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command)
    try:
        _wait_ready(port)
        yield port
    finally:
        process.terminate()  # this replica's PID only
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- a small HTTP/1.1 client ------------------------------------------------------------


class Upstream:
    """One replica: a pool of keep-alive connections to it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._idle: list[trio.SocketStream] = []
        self._request = (
            b"POST /v2/models/work/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nEndpoint-Load-Metrics-Format: json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(BODY)
        ) + BODY

    async def infer(self) -> dict[str, str]:
        """One request; the response's headers (lower-case names)."""
        stream = (
            self._idle.pop() if self._idle else await trio.open_tcp_stream("127.0.0.1", self.port)
        )
        await stream.send_all(self._request)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += await _receive(stream)
        head, _, body = buffer.partition(b"\r\n\r\n")
        status, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        remaining = int(headers["content-length"]) - len(body)
        while remaining > 0:
            remaining -= len(await _receive(stream))
        if status.split()[1] != "200":
            raise RuntimeError(f"replica {self.port} answered {status}")
        self._idle.append(stream)
        return headers

    async def aclose(self) -> None:
        for stream in self._idle:
            await stream.aclose()


async def _receive(stream: trio.SocketStream) -> bytes:
    data = await stream.receive_some(65536)
    if not data:
        raise RuntimeError("the replica closed the connection")
    return data


# --- the balancers ----------------------------------------------------------------------


class RoundRobin:
    name = "round-robin"

    def __init__(self, count: int) -> None:
        self._count = count
        self._next = 0

    def pick(self) -> int:
        chosen = self._next
        self._next = (self._next + 1) % self._count
        return chosen

    def on_report(self, host: int, report: dict[str, float], now: float) -> None:
        pass

    def update(self, now: float) -> None:
        pass

    def describe(self) -> str:
        return ""


@dataclass
class _HostWeight:
    weight: float | None = None  # from the latest usable report
    non_empty_since: float | None = None  # when reports began (reset when they expire)
    last_update: float = -math.inf


@dataclass
class OrcaWeighted:
    """Envoy's client_side_weighted_round_robin, per-request reports only."""

    count: int
    blackout_s: float
    expiry_s: float
    penalty: float
    name: str = "orca-weighted"
    hosts: list[_HostWeight] = field(default_factory=list)
    applied: list[float] = field(default_factory=list)
    _schedule: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hosts = [_HostWeight() for _ in range(self.count)]
        self.applied = [1.0] * self.count
        self._schedule = [(0.0, i) for i in range(self.count)]

    def on_report(self, host: int, report: dict[str, float], now: float) -> None:
        qps = report.get("rps_fractional", 0.0)
        if qps <= 0:
            return  # Envoy: "QPS must be positive"
        utilization = report.get("application_utilization", 0.0)
        if utilization <= 0:
            utilization = report.get("cpu_utilization", 0.0)
        utilization += self.penalty * report.get("eps", 0.0) / qps
        if utilization <= 0:
            return  # Envoy: "Utilization must be positive"
        state = self.hosts[host]
        state.weight = min(qps / utilization, 2.0**32 - 1)
        if state.non_empty_since is None:
            state.non_empty_since = now
        state.last_update = now

    def update(self, now: float) -> None:
        """What Envoy does every weight_update_period (1 s)."""
        valid: dict[int, float] = {}
        for i, state in enumerate(self.hosts):
            if state.last_update < now - self.expiry_s:
                state.non_empty_since = None  # expired: blackout again when reports resume
            elif (
                state.weight is not None
                and state.non_empty_since is not None
                and state.non_empty_since <= now - self.blackout_s
            ):
                valid[i] = state.weight
        weights = sorted(valid.values())
        default = weights[len(weights) // 2] if weights else 1.0
        self.applied = [valid.get(i, default) for i in range(self.count)]
        self._schedule = [(1.0 / w, i) for i, w in enumerate(self.applied)]
        heapq.heapify(self._schedule)

    def pick(self) -> int:
        """Earliest deadline first: each pick moves the host's deadline by 1 / weight."""
        deadline, host = heapq.heappop(self._schedule)
        heapq.heappush(self._schedule, (deadline + 1.0 / self.applied[host], host))
        return host

    def describe(self) -> str:
        total = sum(self.applied)
        return "weights " + "/".join(f"{w / total:.2f}" for w in self.applied)


Balancer = RoundRobin | OrcaWeighted


# --- one run ----------------------------------------------------------------------------


@dataclass
class Sample:
    sent_at: float
    host: int
    latency_s: float | None = None  # None: not answered (an error)
    done_at: float | None = None


async def drive(ports: list[int], balancer: Balancer, args: argparse.Namespace) -> str:
    upstreams = [Upstream(port) for port in ports]
    samples: list[Sample] = []
    start = trio.current_time()
    window = (start + args.warmup, start + args.warmup + args.duration)

    async def one(sample: Sample) -> None:
        try:
            headers = await upstreams[sample.host].infer()
        except (OSError, RuntimeError, trio.BrokenResourceError) as exc:
            print(f"  request to replica {sample.host} failed: {exc}", file=sys.stderr)
            return
        now = trio.current_time()
        sample.latency_s, sample.done_at = now - sample.sent_at, now
        value = headers.get("endpoint-load-metrics", "")
        if value.startswith("JSON "):
            balancer.on_report(sample.host, json.loads(value[5:]), now)

    async def weights() -> None:
        while True:
            await trio.sleep(1.0)
            balancer.update(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(weights)
        async with trio.open_nursery() as requests:
            interval = 1.0 / args.rate
            for n in range(math.ceil((args.warmup + args.duration) * args.rate)):
                await trio.sleep_until(start + n * interval)
                sample = Sample(trio.current_time(), balancer.pick())
                samples.append(sample)
                requests.start_soon(one, sample)
        nursery.cancel_scope.cancel()
    for upstream in upstreams:
        await upstream.aclose()

    measured = [s for s in samples if window[0] <= s.sent_at < window[1]]
    latencies = sorted(s.latency_s for s in measured if s.latency_s is not None)
    completed = sum(
        1 for s in samples if s.done_at is not None and window[0] <= s.done_at < window[1]
    )
    shares = "/".join(
        f"{100 * sum(1 for s in measured if s.host == i) / len(measured):.0f}%"
        for i in range(len(ports))
    )
    return (
        f"{balancer.name:<14} {completed / args.duration:7.1f} req/s   "
        f"p50 {_percentile(latencies, 50) * 1000:8.1f} ms   "
        f"p99 {_percentile(latencies, 99) * 1000:8.1f} ms   "
        f"errors {len(measured) - len(latencies)}   share {shares}   {balancer.describe()}"
    )


def _percentile(ordered: list[float], p: float) -> float:
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", default="4,2,1", help="instances per replica")
    parser.add_argument("--cost-ms", type=float, default=20.0, help="time per request")
    parser.add_argument("--rate", type=float, default=210.0, help="requests per second sent")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds measured")
    parser.add_argument("--blackout", type=float, default=3.0, help="Envoy blackout_period")
    parser.add_argument("--expiry", type=float, default=180.0, help="weight_expiration_period")
    parser.add_argument("--penalty", type=float, default=1.0, help="error_utilization_penalty")
    parser.add_argument("--policies", default="round-robin,orca-weighted")
    args = parser.parse_args()
    instances = [int(n) for n in args.instances.split(",")]
    capacity = [n * 1000 / args.cost_ms for n in instances]
    print(
        f"replicas: {instances} instances x {args.cost_ms:g} ms = capacity "
        f"{'/'.join(f'{c:.0f}' for c in capacity)} req/s (total {sum(capacity):.0f}, shares "
        f"{'/'.join(f'{c / sum(capacity):.2f}' for c in capacity)}); "
        f"sending {args.rate:g} req/s; {os.cpu_count()} CPUs on this machine"
    )
    for policy in args.policies.split(","):
        balancer: Balancer = (
            RoundRobin(len(instances))
            if policy == "round-robin"
            else OrcaWeighted(len(instances), args.blackout, args.expiry, args.penalty)
        )
        with tempfile.TemporaryDirectory() as workdir, ExitStack() as stack:
            ports = [
                stack.enter_context(replica(Path(workdir), n, args.cost_ms)) for n in instances
            ]
            print(trio.run(drive, ports, balancer, args), flush=True)


if __name__ == "__main__":
    main()
