"""A conversation's ``prompt_cache_key`` end to end: a real gateway whose approximate tree is
too small to keep any conversation, three simulated workers, and a long request started
before each later turn on the least loaded worker (so that, the tree having forgotten the
conversation, each turn is a miss that goes to the next idle worker). With the key every
turn lands on the first turn's worker and finds its history cached there; without it (the
control) the turns wander and find nothing."""

from __future__ import annotations

import http.client
import json
import random
import time
from urllib.parse import urlsplit

from tests.conftest import MODEL
from tests.support import get_text, metric_value, policy_stats, request_json

TURNS = 3


def _routed(base: str, urls: list[str]) -> list[float]:
    text = get_text(base + "/metrics")
    return [metric_value(text, "kvgate_routed_total", worker=u) for u in urls]


def _hold_a_worker(base: str, urls: list[str], seed: int) -> http.client.HTTPConnection:
    """A long streamed generation, left in flight (the caller closes it): one more request
    on the least loaded worker. Returns once the gateway has routed it."""
    before = sum(_routed(base, urls))
    host = urlsplit(base)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
    text = "".join(random.Random(seed).choice("abcdefgh ") for _ in range(300))
    conn.request("POST", "/generate", json.dumps({"text": text, "stream": True, "sampling_params": {
        "max_new_tokens": 60_000, "ignore_eos": True}}), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while sum(_routed(base, urls)) == before:
        assert time.monotonic() < deadline, "the long request was never routed"
        time.sleep(0.02)
    return conn


def _converse(base: str, urls: list[str], seed: int, key: str | None) -> tuple[list[int], list[int]]:
    """(the worker's place in ``urls``, the engine's cached tokens) per turn."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "".join(rng.choice("ijklmnop ") for _ in range(1500))}]
    places, cached, held = [], [], []
    try:
        for turn in range(TURNS):
            if turn:
                held.append(_hold_a_worker(base, urls, seed * 100 + turn))
            messages.append({"role": "user", "content": "".join(rng.choice("qrstuv ") for _ in range(300))})
            body = {"model": MODEL, "messages": messages, "max_tokens": 16}
            if key is not None:
                body["prompt_cache_key"] = key
            before = _routed(base, urls)
            status, out = request_json("POST", base + "/v1/chat/completions", body)
            assert status == 200, out
            after = _routed(base, urls)
            moved = [i for i, (a, b) in enumerate(zip(before, after)) if b > a]
            assert len(moved) == 1, (before, after)
            places.append(moved[0])
            cached.append((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
    finally:
        for conn in held:
            conn.close()
    return places, cached


def test_a_keyed_conversation_stays_on_its_worker_where_the_tree_forgot_it(start_sim, start_gateway):
    sims = [start_sim("--time-scale", "5", name=f"sim{i}") for i in range(3)]
    urls = [s.url for s in sims]
    args = ("--policy", "cache_aware", "--policy-option", "max_tree_size=1")

    keyed = start_gateway(*urls, args=args)
    places, cached = _converse(keyed.url, urls, seed=1, key="conversation-1")
    assert len(set(places)) == 1, places
    assert all(c > 0 for c in cached[1:]), cached
    stats = policy_stats(keyed.url)
    assert stats["affinity_credited_total"] == TURNS - 1 and stats["affinity_kept_total"] == TURNS - 1
    keyed.stop()

    control = start_gateway(*urls, args=args)
    places, cached = _converse(control.url, urls, seed=2, key=None)
    assert len(set(places)) == TURNS, places
    assert cached[1:] == [0] * (TURNS - 1), cached
    assert "affinity_keys" not in policy_stats(control.url)
