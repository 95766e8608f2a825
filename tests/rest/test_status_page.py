"""The status page in a real browser: headless Chromium loads it from a live server, runs
its script, and the test reads the rendered DOM (and takes a screenshot).

Skipped where no ``chromium`` is installed (``.ci/run`` installs Debian's).
"""

from __future__ import annotations

import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioserve import Server, ServerConfig, serve
from trioserve._cli import _parser, config_from_args
from trioserve.models import TinyLM, reference_zoo

from .._model_repository import write_model

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (Debian package)")

SIMPLE = {
    "inputs": [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
        for n in ("INPUT0", "INPUT1")
    ]
}
FAIL = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [1]}]}
GENERATE = {"text_input": "hello", "parameters": {"max_tokens": 4}}


class RenderedPage(HTMLParser):
    """What the rendered DOM shows: the model rows' cells by ``data-field``, the text and
    attributes of elements with an id, and whether any cell holds markup."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.by_id: dict[str, dict[str, str | None]] = {}
        self.text_of: dict[str, str] = {}
        self.body: dict[str, str | None] = {}
        self.markup_in_cells = False
        self._row: dict[str, str] | None = None
        self._field: str | None = None
        self._open_id: str | None = None
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "body":
            self.body = attributes
        if tag == "tr" and "data-model" in attributes:
            self._row = self.rows[attributes["data-model"] or ""] = {}
        elif self._field is not None:
            self.markup_in_cells = True
        if tag == "td" and self._row is not None:
            self._field = attributes["data-field"]
            self._row[self._field or ""] = ""
        if attributes.get("id"):
            self._open_id = attributes["id"]
            self.by_id[self._open_id] = attributes
            self.text_of[self._open_id] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._field = None
        elif tag == "tr":
            self._row = None
        self._open_id = None

    def handle_data(self, data: str) -> None:
        if self._row is not None and self._field is not None:
            self._row[self._field] += data
        if self._open_id is not None:
            self.text_of[self._open_id] += data


async def chromium(url: str, profile: Path, *flags: str) -> bytes:
    """Run headless Chromium on ``url``; ``--virtual-time-budget`` lets the page's script
    run (and poll a few times) before Chromium dumps or shoots."""
    assert CHROMIUM is not None
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        f"--user-data-dir={profile}", "--virtual-time-budget=3000", *flags, url,
    ]  # fmt: skip
    with trio.fail_after(60):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
    return done.stdout


async def rendered(url: str, tmp_path: Path) -> RenderedPage:
    dom = await chromium(url, tmp_path / "profile", "--dump-dom")
    return RenderedPage(dom.decode())


async def start(nursery: trio.Nursery, **settings: Any) -> str:
    config = ServerConfig(http_port=0, grpc_port=None, **settings)
    server: Server = await nursery.start(serve, config)
    return f"http://127.0.0.1:{server.http_port}"


IDENTITY_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
"""
IDENTITY_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]
            )
            for r in requests
        ]
"""


def write_repository(root: Path) -> None:
    """Models ``good`` and ``late`` answer; ``broken``'s config.pbtxt does not parse."""
    for name in ("good", "broken", "late"):
        config = IDENTITY_CONFIG.format(name=name) if name != "broken" else "input [ {"
        write_model(root, name, config, IDENTITY_MODEL)


def served_models() -> list[Any]:
    zoo = {m.name: m for m in reference_zoo()}
    return [zoo["simple"], zoo["fail"], TinyLM(num_kv_blocks=64)]


@needs_chromium
async def test_models_and_live_figures(nursery: trio.Nursery, tmp_path: Path) -> None:
    base = await start(nursery, models=served_models())
    async with httpx.AsyncClient(base_url=base) as http:
        assert (await http.get("/status.json")).status_code == 200  # the rates' first sample
        for _ in range(5):
            assert (await http.post("/v2/models/simple/infer", json=SIMPLE)).status_code == 200
        for _ in range(2):
            assert (await http.post("/v2/models/fail/infer", json=FAIL)).status_code == 500
        assert (await http.post("/v2/models/tiny_lm/generate", json=GENERATE)).status_code == 200
    page = await rendered(f"{base}/status", tmp_path)
    assert int(page.body["data-updates"] or 0) >= 2  # it polled and rendered again
    assert page.text_of["ready"] == "ready"
    assert page.text_of["connection"].startswith("live, rates over ")
    assert "hidden" in page.by_id["no-models"]
    assert list(page.rows) == ["simple", "fail", "tiny_lm"]
    simple, fail, lm = page.rows["simple"], page.rows["fail"], page.rows["tiny_lm"]
    assert (simple["kind"], simple["state"], simple["counts"]) == ("tensor", "READY", "5 / 0")
    assert float(simple["rps"]) > 0
    p50, p90, p99 = (float(v) for v in simple["latency"].removesuffix(" ms").split(" / "))
    assert 0 < p50 <= p90 <= p99
    assert simple["load"].endswith(" s")
    assert (fail["counts"], fail["latency"]) == ("0 / 2", "\u2013")
    assert float(fail["fps"]) > 0
    assert (lm["kind"], lm["counts"], lm["running"], lm["kv"]) == (
        "generative", "1 / 0", "0 / 0", "0.0 %",
    )  # fmt: skip
    # Generative models have the server's latency histograms too: percentiles, not a mean.
    p50, p90, p99 = (float(v) for v in lm["latency"].removesuffix(" ms").split(" / "))
    assert 0 < p50 <= p90 <= p99

    shot = tmp_path / "status.png"
    await chromium(
        f"{base}/", tmp_path / "profile", "--window-size=1400,500", f"--screenshot={shot}"
    )
    assert shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert shot.stat().st_size > 10_000  # a rendered table, not a blank page


@needs_chromium
async def test_no_models(nursery: trio.Nursery, tmp_path: Path) -> None:
    base = await start(nursery, models=[])
    page = await rendered(f"{base}/", tmp_path)
    assert page.rows == {}
    assert page.text_of["no-models"] == "No models are served."
    assert "hidden" not in page.by_id["no-models"]
    assert "hidden" in page.by_id["models"]
    assert page.text_of["ready"] == "ready"


@needs_chromium
async def test_model_names_are_text_not_markup(nursery: trio.Nursery, tmp_path: Path) -> None:
    (identity,) = [m for m in reference_zoo() if m.name == "identity_fp32"]
    identity.name = "<img src=x onerror=alert(1)>"
    base = await start(nursery, models=[identity])
    page = await rendered(f"{base}/", tmp_path)
    assert list(page.rows) == ["<img src=x onerror=alert(1)>"]
    assert not page.markup_in_cells


@needs_chromium
async def test_under_load(nursery: trio.Nursery, tmp_path: Path) -> None:
    base = await start(nursery, models=served_models())
    finished = {"simple": 0, "tiny_lm": 0}
    stop = trio.Event()  # clients finish the request they are in, then leave

    async def client(path: str, body: dict[str, Any], model: str) -> None:
        async with httpx.AsyncClient(base_url=base) as http:
            while not stop.is_set():
                assert (await http.post(path, json=body)).status_code == 200
                finished[model] += 1

    async with trio.open_nursery() as load:
        for _ in range(4):
            load.start_soon(client, "/v2/models/simple/infer", SIMPLE, "simple")
        for _ in range(2):
            load.start_soon(client, "/v2/models/tiny_lm/generate", GENERATE, "tiny_lm")
        page = await rendered(f"{base}/status", tmp_path)
        stop.set()
    assert int(page.body["data-updates"] or 0) >= 2
    simple, lm = page.rows["simple"], page.rows["tiny_lm"]
    succeeded, failed = (int(v) for v in simple["counts"].split(" / "))
    assert 0 < succeeded <= finished["simple"] and failed == 0
    assert float(simple["rps"]) > 0
    running, waiting = (int(v) for v in lm["running"].split(" / "))
    assert running + waiting <= 2  # two clients, one request each at a time
    assert 0 <= float(lm["kv"].removesuffix(" %")) <= 100


@needs_chromium
async def test_failed_and_loaded_at_runtime(nursery: trio.Nursery, tmp_path: Path) -> None:
    write_repository(tmp_path / "models")
    base = await start(
        nursery,
        model_repositories=[tmp_path / "models"],
        model_control_mode="explicit",
        load_models=["good", "broken"],
    )
    page = await rendered(f"{base}/", tmp_path)
    assert list(page.rows) == ["good", "broken", "late"]
    good, broken, late = page.rows["good"], page.rows["broken"], page.rows["late"]
    assert (good["version"], good["state"], good["counts"], good["reason"]) == (
        "1",
        "READY",
        "0 / 0",
        "",
    )
    assert (broken["version"], broken["state"], broken["counts"]) == (
        "\u2013",
        "UNAVAILABLE",
        "\u2013",
    )
    assert "config.pbtxt" in broken["reason"]
    assert (late["state"], late["reason"]) == ("NOT LOADED", "")

    async with httpx.AsyncClient(base_url=base) as http:
        index = (await http.post("/v2/repository/index", json={})).json()
        assert {
            "name": "broken",
            "version": "",
            "state": "UNAVAILABLE",
            "reason": broken["reason"],
        } in index
        assert (await http.post("/v2/repository/models/late/load")).status_code == 200
    page = await rendered(f"{base}/status", tmp_path)
    assert list(page.rows) == ["good", "late", "broken"]
    late = page.rows["late"]
    assert (late["version"], late["state"], late["counts"]) == ("1", "READY", "0 / 0")
    assert late["load"].endswith(" s")
    assert page.rows["broken"]["state"] == "UNAVAILABLE"


async def test_turned_off(nursery: trio.Nursery) -> None:
    base = await start(nursery, models=[], status_page=False)
    async with httpx.AsyncClient(base_url=base) as http:
        for path in ("/", "/status", "/status.json"):
            assert (await http.get(path)).status_code == 404
        assert (await http.get("/v2/health/live")).status_code == 200


def test_flag() -> None:
    run = _parser()
    assert config_from_args(run.parse_args(["run"])).status_page is True
    off = run.parse_args(["run", "--allow-status-page", "false"])
    assert config_from_args(off).status_page is False


async def test_page_and_document_answers(nursery: trio.Nursery) -> None:
    base = await start(nursery, models=served_models())
    async with httpx.AsyncClient(base_url=base) as http:
        for path in ("/", "/status"):
            page = await http.get(path)
            assert page.headers["content-type"] == "text/html; charset=utf-8"
            assert page.headers["cache-control"] == "no-store"
            assert b'fetch("status.json"' in page.content
        document = (await http.get("/status.json")).json()
        assert [m["name"] for m in document["models"]] == ["simple", "fail", "tiny_lm"]
        assert (await http.post("/")).status_code == 405
