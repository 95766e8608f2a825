"""``trioserve run --workers 2``: draining on SIGTERM, a killed worker restarted while
the other serves on, the core's death stopping every worker, connection limits shared
out and their refusals summed (real processes)."""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trioserve.ipc import TrioChannel, channel_pair, encode_frames
from trioserve.workers._pool import _until_ready
from trioserve.workers._wire import HTTP, READY

from ._served import TIMEOUT, Served

_DELAY = "/v2/models/delay/infer"


def _delay_body(milliseconds: float) -> dict[str, object]:
    return {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [milliseconds]}]
    }


def _forwarded(served: Served) -> float:
    return sum(served.metric(f'trioserve_worker_calls_total{{worker="{n}"}}') for n in (0, 1))


def test_sigterm_drains_every_worker() -> None:
    served = Served()
    try:
        answers: list[int] = []

        def slow() -> None:
            reply = httpx.post(
                f"http://{served.url}{_DELAY}", json=_delay_body(1000), timeout=TIMEOUT
            )
            answers.append(reply.status_code)

        request = threading.Thread(target=slow)
        request.start()
        while _forwarded(served) < 1:  # in flight in the core
            pass
        served.process.send_signal(signal.SIGTERM)
        served.wait_for("received SIGTERM: draining")
        request.join(timeout=TIMEOUT)
        assert answers == [200]  # answered, then the server went
        assert served.process.wait(timeout=TIMEOUT) == 0
        served.wait_log_closed()  # the workers exited too
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{served.url}/v2/health/live", timeout=TIMEOUT)
    finally:
        served.stop()


def test_with_workers_every_process_of_the_server_runs_as_batch() -> None:
    served = Served()
    try:
        children = served.child_pids()
        assert len(children) > 2  # the workers and the Python models' processes
        policies = {pid: os.sched_getscheduler(pid) for pid in [served.process.pid, *children]}
        assert set(policies.values()) == {os.SCHED_BATCH}, policies
    finally:
        served.stop()


def test_one_process_runs_with_the_usual_policy() -> None:
    served = Served(workers=0)
    try:
        assert os.sched_getscheduler(served.process.pid) == os.SCHED_OTHER
    finally:
        served.stop()


def test_a_killed_worker_is_restarted_and_the_other_serves_on() -> None:
    served = Served()
    try:
        # Keep-alive connections spread over both workers (raw sockets: a client library
        # would quietly reconnect).
        connections = [socket.create_connection(("127.0.0.1", served.http)) for _ in range(12)]
        for sock in connections:
            assert _live(sock)
        victim = served.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        served.wait_for(rf"front-end worker \d \(pid {victim}\) exited with status -9")
        kept = [_live(sock) for sock in connections]
        assert any(kept) and not all(kept)  # the other worker's connections serve on
        # New connections all succeed: those the kernel gives the restarting worker wait
        # in its listening socket's backlog, which the core kept open.
        for _ in range(12):
            assert (
                httpx.get(f"http://{served.url}/v2/health/ready", timeout=TIMEOUT).status_code
                == 200
            )
        served.wait_for(r"front-end worker \d \(pid \d+\) serving")
        assert served.metric("trioserve_worker_restarts_total") == 1
        assert len(served.worker_pids()) == 2 and victim not in served.worker_pids()
        for sock in connections:
            sock.close()
    finally:
        assert served.stop() == 0


def _live(sock: socket.socket) -> bool:
    """One request on a keep-alive connection: answered 200, or the connection is dead."""
    try:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
        return sock.recv(65536).startswith(b"HTTP/1.1 200")
    except ConnectionError:
        return False


def test_the_core_dying_stops_every_worker_with_a_message() -> None:
    served = Served()
    try:
        assert len(served.worker_pids()) == 2
        served.process.kill()
        served.wait_log_closed()  # every process that held the log has exited
        gone = [line for line in served.log if "the core process is gone" in line]
        assert len(gone) == 2
        assert not [line for line in served.log if "Traceback" in line]  # a message only
    finally:
        served.stop()


def test_the_connection_limit_is_shared_and_its_refusals_summed() -> None:
    served = Served("--http-max-connections", "2")  # one per worker
    try:
        # The kernel spreads connections by their ports: with 24, each worker gets some
        # (all on one: a chance of 2 in 2**24). Each asks as it connects; those over a
        # worker's share are answered 503 or, waiting quietly, closed to make room.
        statuses = []
        sockets = []
        for _ in range(24):
            sock = socket.create_connection(("127.0.0.1", served.http))
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
            sockets.append(sock)
        for sock in sockets:
            try:
                answer = sock.recv(65536)
            except ConnectionResetError:  # closed with the request unread
                answer = b""
            statuses.append(answer.split(b" ", 2)[1] if answer else b"closed")
        for sock in sockets:
            sock.close()
        refused = statuses.count(b"503")
        assert statuses.count(b"200") == 2  # one connection per worker
        assert refused + statuses.count(b"closed") == 22
        assert served.metric("trioserve_http_refused_connections_total") == refused
    finally:
        assert served.stop() == 0


@pytest.mark.parametrize("module", [httpclient, grpcclient])
def test_a_full_worker_arena_refuses_the_request_and_recovers(module: Any) -> None:
    """Past --worker-arena-max-bytes a request is refused (503, UNAVAILABLE) in the worker
    (before the core sees it), whatever its inputs already took is given back, and
    requests that fit go on being served."""
    served = Served("--worker-arena-max-bytes", str(1024 * 1024), workers=1)
    try:
        url = served.url if module is httpclient else served.grpc_url
        binary = {"binary_data": True} if module is httpclient else {}
        fits = np.arange(96 * 1024, dtype=np.float32)  # 384 KiB
        with module.InferenceServerClient(url) as client:
            for _ in range(3):  # nothing of the refused request stays in the arena
                inputs = []
                for name in ("INPUT0", "INPUT1"):  # 768 KiB, then 2 MiB more: too many
                    data = fits if name == "INPUT0" else np.zeros(512 * 1024, np.float32)
                    tensor = module.InferInput(name, [data.size], "FP32")
                    tensor.set_data_from_numpy(data, **binary)
                    inputs.append(tensor)
                with pytest.raises(InferenceServerException) as refused:
                    client.infer("identity_fp32", inputs)
                assert "--worker-arena-max-bytes" in str(refused.value)
                assert refused.value.status() in ("503", "StatusCode.UNAVAILABLE")
                tensor = module.InferInput("INPUT0", [fits.size], "FP32")
                tensor.set_data_from_numpy(fits, **binary)
                answer = client.infer("identity_fp32", [tensor]).as_numpy("OUTPUT0")
                np.testing.assert_array_equal(answer, fits)
    finally:
        assert served.stop() == 0


async def test_calls_a_starting_worker_sends_before_its_ready_are_served() -> None:
    """A restarted worker accepts the connections waiting in its backlog as each front
    end starts, before it says READY: the core keeps those calls for its link."""
    core_end, worker_end = channel_pair()
    core, worker = TrioChannel(core_end), TrioChannel(worker_end)
    early = (HTTP, 1, "GET", "/v2/health/ready", b"", [], b"")
    data, _ = encode_frames([(early, []), ((READY,), [])])
    worker_end.send(data[:10])  # the first frame cut short
    worker_end.send(data[10:])
    assert await _until_ready(core) == [(early, [])]
    core.close()
    worker.close()
