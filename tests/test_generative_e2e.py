"""A generative model's numbers after real traffic: vLLM and TRT-LLM families on
``/metrics``, the statistics extension, and ORCA's KV figures, all from one server."""

from __future__ import annotations

from typing import Any

import httpx
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

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
