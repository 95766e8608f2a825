"""``tools/soak.py`` end to end: a short soak against a server it starts (``trioserve
run``, the built-in models) completes requests of every kind, samples the server, and
passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "soak.py"
KINDS = {
    "rest_json", "rest_binary", "large_tensor", "grpc_unary", "grpc_stream",
    "grpc_stream_llm", "shared_memory", "generate_stream", "generate_decoupled",
    "openai_chat_stream",
    "metrics_scrape", "disconnect_request", "disconnect_large", "disconnect_stream",
    "grpc_cancel", "grpc_timeout", "grpc_stream_cancel",
}  # fmt: skip


def test_a_short_soak_drives_every_kind_and_passes(tmp_path):
    report = tmp_path / "soak.json"
    command = [sys.executable, str(TOOL), "--minutes", "0.15", "--interval", "3",
               "--json", str(report)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("soak: PASS")
    document = json.loads(report.read_text())
    assert document["failures"] == []
    samples = document["samples"]
    assert [s["phase"] for s in samples] == ["idle before", "load", "load", "load", "idle after"]
    for s in samples:
        assert s["rss_mib"] > 0 and s["fds"] > 0 and s["threads"] > 0 and s["tasks"] > 0
    done_per_kind = samples[-1]["done"]
    finished = {**done_per_kind["ok"], **done_per_kind["cancelled"]}
    assert set(finished) == KINDS
    assert all(count > 0 for count in finished.values())
    assert done_per_kind["errors"] == {}
    # The cancelling kinds were cancelled, as the server told them.
    assert {"grpc_cancel", "grpc_timeout", "grpc_stream_cancel"} <= set(done_per_kind["cancelled"])
