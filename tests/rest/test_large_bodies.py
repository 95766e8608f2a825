"""Large REST bodies are decoded, inflated and answered off the event loop, in pieces
small enough that the loop gets the GIL back every few milliseconds."""

from __future__ import annotations

import gzip
import json
import threading
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from trioserve import InvalidArgumentError, ServerConfig, open_server
from trioserve._limits import OFF_LOOP_BYTES
from trioserve._tensor import array_from_json, datatype
from trioserve._types import OutputTensor
from trioserve.models import reference_zoo
from trioserve.rest._infer_codec import _json_data
from trioserve.rest._json_body import json_object


@pytest.fixture
def thread_work(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions sent to worker threads."""
    names: list[str] = []
    run_sync = trio.to_thread.run_sync

    async def spying(fn: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(getattr(fn, "func", fn).__name__)  # a partial's function
        return await run_sync(fn, *args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", spying)
    return names


def _body(count: int) -> dict[str, Any]:
    data = [0.5] * count
    return {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [count], "data": data}]}


async def _post(content: bytes, headers: dict[str, str]) -> httpx.Response:
    config = ServerConfig(models=reference_zoo(), http_port=0, grpc_port=None)
    with trio.fail_after(60):
        async with open_server(config) as server, httpx.AsyncClient(timeout=60) as client:
            url = f"http://127.0.0.1:{server.http_port}/v2/models/identity_fp32/infer"
            response = await client.post(url, content=content, headers=headers)
            await server.shutdown()
    return response


async def test_a_large_json_request_is_decoded_and_answered_in_worker_threads(thread_work):
    count = OFF_LOOP_BYTES // 4  # about five bytes a number: over the threshold
    response = await _post(json.dumps(_body(count)).encode(), {})
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [0.5] * count
    assert {"decode_request", "encode_response"} <= set(thread_work)


async def test_a_small_request_stays_on_the_event_loop(thread_work):
    response = await _post(json.dumps(_body(16)).encode(), {})
    assert response.status_code == 200
    assert not {"decode_request", "encode_response"} & set(thread_work)


async def test_a_compressed_body_is_inflated_in_a_worker_thread(thread_work):
    response = await _post(
        gzip.compress(json.dumps(_body(16)).encode()), {"Content-Encoding": "gzip"}
    )
    assert response.status_code == 200
    assert "_decompress" in thread_work


def test_parsing_a_large_document_hands_the_gil_over() -> None:
    text = json.dumps(_body(2_000_000))  # about 10 MB: a few hundred ms of parsing
    turns = 0
    done = threading.Event()

    def parse() -> None:
        document = json_object(text)
        assert len(document["inputs"][0]["data"]) == 2_000_000
        done.set()

    parser = threading.Thread(target=parse)
    parser.start()
    while not done.wait(0.001):  # counts the turns this thread gets while the other parses
        turns += 1
    parser.join()
    assert turns >= 10  # one C call for the whole document would give about one


def test_long_json_data_converts_in_slices_as_it_would_whole() -> None:
    dt = datatype("INT64")
    rows = [[i, i + 1] for i in range(100_000)]
    array = array_from_json(dt, [100_000, 2], rows, "input 'X'")
    assert np.array_equal(array, np.array(rows))
    ragged = rows[:50_000] + [[1, 2, 3]] * 50_000  # rectangular slices, ragged together
    with pytest.raises(InvalidArgumentError, match="not a rectangular array"):
        array_from_json(dt, [100_000, 2], ragged, "input 'X'")


@pytest.mark.parametrize("name", ["FP32", "INT32", "BYTES"])
def test_a_large_output_encodes_in_slices_as_it_would_whole(name: str) -> None:
    dt = datatype(name)
    values = np.arange(100_000)
    if dt.is_bytes:
        array = np.array([str(v).encode() for v in values], dtype=object)
    else:
        array = values.astype(dt.dtype)
    expected = [str(v) for v in values] if dt.is_bytes else array.tolist()
    assert json.loads(_json_data(OutputTensor("Y", dt, array))) == expected
