from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from trioserve import (
    InternalError,
    InvalidArgumentError,
    Server,
    ServerConfig,
    UnsupportedError,
)
from trioserve._alternatives import FrontEndUnavailable, grpclib_server
from trioserve.models import reference_zoo
from trioserve.testing import server_in_thread

from ._fuzzing import ErrorRecords
from ._model_repository import write_model

HTTP_SERVERS = ["builtin", "hypercorn"]
GRPC_SERVERS = ["builtin", "grpclib"]


def _grpclib_unavailable() -> str | None:
    """Why the grpclib front end cannot serve on this Python, or None where it can.
    Asked before any test module is collected: the import that answers is the one that
    silences trio-asyncio's own deprecation warning, so tests that import the front end's
    module directly find it imported."""
    try:
        grpclib_server()
    except FrontEndUnavailable as exc:
        return str(exc)
    return None


GRPCLIB_UNAVAILABLE = _grpclib_unavailable()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests of the grpclib front end (their ids name it) skip where it cannot serve:
    trio-asyncio needs asyncio names that Python 3.14 removed."""
    reason = GRPCLIB_UNAVAILABLE
    if reason is None:
        return
    for item in items:
        if "grpclib" in item.nodeid:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(params=GRPC_SERVERS)
def grpc_server(request: pytest.FixtureRequest) -> str:
    """Each gRPC front end (``ServerConfig.grpc_server``): the gRPC tests run on both."""
    return str(request.param)


@pytest.fixture
def start_grpc(nursery: trio.Nursery) -> Callable[[Any], Awaitable[int]]:
    """Starts the gRPC front end a server context's config names; returns its port."""
    from trioserve._server import _grpc_front_end

    async def start(context: Any) -> int:
        addresses = await nursery.start(_grpc_front_end(context))
        return int(addresses[0][1])

    return start


@pytest.fixture(scope="module", params=HTTP_SERVERS)
def zoo_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The reference zoo on a real server (both transports), once per HTTP server kind."""
    config = ServerConfig(
        models=reference_zoo(), http_port=0, grpc_port=0, http_server=request.param
    )
    with server_in_thread(config) as server:
        yield server


@pytest.fixture
def http_url(zoo_server: Server) -> str:
    return f"127.0.0.1:{zoo_server.http_port}"


class ScriptedLM:
    """A deterministic stand-in for the generation engine (``GenerativeServed``).

    Sample ``i`` of a request answers ``max_tokens`` tokens, token ``k`` being the text
    ``" w{k}"`` (``" s{i}w{k}"`` when ``n > 1``), samples interleaved token by token, the
    last one with finish_reason ``length``. Before its first token each sample sends one
    empty chunk, as the engine does while a multi-byte character is incomplete. A prompt
    ``"refuse"`` is refused on the first read, ``"fail"`` fails after two tokens. With
    ``hold_after`` set, a request pauses after that many tokens until ``release`` is set.
    Every request ends in ``ended`` as "finished", "failed", or "abort" (left early).
    """

    def __init__(self, name: str = "scripted_lm") -> None:
        from trioserve import Model, TensorSpec

        self.model = Model(
            name=name,
            inputs=[TensorSpec("text_input", "BYTES", [1])],
            outputs=[TensorSpec("text_output", "BYTES", [-1])],
        )
        self.version = "1"
        self.ready = True
        self.max_num_seqs = 16
        self.requests: list[Any] = []
        self.ended: dict[str, str] = {}
        self.hold_after: int | None = None
        self.release = trio.Event()
        self._changed = trio.Event()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def infer(self, request: Any) -> Any:
        raise UnsupportedError("the scripted model only generates")

    def admit(self) -> None:
        pass

    def submit(self, request: Any) -> Any:
        raise UnsupportedError("the scripted model only generates")

    def inference_statistics(self) -> Any:
        from trioserve._stats import ModelStats

        return ModelStats(self.model.name, self.version).statistics()

    def kv_cache_state(self) -> Any:
        from trioserve._load_facts import KVCacheState

        return KVCacheState(total_blocks=8, used_blocks=0, block_size=16)

    def load_facts(self) -> Any:
        from trioserve._load_facts import LoadFacts

        return LoadFacts(kv_cache=self.kv_cache_state)

    @asynccontextmanager
    async def generate(self, request: Any) -> AsyncIterator[AsyncIterator[Any]]:
        self.requests.append(request)
        self._notify()
        chunks = self._chunks(request)
        try:
            yield chunks
        finally:
            self.ended.setdefault(request.request_id, "abort")
            await chunks.aclose()
            self._notify()

    async def _chunks(self, request: Any) -> AsyncIterator[Any]:
        from trioserve.scheduler._generation import GenerationChunk

        n = request.sampling.n
        tokens = request.sampling.max_tokens
        if request.prompt == "refuse":
            self.ended[request.request_id] = "failed"
            raise InvalidArgumentError("the prompt is refused")
        for i in range(n):
            yield GenerationChunk(i, "", ())
        for k in range(tokens):
            if request.prompt == "fail" and k == 2:
                self.ended[request.request_id] = "failed"
                raise InternalError("the engine failed")
            if k == self.hold_after:
                await self.release.wait()
            for i in range(n):
                text = f" s{i}w{k}" if n > 1 else f" w{k}"
                reason = "length" if k == tokens - 1 else None
                yield GenerationChunk(i, text, (k,), reason)
            await trio.lowlevel.checkpoint()
        self.ended[request.request_id] = "finished"

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


@pytest.fixture
def scripted_lm() -> ScriptedLM:
    return ScriptedLM()


class GenerateExits:
    """Counts the ``generate()`` blocks of a served model that have exited (the engine frees
    a request's blocks there), so a test can wait for one instead of guessing when."""

    def __init__(self, served: Any) -> None:
        self.count = 0
        self._generate = served.generate
        self._changed = trio.Event()
        served.generate = self.generate  # the front ends look it up on every request

    @asynccontextmanager
    async def generate(self, request: Any) -> AsyncIterator[AsyncIterator[Any]]:
        try:
            async with self._generate(request) as chunks:
                yield chunks
        finally:
            self.count += 1
            self._changed.set()
            self._changed = trio.Event()

    async def wait_for(self, count: int) -> None:
        while self.count < count:
            await self._changed.wait()


@pytest.fixture
def generate_exits() -> type[GenerateExits]:
    return GenerateExits


@pytest.fixture
async def tiny_server(nursery: trio.Nursery, request: pytest.FixtureRequest) -> Server:
    """``tiny_lm`` beside the zoo on an in-process server (both transports); the HTTP
    server kind comes from ``http_server`` when a test parametrizes it."""
    from trioserve import serve
    from trioserve.models import TinyLM

    http_server = getattr(request, "param", "builtin")
    config = ServerConfig(
        models=[*reference_zoo(), TinyLM(num_kv_blocks=256)],
        http_port=0,
        grpc_port=0,
        http_server=http_server,
    )
    started: Server = await nursery.start(serve, config)
    return started


@pytest.fixture
def http(server: Server) -> Iterator[Any]:
    """An httpx client of the ``server`` fixture's HTTP port (the module names its server)."""
    import httpx

    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}") as client:
        yield client


# A python-backend model that tells (on stderr) that it runs, then blocks its worker
# thread far longer than a test waits: a request in flight that only leaving ends.
_BLOCKING_MODEL = """
import sys
import time

class TritonPythonModel:
    def execute(self, requests):
        print("model is executing", file=sys.stderr, flush=True)
        time.sleep(600)
"""

_BLOCKING_CONFIG = """
name: "blocking"
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


@pytest.fixture
def blocking_repository(tmp_path: Path) -> Path:
    """A model repository holding ``blocking`` (see ``_BLOCKING_MODEL``), for tests of
    ``trioserve run`` in a subprocess with a request in flight."""
    write_model(tmp_path, "blocking", _BLOCKING_CONFIG, _BLOCKING_MODEL)
    return tmp_path


@pytest.fixture(scope="module")
def error_records() -> Iterator[ErrorRecords]:
    """Every ERROR record logged while a module's tests run (its servers run in threads
    of this process); a fuzz test takes them after each example."""
    handler = ErrorRecords()
    logging.getLogger().addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger().removeHandler(handler)
