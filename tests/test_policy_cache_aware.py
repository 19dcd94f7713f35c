"""cache_aware as a pure function over worker snapshots."""

from __future__ import annotations

import logging
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Outcome, RequestView, WorkerView
from policies.cache_aware import CacheAware
from policies.loader import load_policy
from index.prefix import IndexMatch, Tiers
from wire.chat_template import apply_chat_template

SYSTEM = "You are a careful assistant. " * 20


def workers(n: int = 4, loads: list[int] | None = None) -> list[WorkerView]:
    loads = loads or [0] * n
    return [WorkerView(f"http://127.0.0.1:{8000 + i}", in_flight=loads[i]) for i in range(n)]


def chat(rid: str, *turns: str, system: str = "Be brief.") -> RequestView:
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return RequestView(rid, "/v1/chat/completions", text=apply_chat_template(messages))


def test_registered_under_its_name():
    assert isinstance(load_policy("cache_aware", cache_threshold="0.5"), CacheAware)


def test_follow_up_turn_returns_to_the_worker_that_holds_the_history():
    policy = CacheAware()
    ws = workers()
    first = policy.select(chat("a1", "Tell me about radix trees in detail please."), ws)
    assert first.reason == "miss"
    # Another conversation (sharing only a short system prompt) lands elsewhere: least
    # loaded, then smallest tree.
    other = policy.select(chat("b1", "Something else entirely, about cooking pasta. " * 4), ws)
    second = policy.select(chat("a2", "Tell me about radix trees in detail please.", "Sure: ...", "More."), ws)
    assert second.worker.url == first.worker.url and second.reason == "prefix"
    assert other.worker.url != first.worker.url
    assert second.predicted_cached_tokens > 0


def test_imbalanced_fleet_goes_to_least_load_even_on_a_hit():
    policy = CacheAware()
    ws = workers()
    owner = policy.select(chat("a1", "question one"), ws).worker
    loads = [100 if w.url == owner.url else 10 for w in ws]
    loads[3] = 5 if ws[3].url != owner.url else loads[3]
    ws2 = workers(4, loads)
    choice = policy.select(chat("a2", "question one", "answer", "q2"), ws2)
    assert choice.reason == "imbalanced"
    assert choice.worker.in_flight == min(loads)
    # Only both conditions make an imbalance: 100 vs 40 passes abs (>64)? no: 60 < 64.
    ws3 = workers(4, [100 if w.url == owner.url else 40 for w in ws])
    assert policy.select(chat("a3", "question one", "answer", "q2"), ws3).reason == "prefix"


def test_below_threshold_goes_to_least_loaded_with_smallest_tree():
    policy = CacheAware(cache_threshold=0.9)
    ws = workers(3, [0, 0, 0])
    policy.select(RequestView("x", "/generate", text="a" * 100), ws)  # fills worker 0
    choice = policy.select(RequestView("y", "/generate", text="a" * 50 + "b" * 60), workers(3, [0, 0, 0]))
    assert choice.reason == "miss" and choice.worker.url != ws[0].url


def test_least_loaded_among_workers_sharing_the_prefix():
    policy = CacheAware(balance_abs_threshold=1000)
    ws = workers(3)
    text = "shared document " * 50
    for i, w in enumerate(ws[:2]):  # two workers already hold the prefix
        policy.index.record(RequestView(f"seed{i}", "/generate", text=text), w)
    busy_first = workers(3, [7, 2, 0])
    choice = policy.select(RequestView("q", "/generate", text=text + "question?"), busy_first)
    assert choice.worker.url == ws[1].url and choice.reason == "prefix"


def test_herd_of_identical_prefixes_spreads_once_the_owner_is_overloaded():
    policy = CacheAware(balance_abs_threshold=8, balance_rel_threshold=1.5)
    n = 4
    in_flight = [0] * n
    landed = Counter()
    for i in range(200):  # a burst: nothing completes meanwhile
        ws = workers(n, in_flight)
        choice = policy.select(RequestView(f"r{i}", "/generate", text=SYSTEM + f"item {i}"), ws)
        idx = [w.url for w in ws].index(choice.worker.url)
        in_flight[idx] += 1
        landed[idx] += 1
    assert len(landed) == n
    assert max(landed.values()) - min(landed.values()) <= 8 + 1
    # The router's rule without the shared-prefix fan-out would keep sending to the owner
    # until the abs threshold trips every time; here the spill workers become sharers.
    assert policy.decisions["prefix"] > 0 and policy.decisions["imbalanced"] > 0


def test_budget_is_enforced_through_the_policy():
    policy = CacheAware(max_tree_size=5_000)
    ws = workers(8)
    for i in range(300):
        policy.select(RequestView(f"r{i}", "/generate", text=f"{i} " + "y" * 200), ws)
    stats = policy.stats()
    assert stats["index_units"] <= 5_000 and stats["index_evicted_units"] > 0


def test_hit_verification_degrades_to_load_and_recovers(caplog):
    policy = CacheAware(drift_window=20, drift_min_samples=10)
    ws = workers(4)
    text = SYSTEM + "same question"
    policy.select(RequestView("seed", "/generate", text=text), ws)
    caplog.set_level(logging.WARNING, logger="kvgate.policies.hit_verification")

    def run(i: int, cached_share: float, loads: list[int]) -> str:
        request = RequestView(f"q{i}", "/generate", text=text)
        choice = policy.select(request, workers(4, loads))
        prompt = 400
        policy.on_complete(request, choice.worker,
                           Outcome(ok=True, prompt_tokens=prompt, cached_tokens=int(cached_share * prompt)))
        return choice.reason

    # The engine reports no reuse at all: a template/hash mismatch.
    reasons = [run(i, 0.0, [0, 0, 0, 0]) for i in range(12)]
    assert reasons[-1] == "degraded" and policy.stats()["hit_degraded"] == 1.0
    assert "did not happen" in caplog.text
    loaded = [5, 0, 0, 0]
    choice = policy.select(RequestView("probe", "/generate", text=text), workers(4, loaded))
    assert choice.reason == "degraded" and choice.worker.in_flight == 0
    # The engine agrees with the index again: cache routing resumes.
    for i in range(30):
        if run(100 + i, 1.0, [0, 0, 0, 0]) == "prefix":
            break
    assert policy.stats()["hit_degraded"] == 0.0 and "resumed" in caplog.text
    stats = policy.stats()
    assert stats["hit_predicted_tokens_total"] > stats["hit_actual_tokens_total"] > 0


def test_removed_worker_is_forgotten():
    policy = CacheAware()
    ws = workers(2)
    owner = policy.select(RequestView("a", "/generate", text="hello " * 100), ws).worker
    policy.on_worker_removed(owner)
    assert policy.index.worker_size(owner.url) == 0


def test_auto_budget_follows_the_fleets_kv_capacity():
    policy = CacheAware(max_tree_size="auto")
    ws = [WorkerView(f"http://127.0.0.1:{8400 + i}", server_info={"max_total_num_tokens": 2_000}) for i in range(4)]
    for w in ws:
        policy.on_worker_added(w)
    for i in range(400):  # byte-tokenizer-like engine: one token per character
        request = RequestView(f"r{i}", "/generate", text=f"conversation {i} " + "z" * 300)
        choice = policy.select(request, ws)
        policy.on_complete(request, choice.worker, Outcome(ok=True, prompt_tokens=len(request.text), cached_tokens=0))
    stats = policy.stats()
    assert stats["index_fleet_capacity_tokens"] == 8_000
    assert 0.9 < stats["index_units_per_token"] < 1.5  # learned down from the BPE default of 4
    assert stats["index_units"] <= 1.5 * 8_000 and stats["index_evicted_units"] > 0
    # A worker that reports a larger pool, and one that leaves, move the budget at once.
    policy.on_worker_updated(WorkerView(ws[0].url, server_info={"max_total_num_tokens": 6_000}))
    assert policy.stats()["index_fleet_capacity_tokens"] == 12_000
    policy.on_worker_removed(ws[1])
    assert policy.stats()["index_fleet_capacity_tokens"] == 10_000
    # Without a known capacity the fallback budget holds; the default is that fixed budget.
    assert CacheAware(max_tree_size="auto").stats()["index_budget_units"] == 1 << 24
    assert CacheAware().stats()["index_budget_units"] == 1 << 24


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_prefix_every_worker_can_load_decides_as_listing_it_per_worker(data):
    """A prompt in the shared pool comes as one ``everyone`` entry beside the workers holding
    more; the rule must pick exactly what it picks when every worker is listed with it."""
    n = data.draw(st.integers(1, 6), label="workers")
    ws = workers(n, data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="loads"))
    policy = CacheAware(balance_abs_threshold=data.draw(st.sampled_from([1, 64]), label="abs threshold"))
    tiers = st.builds(Tiers, st.integers(0, 60), st.integers(0, 60), st.integers(0, 60))
    everyone = Tiers(pool=data.draw(st.integers(0, 100), label="pooled"))
    listed = {w.url: t for w in ws if data.draw(st.booleans()) and (t := data.draw(tiers)).total >= everyone.total}
    request = RequestView("r", "/generate", token_ids=[1] * 100)
    compact = policy.decide(request, ws, IndexMatch(100, "tokens", dict(listed), everyone))
    spelled = {w.url: listed.get(w.url, everyone) for w in ws if listed.get(w.url, everyone).total}
    assert compact == policy.decide(request, ws, IndexMatch(100, "tokens", spelled))
