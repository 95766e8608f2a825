"""A generative model's numbers after real traffic: vLLM and TRT-LLM families on
``/metrics``, the statistics extension, and ORCA's KV figures, all from one server."""

from __future__ import annotations

from typing import Any

import httpx
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

import trioserve
from trioserve.models import TinyLM, reference_zoo

MAX_TOKENS = 5


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_generate_traffic_shows_on_metrics_stats_and_load_reports(
    tiny_server: Any,
) -> None:
    base = f"http://127.0.0.1:{tiny_server.http_port}"
    body = {"text_input": "", "parameters": {"max_tokens": MAX_TOKENS, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=base) as http:
        for prompt in ("one", "two", "three"):
            answer = await http.post(
                "/v2/models/tiny_lm/generate", json={**body, "text_input": prompt}
            )
            assert answer.status_code == 200
            assert answer.json()["finish_reason"] == "length"
        async with http.stream(
            "POST",
            "/v2/models/tiny_lm/generate_stream",
            json={**body, "text_input": "four"},
            headers={"endpoint-load-metrics-format": "json"},
        ) as stream:
            assert stream.status_code == 200
            report = stream.headers["endpoint-load-metrics"]
            assert report.startswith('JSON {"named_metrics":{"kv_cache_utilization":')
            assert '"max_token_capacity":4096}' in report  # 256 blocks of 16 tokens
            events = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
        assert len(events) >= 1
        # The engine hands each iteration's figures to the metrics task: let it catch up.
        await trio.testing.wait_all_tasks_blocked()

        scraped = samples((await http.get("/metrics")).text)
        model = (("model_name", "tiny_lm"),)
        assert scraped[("vllm:request_success_total", (("finished_reason", "length"), *model))] == 4
        assert scraped[("vllm:generation_tokens_total", model)] == 4 * MAX_TOKENS
        assert scraped[("vllm:time_to_first_token_seconds_count", model)] == 4
        assert scraped[("vllm:e2e_request_latency_seconds_count", model)] == 4
        assert scraped[("vllm:num_requests_running", model)] == 0
        assert scraped[("vllm:kv_cache_usage_perc", model)] == 0
        version = (("model", "tiny_lm"), ("version", "1"))
        kv = "kv_cache_block_type"
        assert scraped[("nv_trt_llm_kv_cache_block_metrics", ((kv, "max"), *version))] == 256
        assert scraped[("nv_trt_llm_kv_cache_block_metrics", ((kv, "used"), *version))] == 0

        stats = (await http.get("/v2/models/tiny_lm/stats")).json()["model_stats"][0]
        assert stats["inference_count"] == 4
        assert stats["inference_stats"]["success"]["count"] == 4
        assert stats["inference_stats"]["fail"]["count"] == 0
        assert stats["inference_stats"]["queue"]["count"] == 4
        assert stats["inference_stats"]["compute_infer"]["ns"] > 0
        # Triton's counters have no _total on the wire; the parser adds it to sample names.
        assert scraped[("nv_inference_request_success_total", version)] == 4
        assert scraped[("nv_inference_count_total", version)] == 4


# --- the LLM families: one set per server, from its first generative model on -------------

LLM_FAMILY_PREFIXES = ("vllm:", "nv_trt_llm_")


def llm_family_names(text: str) -> list[str]:
    """The LLM families on a scrape, in order, a name once per time it is exposed."""
    return [
        f.name
        for f in text_string_to_metric_families(text)
        if f.name.startswith(LLM_FAMILY_PREFIXES)
    ]


async def scrape(server: trioserve.Server) -> str:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:
        return (await http.get("/metrics")).text


async def test_two_generative_models_share_one_set_of_families(nursery: trio.Nursery) -> None:
    models = [TinyLM(num_kv_blocks=96), TinyLM("other_lm", num_kv_blocks=64)]
    config = trioserve.ServerConfig(models=models, http_port=0)
    server: trioserve.Server = await nursery.start(trioserve.serve, config)
    text = await scrape(server)
    names = llm_family_names(text)
    assert "vllm:num_requests_running" in names and "nv_trt_llm_request_metrics" in names
    assert len(names) == len(set(names))  # every family once, whatever the models
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):  # a series per model (and the server's, first)
            labelled = {s.labels["model_name"] for s in family.samples}
            assert {"tiny_lm", "other_lm"} <= labelled, family.name
    scraped = samples(text)
    kv = "kv_cache_block_type"
    for name, blocks in (("tiny_lm", 96), ("other_lm", 64)):
        labels = ((kv, "max"), ("model", name), ("version", "1"))
        assert scraped[("nv_trt_llm_kv_cache_block_metrics", labels)] == blocks


async def test_no_llm_families_without_a_generative_model(nursery: trio.Nursery) -> None:
    config = trioserve.ServerConfig(models=reference_zoo(), http_port=0)
    server: trioserve.Server = await nursery.start(trioserve.serve, config)
    text = await scrape(server)
    assert "nv_inference_count" in text  # the scrape has the tensor models' families
    assert llm_family_names(text) == []


async def test_llm_families_appear_once_a_generative_model_is_loaded(
    nursery: trio.Nursery,
) -> None:
    config = trioserve.ServerConfig(
        models=[*reference_zoo(), TinyLM()], http_port=0, model_control_mode="explicit"
    )
    server: trioserve.Server = await nursery.start(trioserve.serve, config)
    assert llm_family_names(await scrape(server)) == []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:
        for name in ("simple", "tiny_lm"):
            loaded = await http.post(f"/v2/repository/models/{name}/load")
            assert loaded.status_code == 200
    names = llm_family_names(await scrape(server))
    assert "vllm:num_requests_running" in names and len(names) == len(set(names))
    assert ("vllm:num_requests_running", (("model_name", "tiny_lm"),)) in samples(
        await scrape(server)
    )
