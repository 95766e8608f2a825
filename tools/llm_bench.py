"""Streaming load generator for generative models: ``generate_stream`` and the OpenAI API.

    python tools/llm_bench.py                               # start trioserve, tiny_lm, 1/16/64
    python tools/llm_bench.py --url 127.0.0.1:8000 --model my_lm --concurrency 8
    python tools/llm_bench.py --api generate_stream,completions,chat --scrape-metrics

``--api`` picks the endpoints, each measured at every concurrency: Triton's
``generate_stream``, OpenAI's ``/v1/completions`` and ``/v1/chat/completions``
(streamed), so the cost of each API over the same engine shows side by side. With
``--scrape-metrics`` a further client scrapes ``/metrics`` every 50 ms under the load,
as a gateway's endpoint picker does, and the row shows its latency.

Each of ``concurrency`` clients keeps one HTTP/1.1 connection and sends streaming
requests back to back for ``--duration`` seconds. Per request it records when the
request went out and when each SSE event arrived, on trio's monotonic clock:

* TTFT: request sent -> first event with text (OpenAI's ``[DONE]`` is not an event);
* inter-token latency: the gaps between consecutive events of one request (an event
  carries what one engine step produced for the request, normally one token);
* output tokens/s: tokens of the requests completed in the window / its length. With
  ``ignore_eos`` and no stop strings a request generates exactly ``max_tokens`` tokens,
  and the tool checks that each one ended with ``finish_reason: length``.

The client is trio over plain sockets with a minimal HTTP/1.1 chunked reader: no HTTP
library between the wire and the timestamps. Run it on other cores than the server
(``--client-cpus``; a server this tool starts is pinned to ``--server-cpus``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from bench import trioserve_process  # tools/ is the script's folder, so on sys.path

# For a server this tool starts: tiny_lm's matrices are small, and BLAS threads on the
# server's one pinned core only fight its event loop (see tools/llm_engine_bench.py).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


@dataclass
class Sample:
    """One request's timeline."""

    ttft: float
    gaps: list[float]
    tokens: int


@dataclass(frozen=True)
class Api:
    """One streaming endpoint: where to send, what to send, how its last event reads."""

    name: str
    path: str  # with {model}
    body: Callable[[str, str, argparse.Namespace], dict[str, object]]  # (model, prompt, args)
    finish_reason: Callable[[dict[str, Any]], object]  # of the last event


def _sampling(args: argparse.Namespace) -> dict[str, object]:
    return {
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "temperature": args.temperature,
        "top_p": args.top_p,
    }


APIS = {
    api.name: api
    for api in (
        Api(
            "generate_stream",
            "/v2/models/{model}/generate_stream",
            lambda model, prompt, args: {"text_input": prompt, **_sampling(args)},
            lambda event: event.get("finish_reason"),
        ),
        Api(
            "completions",
            "/v1/completions",
            lambda model, prompt, args: {
                "model": model,
                "prompt": prompt,
                "stream": True,
                **_sampling(args),
            },
            lambda event: event["choices"][0]["finish_reason"],
        ),
        Api(
            "chat",
            "/v1/chat/completions",
            lambda model, prompt, args: {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "stream": True,
                **_sampling(args),
            },
            lambda event: event["choices"][0]["finish_reason"],
        ),
    )
}


@dataclass
class Level:
    api: str
    concurrency: int
    window: float
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    scrapes: list[float] = field(default_factory=list)  # /metrics latencies, seconds

    def row(self) -> str:
        ttft = np.array([s.ttft for s in self.samples]) * 1e3
        gaps = np.array([g for s in self.samples for g in s.gaps]) * 1e3
        tokens = sum(s.tokens for s in self.samples)
        scrapes = np.array(self.scrapes) * 1e3
        return (
            f"{self.api:<15} c={self.concurrency:<3} requests {len(self.samples):>5}  "
            f"TTFT p50 {_p(ttft, 50):8.1f} ms p99 {_p(ttft, 99):8.1f} ms   "
            f"ITL p50 {_p(gaps, 50):7.1f} ms p99 {_p(gaps, 99):7.1f} ms   "
            f"{tokens / self.window:8.0f} tok/s"
            + (
                f"   /metrics p50 {_p(scrapes, 50):5.1f} ms p99 {_p(scrapes, 99):5.1f} ms "
                f"max {scrapes.max():5.1f} ms ({len(scrapes)})"
                if len(scrapes)
                else ""
            )
            + (f"   errors {len(self.errors)}: {self.errors[0]}" if self.errors else "")
        )


def _p(values: np.ndarray, q: int) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


class StreamingClient:
    """One keep-alive HTTP/1.1 connection sending generate_stream requests."""

    def __init__(self, stream: trio.SocketStream, host: str, api: Api, model: str) -> None:
        self._stream = stream
        self._api = api
        self._host = host
        path = api.path.format(model=model)
        self._head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        self._buffer = b""
        self._length = 0  # the content-length of a non-chunked answer
        self._received_at = 0.0  # when the last recv returned

    async def generate(self, document: dict[str, object], tokens: int) -> Sample:
        body = json.dumps(document).encode()
        request = f"{self._head}content-length: {len(body)}\r\n\r\n".encode() + body
        sent = trio.current_time()
        await self._stream.send_all(request)
        status, chunked = await self._response_head()
        if status != 200 or not chunked:
            raise RuntimeError(f"status {status}: {(await self._rest(chunked)).decode()!r}")
        # Events are stamped with the time of the recv that brought them and parsed as
        # JSON only at the end: per-event work in this client would delay its reads and
        # show up as bunched events in the figures.
        arrivals: list[float] = []
        pending = b""
        last = b""
        while (data := await self._chunk()) is not None:
            pending += data
            if b"\n\n" in pending:
                *complete, pending = pending.split(b"\n\n")
                for event in complete:
                    if event.startswith(b'data: {"error"'):
                        raise RuntimeError(f"error event: {event.decode()}")
                events = [e for e in complete if e != b"data: [DONE]"]
                arrivals.extend([self._received_at] * len(events))
                last = events[-1] if events else last
        final = json.loads(last.removeprefix(b"data: ")) if last else {}
        if self._api.finish_reason(final) != "length":
            raise RuntimeError(f"stream ended without finish_reason length: {final}")
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        return Sample(arrivals[0] - sent, gaps, tokens)

    async def get(self, path: str) -> float:
        """GET ``path`` on this connection: seconds until its whole answer arrived."""
        sent = trio.current_time()
        await self._stream.send_all(f"GET {path} HTTP/1.1\r\nhost: {self._host}\r\n\r\n".encode())
        status, chunked = await self._response_head()
        body = await self._rest(chunked)
        if status != 200:
            raise RuntimeError(f"GET {path}: status {status}: {body[:200]!r}")
        return trio.current_time() - sent

    async def _fill(self) -> None:
        data = await self._stream.receive_some(65536)
        self._received_at = trio.current_time()
        if not data:
            raise RuntimeError("the server closed the connection")
        self._buffer += data

    async def _line(self) -> bytes:
        while b"\r\n" not in self._buffer:
            await self._fill()
        line, self._buffer = self._buffer.split(b"\r\n", 1)
        return line

    async def _exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            await self._fill()
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    async def _response_head(self) -> tuple[int, bool]:
        status = int((await self._line()).split()[1])
        chunked = False
        while line := await self._line():
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = value.strip().lower() == b"chunked"
            elif name == b"content-length":
                self._length = int(value)
        return status, chunked

    async def _chunk(self) -> bytes | None:
        """The next chunk of a chunked body; None after the last."""
        size = int((await self._line()).split(b";")[0], 16)
        if size == 0:
            await self._line()  # the empty trailer section
            return None
        data = await self._exactly(size)
        await self._exactly(2)
        return data

    async def _rest(self, chunked: bool) -> bytes:
        if not chunked:
            return await self._exactly(self._length)
        parts = []
        while (data := await self._chunk()) is not None:
            parts.append(data)
        return b"".join(parts)


async def run_level(
    url: str, model: str, api: Api, concurrency: int, args: argparse.Namespace
) -> Level:
    host, port = url.rsplit(":", 1)
    filler = "the quick brown fox jumps over the lazy dog " * (args.prompt_len // 44 + 1)
    counter = iter(range(1 << 62))

    def document() -> dict[str, object]:
        # A distinct start per request: the prefix cache must not answer whole prompts.
        return api.body(model, f"{next(counter)} {filler}"[: args.prompt_len], args)

    async with await trio.open_tcp_stream(host, int(port)) as warm:
        await StreamingClient(warm, host, api, model).generate(document(), args.max_tokens)
    level = Level(api.name, concurrency, args.duration)
    start = trio.current_time()
    deadline = start + args.duration

    async def scraper() -> None:
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            scraping = StreamingClient(stream, host, api, model)
            while trio.current_time() < deadline:
                level.scrapes.append(await scraping.get("/metrics"))
                await trio.sleep(0.05)

    async def client() -> None:
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            streaming = StreamingClient(stream, host, api, model)
            while trio.current_time() < deadline:
                try:
                    sample = await streaming.generate(document(), args.max_tokens)
                except RuntimeError as exc:
                    level.errors.append(str(exc))
                    return
                if trio.current_time() <= deadline:
                    level.samples.append(sample)  # only requests completed in the window

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
        if args.scrape_metrics:
            nursery.start_soon(scraper)
    return level


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="HTTP host:port of a running server (else start trioserve)")
    parser.add_argument("--model", default="tiny_lm")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt length in characters")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--server-cpus", default="0", help="cores for a server this tool starts")
    parser.add_argument("--client-cpus", default="1", help="cores for this load generator")
    parser.add_argument("--http-server", default="stdlib", choices=("stdlib", "hypercorn"))
    parser.add_argument(
        "--api", default="generate_stream", help=f"comma-separated: {', '.join(APIS)}"
    )
    parser.add_argument(
        "--scrape-metrics", action="store_true", help="also GET /metrics every 50 ms, timed"
    )
    args = parser.parse_args()
    apis = [APIS[name] for name in args.api.split(",")]
    os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})

    @contextmanager
    def target() -> Iterator[str]:
        if args.url:
            yield args.url
        else:
            with trioserve_process(args.server_cpus, args.http_server, "trio", sys.executable) as (
                http_url,
                _,
                _,
            ):
                yield http_url

    with target() as url:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for api in apis:
                level = trio.run(run_level, url, args.model, api, concurrency, args)
                print(level.row(), flush=True)
                if level.errors:
                    sys.exit(1)


if __name__ == "__main__":
    main()
