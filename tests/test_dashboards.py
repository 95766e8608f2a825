"""deploy/grafana/: every panel's query returns data from a real Prometheus scraping a live
trioserve under mixed traffic.

Prometheus (Debian's ``prometheus`` package; the test skips without it) scrapes the
server every second; the test then asks Prometheus's HTTP API each panel's query, with
Grafana's variables set to "all", until every query answers at least one finite value.
GPU panels are expected empty where the server exports no GPU families.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioserve import Server, ServerConfig, serve
from trioserve.models import TinyLM, reference_zoo

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="needs prometheus (Debian package)")

DASHBOARDS = sorted((Path(__file__).parent.parent / "deploy" / "grafana").glob("*.json"))
RATE_WINDOW = "30s"  # what Grafana's $__rate_interval stands for here (1 s scrapes)
SIMPLE = {
    "inputs": [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
        for n in ("INPUT0", "INPUT1")
    ]
}


def panel_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every target, variables set to "all"."""
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_WINDOW)
            for variable in dashboard["templating"]["list"]:
                expr = expr.replace(f"${variable['name']}", ".*")
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            yield panel["title"], expr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_dashboards_are_grafana_json() -> None:
    assert [d.name for d in DASHBOARDS] == ["trioserve-generative.json", "trioserve-tensor.json"]
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["panels"]
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        for panel in dashboard["panels"]:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]


async def traffic(base: str, stop: trio.Event) -> None:
    """Mixed: tensor requests, batched delays, failures, and generations that share a
    prompt prefix (prefix-cache hits), until ``stop``; each client finishes the request
    it is in."""

    async def loop(path: str, body: dict[str, Any], pause_s: float = 0.0) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            while not stop.is_set():
                await http.post(path, json=body)
                await trio.sleep(pause_s)  # pacing, so failures do not flood the log

    prompt = "The quick brown fox jumps over the lazy dog, " * 3
    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop, "/v2/models/simple/infer", SIMPLE)
        delay = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [2]}]}
        for _ in range(3):
            nursery.start_soon(loop, "/v2/models/delay/infer", delay)
        fail = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [1]}]}
        nursery.start_soon(loop, "/v2/models/fail/infer", fail, 0.2)
        for tail in ("one", "two"):
            generate = {"text_input": prompt + tail, "parameters": {"max_tokens": 8}}
            nursery.start_soon(loop, "/v2/models/tiny_lm/generate", generate)


async def test_every_panel_query_returns_data(nursery: trio.Nursery, tmp_path: Path) -> None:
    config = ServerConfig(
        models=[*reference_zoo(), TinyLM(num_kv_blocks=256)], http_port=0, grpc_port=None
    )
    server: Server = await nursery.start(serve, config)
    assert server.registry is not None
    exported = {family.name for family in server.registry.collect()}
    has_gpu = "nv_gpu_utilization" in exported

    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: trioserve\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{server.http_port}']}}]\n"
    )
    web = f"127.0.0.1:{free_port()}"
    assert PROMETHEUS is not None
    command = [
        PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address={web}",
        "--log.level=warn",
    ]  # fmt: skip
    run = partial(trio.run_process, command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prometheus = await nursery.start(run)
    pending = {
        (path.name, title, expr)
        for path in DASHBOARDS
        for title, expr in panel_queries(json.loads(path.read_text()))
        if has_gpu or "nv_gpu_" not in expr
    }
    assert len(pending) >= 30
    stop = trio.Event()
    async with trio.open_nursery() as clients:
        clients.start_soon(traffic, f"http://127.0.0.1:{server.http_port}", stop)
        with trio.move_on_after(90):
            async with httpx.AsyncClient(base_url=f"http://{web}") as api:
                while pending:
                    await trio.sleep(1)  # the next scrape; Prometheus cannot be awaited
                    for query in sorted(pending):
                        if await answers(api, query[2]):
                            pending.discard(query)
        stop.set()
    prometheus.terminate()
    assert not pending, f"no data for: {sorted(pending)}"


async def answers(api: httpx.AsyncClient, expr: str) -> bool:
    """Whether Prometheus answers ``expr`` (valid, or the test fails) with a finite value."""
    try:
        reply = await api.get("/api/v1/query", params={"query": expr})
    except httpx.TransportError:
        return False  # still starting
    if reply.status_code == 503:
        return False  # not ready yet
    body = reply.json()
    assert body["status"] == "success", f"{expr}: {body}"
    return any(math.isfinite(float(s["value"][1])) for s in body["data"]["result"])
