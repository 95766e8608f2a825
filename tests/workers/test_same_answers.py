"""``trioserve run --workers 2``: every connection gets the answer one process gives,
whichever worker took it (real processes, tritonclient, POSIX shared memory, openai)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from grpclib.client import Channel
from grpclib.const import Cardinality
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from trioserve.grpc._generated.orca_load_report_pb2 import OrcaLoadReport

from ._served import TIMEOUT, Served

CONNECTIONS = 24  # fresh connections: the kernel spreads them over both workers


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    server = Served(
        "--model-control-mode", "explicit", "--load-model", "*",
        "--http-restricted-api", "trace:admin=yes", "--http-max-body-bytes", "200000",
    )  # fmt: skip
    try:
        yield server
    finally:
        assert server.stop() == 0
    # What the tests sent, clients that left included, is answered or refused, never a
    # failure of the server's: no process logged an error.
    errors = [line for line in server.log if " ERROR " in line]
    assert not errors, "".join(errors)


def _simple(client: Any, module: Any) -> np.ndarray:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(a)
        inputs.append(tensor)
    return client.infer("simple", inputs).as_numpy("OUTPUT0")  # type: ignore[no-any-return]


def _inference_count(served: Served, model: str) -> int:
    with grpcclient.InferenceServerClient(served.grpc_url) as client:
        stats = client.get_inference_statistics(model, as_json=True)
    return int(stats["model_stats"][0].get("inference_count", 0))


def test_connections_land_on_both_workers_and_statistics_sum(served: Served) -> None:
    before = _inference_count(served, "simple")
    for number in range(CONNECTIONS):
        if number % 2:
            with grpcclient.InferenceServerClient(served.grpc_url) as client:
                assert _simple(client, grpcclient)[0, 1] == 2
        else:
            with httpclient.InferenceServerClient(served.url) as client:
                assert _simple(client, httpclient)[0, 1] == 2
    assert _inference_count(served, "simple") == before + CONNECTIONS
    calls = [served.metric(f'trioserve_worker_calls_total{{worker="{n}"}}') for n in (0, 1)]
    assert min(calls) > 0, calls  # both workers served some
    # The HTTP port's /metrics is the same scrape as the metrics port's: both collected
    # by the core and written out by a worker.
    scrape = httpx.get(f"http://{served.url}/metrics", timeout=TIMEOUT)
    assert scrape.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'trioserve_worker_calls_total{worker="1"}' in scrape.text
    assert "nv_inference_count" in scrape.text
    metrics_port = f"http://127.0.0.1:{served.metrics}"
    port_scrape = httpx.get(f"{metrics_port}/metrics", timeout=TIMEOUT)
    assert port_scrape.headers["content-type"] == scrape.headers["content-type"]
    assert _family_lines(scrape.text) == _family_lines(port_scrape.text)
    assert "# TYPE nv_inference_count counter" in _family_lines(scrape.text)  # not *_total
    # The metrics port answers GET /metrics alone, as one process's does.
    assert httpx.get(f"{metrics_port}/v2/health/ready", timeout=TIMEOUT).status_code == 404


def test_requests_forwarded_together_each_get_their_own_answer(served: Served) -> None:
    """Many requests in flight at once reach the core in shared frames (alike ones as
    one INFERS, queued there as one request): each still gets its own rows and id, over gRPC
    (one connection, one worker) and HTTP (many), and counts as one in the statistics."""
    count = 48
    before = _inference_count(served, "simple")
    answers: dict[tuple[str, int], Any] = {}
    answered = threading.Condition()

    def note(key: tuple[str, int], result: Any, error: Any = None) -> None:
        with answered:
            answers[key] = error if error is not None else result
            answered.notify()

    def inputs(module: Any, number: int) -> list[Any]:
        tensors = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        tensors[0].set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16) + number)
        tensors[1].set_data_from_numpy(np.ones((1, 16), np.int32))
        return tensors

    with grpcclient.InferenceServerClient(served.grpc_url) as client:
        for number in range(count):
            client.async_infer(
                "simple", inputs(grpcclient, number), partial(note, ("grpc", number)),
                request_id=f"grpc-{number}",
            )  # fmt: skip
        with httpclient.InferenceServerClient(served.url, concurrency=16) as http:
            sent = [
                http.async_infer("simple", inputs(httpclient, number), request_id=f"http-{number}")
                for number in range(count)
            ]
            for number, request in enumerate(sent):
                note(("http", number), request.get_result())
            with answered:
                assert answered.wait_for(lambda: len(answers) == 2 * count, timeout=TIMEOUT)
    for (protocol, number), result in answers.items():
        assert not isinstance(result, Exception), result
        expected = np.arange(16, dtype=np.int32).reshape(1, 16) + number + 1
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)
        response = result.get_response()
        assert (response["id"] if protocol == "http" else response.id) == f"{protocol}-{number}"
    assert _inference_count(served, "simple") == before + 2 * count


def _family_lines(scrape: str) -> set[str]:
    """The HELP and TYPE lines of an exposition: its families as written."""
    return {line for line in scrape.splitlines() if line.startswith("#")}


def test_a_scrape_without_metrics_is_answered_as_by_one_process() -> None:
    served = Served("--allow-metrics", "false", workers=1)
    try:
        scrape = httpx.get(f"http://{served.url}/metrics", timeout=TIMEOUT)
        assert scrape.status_code == 404
        assert "error" in scrape.json()
    finally:
        assert served.stop() == 0


@pytest.fixture
def regions() -> Iterator[tuple[Any, Any]]:
    handles = (
        shm.create_shared_memory_region("w_in", "/trioserve_w24_in", 128),
        shm.create_shared_memory_region("w_out", "/trioserve_w24_out", 64),
    )
    try:
        yield handles
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def test_a_region_registered_on_one_connection_serves_another(
    served: Served, regions: tuple[Any, Any]
) -> None:
    source, target = regions
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    shm.set_shared_memory_region(source, [a, a])
    with httpclient.InferenceServerClient(served.url) as http:
        http.register_system_shared_memory("w_in", "/trioserve_w24_in", 128)
        http.register_system_shared_memory("w_out", "/trioserve_w24_out", 64)
    try:
        for _ in range(4):  # new gRPC connections: some on the other worker
            with grpcclient.InferenceServerClient(served.grpc_url) as client:
                inputs = []
                for index, name in enumerate(("INPUT0", "INPUT1")):
                    tensor = grpcclient.InferInput(name, [1, 16], "INT32")
                    tensor.set_shared_memory("w_in", 64, offset=64 * index)
                    inputs.append(tensor)
                output = grpcclient.InferRequestedOutput("OUTPUT0")
                output.set_shared_memory("w_out", 64)
                client.infer("simple", inputs, outputs=[output])
            written = shm.get_contents_as_numpy(target, np.int32, [1, 16])
            np.testing.assert_array_equal(written, a + a)
        with grpcclient.InferenceServerClient(served.grpc_url) as client:
            status = client.get_system_shared_memory_status(as_json=True)
            assert {r["name"] for r in status["regions"].values()} == {"w_in", "w_out"}
    finally:
        with grpcclient.InferenceServerClient(served.grpc_url) as client:
            client.unregister_system_shared_memory()
    with httpclient.InferenceServerClient(served.url) as http:
        assert http.get_system_shared_memory_status() == []


def test_compressed_answers(served: Served, regions: tuple[Any, Any]) -> None:
    """Responses compressed as the client accepts, whether the worker decoded the
    request (an inference) or the core answered it (one that names a region, a scrape);
    the worker compresses them. Others are never compressed, as in one process."""
    source, _ = regions
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    shm.set_shared_memory_region(source, [a, a])
    names = ("INPUT0", "INPUT1")
    decoded = [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "data": a[0].tolist()} for n in names
    ]
    in_region = [
        {"name": name, "datatype": "INT32", "shape": [1, 16], "parameters": {
            "shared_memory_region": "w_in", "shared_memory_byte_size": 64,
            "shared_memory_offset": 64 * index,
        }}
        for index, name in enumerate(names)
    ]  # fmt: skip
    with httpx.Client(base_url=f"http://{served.url}", timeout=TIMEOUT) as http:
        region = {"key": "/trioserve_w24_in", "offset": 0, "byte_size": 128}
        assert http.post("/v2/systemsharedmemory/region/w_in/register", json=region).is_success
        try:
            for encoding in ("gzip", "deflate"):
                accept = {"accept-encoding": encoding}
                for inputs in (decoded, in_region):
                    answer = http.post(
                        "/v2/models/simple/infer", json={"inputs": inputs}, headers=accept
                    )
                    assert answer.headers["content-encoding"] == encoding, answer.text
                    assert answer.json()["outputs"][0]["data"] == (a + a)[0].tolist()
                scrape = http.get("/metrics", headers=accept)
                assert scrape.headers["content-encoding"] == encoding
                assert "nv_inference_count" in scrape.text
                metadata = http.get("/v2/models/simple", headers=accept)
                assert "content-encoding" not in metadata.headers
                assert metadata.json()["name"] == "simple"
        finally:
            http.post("/v2/systemsharedmemory/region/w_in/unregister")


def test_a_large_answer_is_compressed_too(served: Served) -> None:
    """An answer of megabytes from the core (an input in a region: JSON outputs of 100,000
    floats) crosses in shared memory and is compressed in the worker, off its loop."""
    x = np.random.default_rng(5).standard_normal(100_000).astype(np.float32)
    handle = shm.create_shared_memory_region("w_big", "/trioserve_w24_big", x.nbytes)
    try:
        shm.set_shared_memory_region(handle, [x])
        with httpx.Client(base_url=f"http://{served.url}", timeout=TIMEOUT) as http:
            region = {"key": "/trioserve_w24_big", "offset": 0, "byte_size": x.nbytes}
            registered = http.post("/v2/systemsharedmemory/region/w_big/register", json=region)
            assert registered.is_success, registered.text
            tensor = {"name": "INPUT0", "datatype": "FP32", "shape": [x.size], "parameters": {
                "shared_memory_region": "w_big", "shared_memory_byte_size": x.nbytes,
            }}  # fmt: skip
            try:
                answer = http.post(
                    "/v2/models/identity_fp32/infer",
                    json={"inputs": [tensor]},
                    headers={"accept-encoding": "gzip"},
                )
            finally:
                http.post("/v2/systemsharedmemory/region/w_big/unregister")
        assert answer.headers["content-encoding"] == "gzip", answer.text
        assert int(answer.headers["content-length"]) < len(answer.content)  # inflated
        np.testing.assert_array_equal(np.array(answer.json()["outputs"][0]["data"], np.float32), x)
    finally:
        shm.destroy_shared_memory_region(handle)


def test_a_model_loaded_on_one_connection_serves_every_other(served: Served) -> None:
    with httpclient.InferenceServerClient(served.url) as http:
        http.unload_model("simple_int8")
    for _ in range(4):
        with grpcclient.InferenceServerClient(served.grpc_url) as client:
            assert not client.is_model_ready("simple_int8")
    with grpcclient.InferenceServerClient(served.grpc_url) as client:
        client.load_model("simple_int8")
    for _ in range(CONNECTIONS // 2):  # at once, from any connection
        with httpclient.InferenceServerClient(served.url) as http:
            assert http.is_model_ready("simple_int8")
            assert http.get_model_metadata("simple_int8")["name"] == "simple_int8"


def test_load_reports_in_headers_and_trailers(served: Served) -> None:
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [0.0]}]}
    answer = httpx.post(
        f"http://{served.url}/v2/models/delay/infer",
        json=body,
        headers={"endpoint-load-metrics-format": "text"},
        timeout=TIMEOUT,
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["endpoint-load-metrics"].startswith("TEXT ")
    request = service_pb2.ModelInferRequest(model_name="delay")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(np.zeros(1, np.float32).tobytes())
    for _ in range(4):  # new connections: some on the other worker
        trailers = asyncio.run(_infer_with_trailers(served.grpc_url, request))
        report = OrcaLoadReport.FromString(trailers["endpoint-load-metrics-bin"])
        assert "num_requests_waiting" in report.named_metrics


async def _infer_with_trailers(url: str, request: service_pb2.ModelInferRequest) -> dict[str, Any]:
    """ModelInfer's trailing metadata, through grpclib's client: grpcio keeps
    ``endpoint-load-metrics-bin`` for its own load balancing."""
    host, port = url.split(":")
    channel = Channel(host, int(port))
    try:
        async with channel.request(
            "/inference.GRPCInferenceService/ModelInfer",
            Cardinality.UNARY_UNARY,
            service_pb2.ModelInferRequest,
            service_pb2.ModelInferResponse,
            metadata={"endpoint-load-metrics-format": "json"},
        ) as stream:
            await stream.send_message(request, end=True)
            response = await stream.recv_message()
            assert response is not None and response.raw_output_contents
            await stream.recv_trailing_metadata()
            return dict(stream.trailing_metadata or {})
    finally:
        channel.close()


def test_generate_stream_and_openai_streams(served: Served) -> None:
    body = {"text_input": "Hello", "max_tokens": 4}
    url = f"http://{served.url}/v2/models/tiny_lm/generate_stream"
    with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as events:
        assert events.status_code == 200
        data = [line for line in events.iter_lines() if line.startswith("data: ")]
    assert len(data) >= 2 and '"text_output"' in data[0]
    with openai.OpenAI(
        base_url=f"http://{served.url}/v1", api_key="-", max_retries=0, timeout=TIMEOUT
    ) as client:
        chunks = list(
            client.completions.create(
                model="tiny_lm", prompt="Hi", max_tokens=5, temperature=0, stream=True
            )
        )
        whole = client.completions.create(model="tiny_lm", prompt="Hi", max_tokens=5, temperature=0)
    assert len(chunks) >= 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_generate_stream_of_a_decoupled_python_model(served: Served) -> None:
    """A model's own tensors through generate (``rest/_generate_tensors.py``): the
    decoupled ``repeat_int32``'s responses, each an event, from the core to the worker."""
    body = {"IN": [4, 5, 6], "DELAY": [0, 0, 0], "WAIT": [0]}
    url = f"http://{served.url}/v2/models/repeat_int32/generate_stream"
    with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as events:
        assert events.status_code == 200
        data = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: ")]
    assert [(event["OUT"], event["IDX"]) for event in data] == [(4, 0), (5, 1), (6, 2)]


def test_large_json_bodies_on_other_endpoints(served: Served) -> None:
    """A body over a frame's inline size reaches the core in the worker's shared memory:
    every endpoint reads it there (JSON padded with blanks past 64 KiB)."""
    padding = b" " * 70_000
    index = httpx.post(
        f"http://{served.url}/v2/repository/index",
        content=b'{"ready": true}' + padding,
        timeout=TIMEOUT,
    )
    assert index.status_code == 200, index.text
    assert any(model["name"] == "simple" for model in index.json())
    generated = httpx.post(
        f"http://{served.url}/v2/models/tiny_lm/generate",
        content=json.dumps({"text_input": "Hello", "max_tokens": 2}).encode() + padding,
        timeout=TIMEOUT,
    )
    assert generated.status_code == 200, generated.text
    assert "text_output" in generated.json()


def test_a_sequence_goes_on_across_connections(served: Served) -> None:
    def step(value: int, **flags: Any) -> int:
        with httpclient.InferenceServerClient(served.url) as client:  # a new connection
            tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[value]], np.int32))
            answer = client.infer("simple_dyna_sequence", [tensor], sequence_id=4242, **flags)
            return int(answer.as_numpy("OUTPUT")[0, 0])

    assert step(10, sequence_start=True) == 11  # START adds 1
    for _ in range(6):
        assert step(5) == 5
    assert step(7, sequence_end=True) == 7 + 4242  # END adds the correlation id
    with pytest.raises(InferenceServerException, match="START"):
        step(1)  # the sequence ended: on any connection


def test_a_client_that_leaves_withdraws_its_request(served: Served) -> None:
    """A stream whose client disconnects is withdrawn in the core: the generation is
    aborted (counted as a failure, CANCELED), not run to its end."""

    succeeded, failed = _tiny_lm_outcomes(served)
    leaver = socket.create_connection(("127.0.0.1", served.http))
    body = json.dumps({"text_input": "Hello", "max_tokens": 1000, "ignore_eos": True}).encode()
    leaver.sendall(
        b"POST /v2/models/tiny_lm/generate_stream HTTP/1.1\r\nhost: x\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert b"data: " in leaver.recv(65536)  # the generation runs
    leaver.close()
    while _tiny_lm_outcomes(served) == (succeeded, failed):  # until the generation ends
        pass
    assert _tiny_lm_outcomes(served) == (succeeded, failed + 1)


def test_a_cancelled_grpc_stream_withdraws_its_generation(served: Served) -> None:
    succeeded, failed = _tiny_lm_outcomes(served)
    first = threading.Event()
    client = grpcclient.InferenceServerClient(served.grpc_url)
    client.start_stream(callback=lambda result, error: first.set())
    prompt = grpcclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"Hello"], dtype=np.object_))
    parameters = {"max_tokens": 1000, "ignore_eos": True}
    client.async_stream_infer("tiny_lm", [prompt], parameters=parameters)
    assert first.wait(TIMEOUT)  # the generation runs
    client.stop_stream(cancel_requests=True)
    client.close()
    while _tiny_lm_outcomes(served) == (succeeded, failed):  # until the generation ends
        pass
    assert _tiny_lm_outcomes(served) == (succeeded, failed + 1)


def _tiny_lm_outcomes(served: Served) -> tuple[int, int]:
    """tiny_lm's requests that succeeded and failed (a withdrawn one fails, CANCELED)."""
    with grpcclient.InferenceServerClient(served.grpc_url) as client:
        stats = client.get_inference_statistics("tiny_lm", as_json=True)["model_stats"][0]
    counts = stats["inference_stats"]
    return int(counts["success"].get("count", 0)), int(counts["fail"].get("count", 0))


def test_restricted_apis_and_limits(served: Served) -> None:
    for _ in range(4):
        refused = httpx.get(f"http://{served.url}/v2/trace/setting", timeout=TIMEOUT)
        assert refused.status_code == 403 and "error" in refused.json()
        allowed = httpx.get(
            f"http://{served.url}/v2/trace/setting", headers={"admin": "yes"}, timeout=TIMEOUT
        )
        assert allowed.status_code == 200
    too_big = httpx.post(
        f"http://{served.url}/v2/models/simple/infer", content=b"x" * 200_001, timeout=TIMEOUT
    )
    assert too_big.status_code == 413 and "error" in too_big.json()
    with (
        grpcclient.InferenceServerClient(served.grpc_url) as client,
        pytest.raises(InferenceServerException, match="unknown model"),
    ):
        client.get_model_metadata("no_such_model")


@pytest.mark.parametrize("module", [httpclient, grpcclient])
def test_large_and_bytes_tensors_round_trip(served: Served, module: Any) -> None:
    """A tensor over 64 KiB crosses in shared memory both ways (under this server's body
    limit); BYTES in their raw form."""
    url = served.url if module is httpclient else served.grpc_url
    big = np.random.default_rng(0).random(32 * 1024, dtype=np.float32)
    words = np.array([b"one", b"", "três".encode(), b"\x00four"], dtype=np.object_)
    binary = {"binary_data": True} if module is httpclient else {}
    with module.InferenceServerClient(url) as client:
        for _ in range(3):  # blocks freed and reused
            tensor = module.InferInput("INPUT0", [big.size], "FP32")
            tensor.set_data_from_numpy(big, **binary)
            np.testing.assert_array_equal(
                client.infer("identity_fp32", [tensor]).as_numpy("OUTPUT0"), big
            )
        tensor = module.InferInput("INPUT0", [len(words)], "BYTES")
        tensor.set_data_from_numpy(words, **binary)
        answer = client.infer("identity_bytes", [tensor]).as_numpy("OUTPUT0")
        assert [bytes(w) for w in answer] == list(words)


def test_model_stream_infer_is_forwarded(served: Served) -> None:
    results: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        results.append(error if error is not None else result.as_numpy("OUTPUT0"))
        if len(results) == 3:
            done.set()

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    with grpcclient.InferenceServerClient(served.grpc_url) as client:
        client.start_stream(callback)
        for _ in range(3):
            inputs = []
            for name in ("INPUT0", "INPUT1"):
                tensor = grpcclient.InferInput(name, [1, 16], "INT32")
                tensor.set_data_from_numpy(a)
                inputs.append(tensor)
            client.async_stream_infer("simple", inputs)
        assert done.wait(TIMEOUT)
        client.stop_stream()
    for result in results:
        np.testing.assert_array_equal(result, a + a)


def test_one_status_page_for_every_connection(served: Served) -> None:
    """The page's clock starts at its first document: one page (the core's) for all."""
    documents = [
        httpx.get(f"http://{served.url}/status.json", timeout=TIMEOUT).json() for _ in range(8)
    ]  # a new connection each, over both workers
    watched = [document["server"]["watched_seconds"] for document in documents]
    assert watched == sorted(watched) and all(seconds > 0 for seconds in watched[1:])
    assert "simple" in {model["name"] for model in documents[-1]["models"]}
    page = httpx.get(f"http://{served.url}/", timeout=TIMEOUT)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
