"""The cache-aware policies end to end: ``kvgate up`` (real gateway + simulated SGLang
workers, real HTTP and ZMQ on 127.0.0.1), multi-turn chats, then the policy's own stats
scraped from /metrics. Follow-up turns must land where their history is cached, and the
index's predicted cached tokens must agree with what the engines report."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.conftest import MODEL
from tests.support import (FREE_PORT, Proc, assert_predicted_exactly, converse, free_port, get_text, metric_value,
                           policy_stats, request_json, serve, wait_until)



def _up(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "up", "--port", FREE_PORT, *args]


def _run(*args: str) -> tuple[list[tuple[int, int]], dict[str, float]]:
    proc = serve(_up("--workers", "3", *args), "/v1/models", name="kvgate-up")
    base = proc.url
    try:
        model = json.loads(get_text(base + "/v1/models"))["data"][0]["id"]
        return converse(base, model, conversations=3, turns=3), policy_stats(base)
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


def test_precise_index_budget_forgets_old_conversations_not_the_current_one():
    """Three conversations of ~26 pages each through a 40-block index: the older ones are
    evicted, each follow-up still finds its own history, predicted exactly."""
    usage, stats = _run("--policy", "kv_events", "--kv-events", "--policy-option", "max_index_blocks=40")
    assert all(cached > 0 for turn, cached in usage if turn > 0), usage
    assert stats["index_evicted_blocks"] > 0 and 0 < stats["index_known_blocks"] <= 40
    assert stats["index_hash_keyed_blocks"] == 0
    assert stats["hit_predicted_tokens_total"] == stats["hit_actual_tokens_total"] > 0


def test_rollouts_that_send_their_own_ids_reuse_the_previous_turns_list():
    """RL-style rollouts on ``/generate``: each turn sends the previous turn's ids plus the
    answer and a tool's result, as ids. The gateway decodes only what each turn adds
    (``wire.prefix_ids``) and the precise index must still predict exactly what the
    engines report cached: ids read wrong would miss the engines' blocks. (Speculative
    entries, which the gateway records from the ids it read, expire before the next turn, so
    only the engines' own events can predict it.)"""
    proc = serve(_up("--workers", "3", "--policy", "kv_events", "--kv-events", "--policy-option",
                     "speculative_ttl_s=0.1"), "/v1/models", name="kvgate-up")
    base = proc.url
    try:
        served = []
        for rollout in range(3):
            ids = [(rollout * 7919 + i * 31) % 200 + 1 for i in range(400)]
            for turn in range(3):
                messages = policy_stats(base)["kv_messages"]
                status, out = request_json("POST", base + "/generate", {
                    "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
                answered = time.monotonic()
                assert status == 200, out
                assert out["meta_info"]["prompt_tokens"] == len(ids)
                served.append((turn, out["meta_info"]["cached_tokens"]))
                ids = ids + [(turn * 13 + i) % 200 + 1 for i in range(120)]
                # The engine's events for this prompt in (its batch went out before the answer),
                # and the speculative entries past their 0.1 s TTL.
                while policy_stats(base)["kv_messages"] == messages or time.monotonic() - answered < 0.15:
                    assert time.monotonic() - answered < 10, "no KV event from the engine within 10 s"
                    time.sleep(0.02)
        stats = policy_stats(base)
        metrics = get_text(base + "/metrics")
    finally:
        proc.stop()
    assert_predicted_exactly(served, stats)
    reuse = {s: metric_value(metrics, "kvgate_tokenizer_stat", stat=f"ids_{s}")
             for s in ("reuse_hits_total", "reuse_misses_total", "reused_total")}
    assert reuse["reuse_hits_total"] == 6 and reuse["reuse_misses_total"] == 3, reuse  # every later turn
    assert reuse["reused_total"] >= 6 * 400, reuse


def test_cost_learns_the_prefill_speed_from_streamed_first_tokens_only():
    """``cost`` times a prefill at its first token. Through the gateway a response that is
    not streamed reaches the policy's first-token hook only when the whole answer is in, so
    it must teach nothing; a streamed one, alone on its worker, is one sample."""
    proc = serve(_up("--workers", "2", "--policy", "cost"), "/v1/models", name="kvgate-up")
    base = proc.url
    try:
        model = json.loads(get_text(base + "/v1/models"))["data"][0]["id"]
        for stream in (False, True):
            for i in range(3):  # one at a time, so each is alone on its worker
                prompt = " ".join(f"s{int(stream)}r{i}w{j}" for j in range(3000))  # ~0.2 s of prefill
                status, out = request_json("POST", base + "/v1/completions", {
                    "model": model, "prompt": prompt, "max_tokens": 24, "stream": stream})
                assert status == 200, out
            stats = policy_stats(base)
            assert stats["prefill_samples"] == (3 if stream else 0), stats
            if not stream:
                assert stats["prefill_tokens_per_s"] == 25_000
    finally:
        proc.stop()


def test_a_worker_that_comes_up_after_the_gateway_is_subscribed_to_once_healthy(start_gateway):
    """Registered while nothing answers there: the gateway reads the worker's server_info
    again when it turns healthy, and the policy subscribes to the publisher it names."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gw = start_gateway(url, args=("--policy", "kv_events", "--tokenizer", "byte"), ready=False)
    assert policy_stats(gw.url)["kv_subscribers"] == 0
    sim = Proc.python("simulator", "serve", "--host", "127.0.0.1", "--port", str(port), "--model-name", MODEL,
                      "--time-scale", "20", "--kv-events-port", str(free_port()), name="late-sim")
    try:
        sim.wait_http(url + "/health", timeout=30)
        wait_until(lambda: policy_stats(gw.url)["kv_subscribers"] >= 1,
                   "the gateway never subscribed to the late worker's KV events", timeout=20, proc=gw)
        assert_predicted_exactly(converse(gw.url, MODEL, conversations=2, turns=2), policy_stats(gw.url))
    finally:
        sim.stop()
