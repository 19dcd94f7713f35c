"""The cache-aware policies end to end: ``kvgate up`` (real gateway + simulated SGLang
workers, real HTTP and ZMQ on 127.0.0.1), multi-turn chats, then the policy's own stats
scraped from /metrics. Follow-up turns must land where their history is cached, and the
index's predicted cached tokens must agree with what the engines report."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from tests.support import Proc, free_port

pytest.importorskip("simulator.cluster")
pytest.importorskip("gateway.cli")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read()


def _run(*args: str) -> tuple[list[tuple[int, int]], dict[str, float]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = Proc.python("gateway.cli", "up", "--workers", "3", "--port", str(port), *args, name="kvgate-up")
    try:
        proc.wait_http(base + "/v1/models", timeout=60)
        model = json.loads(_get(base + "/v1/models"))["data"][0]["id"]
        usage = []
        for conv in range(3):
            messages = [{"role": "system", "content": f"conversation {conv}: " + "background " * 80}]
            for turn in range(3):
                messages.append({"role": "user", "content": f"question {turn} " * 20})
                body = json.dumps({"model": model, "messages": messages, "max_tokens": 16}).encode()
                req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    out = json.loads(resp.read())
                details = out["usage"].get("prompt_tokens_details") or {}
                usage.append((turn, details.get("cached_tokens") or 0))
                messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        stats = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'kvgate_policy_stat\{[^}]*stat="([a-z_]+)"\} ([0-9.e+-]+)', _get(base + "/metrics").decode())}
        return usage, stats
    finally:
        proc.stop()


@pytest.mark.parametrize("args", [
    ("--policy", "kv_events", "--kv-events"),
    ("--policy", "cost", "--kv-events"),  # index=auto: precise, since the workers publish
    ("--policy", "cache_aware"),
    ("--policy", "cost"),  # index=auto without events: the approximate tree
], ids=["kv_events", "cost-events", "cache_aware", "cost-no-events"])
def test_follow_up_turns_hit_and_predictions_match_the_engine(args):
    usage, stats = _run(*args)
    assert all(cached > 0 for turn, cached in usage if turn > 0), usage
    assert stats["hit_verified_requests_total"] == len(usage)
    assert stats["hit_actual_tokens_total"] > 0
    if "--kv-events" in args:  # precise: the engines' own block hashes
        assert stats["kv_messages"] > 0 and stats["fallback_requests_total"] == 0
        assert stats["hit_predicted_tokens_total"] == stats["hit_actual_tokens_total"]
    else:  # approximate: text-length estimates, close but not exact
        assert stats["hit_drift_ratio"] < 0.1
