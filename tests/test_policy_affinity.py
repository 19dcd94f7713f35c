"""Affinity on the client's keys (policies.affinity): the table on its own, then each
cache-aware policy preferring a key's last worker where its index knows nothing, and not
where that worker is overloaded."""

from __future__ import annotations

import random

import pytest

import policies.affinity as affinity
from index.prefix import IndexMatch, Tiers
from index.block_index import BlockIndex
from policies.affinity import AffinityTable, ends, forgetting
from policies.base import Outcome, RequestView, WorkerView
from policies.cache_aware import CacheAware
from policies.cost import Cost
from policies.kv_events import KvEvents
from policies.loader import load_policy

URLS = [f"http://127.0.0.1:{9100 + i}" for i in range(4)]
_rng = random.Random(7)
SYSTEM = "".join(_rng.choice("abcdefghij klmnop") for _ in range(600))


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("qrstuvwxyz .,") for _ in range(n))


def fleet(loads: list[int] | None = None, capacity: int | None = None) -> list[WorkerView]:
    info = {"max_total_num_tokens": capacity} if capacity else {}
    return [WorkerView(u, in_flight=(loads or [0] * 4)[i], server_info=info) for i, u in enumerate(URLS)]


def req(rid: str, text: str, key: str | None = "conv-1", salt: str | None = None) -> RequestView:
    return RequestView(rid, "/v1/chat/completions", text=text, session_key=key, cache_salt=salt)


def ids_req(rid: str, ids: list[int], key: str | None = "conv-1") -> RequestView:
    return RequestView(rid, "/generate", token_ids=ids, session_key=key)


def served(table_or_policy, request: RequestView, worker: WorkerView, output: int = 50, ok: bool = True) -> None:
    """Routed to ``worker`` and completed there, as the engine reports it (a character a token)."""
    hook = getattr(table_or_policy, "on_routed", None) or table_or_policy.routed
    done = getattr(table_or_policy, "on_complete", None) or table_or_policy.completed
    hook(request, worker)
    if hasattr(table_or_policy, "on_first_token"):
        table_or_policy.on_first_token(request, worker)
    n = len(request.token_ids) if request.token_ids is not None else len(request.text or "")
    done(request, worker, Outcome(ok=ok, prompt_tokens=n, cached_tokens=0, completion_tokens=output))


TURN1 = SYSTEM + words(2000, 1)
TURN2 = TURN1 + words(50, 2) + words(400, 3)  # the answer (50 tokens), then the next question


# -- the table ------------------------------------------------------------------------
def test_samples_end_at_halves_of_what_is_left_then_at_the_end():
    assert ends(6400) == (3200, 4800, 5600, 6000, 6200, 6300, 6400)
    assert ends(10) == (10,) and ends(20) == (18, 19, 20)


def test_a_continuation_is_credited_its_whole_history_and_the_answer():
    table, ws = AffinityTable(), fleet()
    served(table, req("t1", TURN1), ws[2], output=50)
    got = table.credit(req("t2", TURN2), ws, IndexMatch(len(TURN2), "chars"))
    assert got.hits == {URLS[2]: Tiers(len(TURN1) + 50)}
    assert table.credited == 1


def test_a_prompt_that_shares_part_of_the_last_one_is_credited_that_part():
    table, ws = AffinityTable(), fleet()
    served(table, req("t1", TURN1), ws[1])
    edited = TURN1[:int(len(TURN1) * 0.8)] + words(900, 9)  # history rewritten from 80% on
    got = table.credit(req("t2", edited), ws, IndexMatch(len(edited), "chars"))
    share = got.hits[URLS[1]].total
    assert ends(len(TURN1))[1] == share  # 3/4 of the last prompt: the last sample before 80%
    # another conversation under the same key shares only what every prompt shares
    other = SYSTEM + words(3000, 11)
    assert table.credit(req("t3", other), ws, IndexMatch(len(other), "chars")).hits == {}


def test_token_ids_are_sampled_as_ids_whatever_their_container():
    from array import array

    table, ws = AffinityTable(), fleet()
    first = list(range(1000, 3000))
    served(table, ids_req("t1", first), ws[3], output=10)
    nxt = array("I", first + list(range(5, 300)))
    got = table.credit(ids_req("t2", nxt), ws, IndexMatch(len(nxt), "tokens"))
    assert got.hits == {URLS[3]: Tiers(2010)}
    # text under a key whose last turn was ids: not comparable, no credit
    assert table.credit(req("t3", TURN2), ws, IndexMatch(len(TURN2), "chars")).hits == {}


def test_no_credit_where_the_index_knows_as_much_and_the_match_is_never_changed():
    table, ws = AffinityTable(), fleet()
    served(table, req("t1", TURN1), ws[2])
    known = IndexMatch(len(TURN2), "chars", {URLS[0]: Tiers(len(TURN2) - 1)})
    assert table.credit(req("t2", TURN2), ws, known) is known
    partial = IndexMatch(len(TURN2), "chars", {URLS[2]: Tiers(100, 200)})
    got = table.credit(req("t2", TURN2), ws, partial)
    assert partial.hits == {URLS[2]: Tiers(100, 200)}
    assert got.hits[URLS[2]] == Tiers(len(TURN1) + 50 - 200, 200) and got is not partial


def test_an_index_that_could_not_key_the_request_is_answered_in_its_units():
    table, ws = AffinityTable(), fleet()
    served(table, req("t1", TURN1), ws[2])
    got = table.credit(req("t2", TURN2), ws, IndexMatch())
    assert (got.query_len, got.unit) == (len(TURN2), "chars") and got.hits[URLS[2]].total == len(TURN1) + 50


def test_what_a_key_does_not_credit():
    table, ws = AffinityTable(), fleet()
    served(table, req("t1", TURN1, salt="a"), ws[2])
    q = IndexMatch(len(TURN2), "chars")
    assert table.credit(req("t2", TURN2, salt="b"), ws, q).hits == {}  # another salt: another cache
    assert table.credit(req("t2", TURN2, key="conv-2", salt="a"), ws, q).hits == {}  # another key
    assert table.credit(req("t2", TURN2, salt="a"), ws[:2], q).hits == {}  # its worker is not a candidate
    assert table.credit(req("t1", TURN1, salt="a"), ws, q).hits == {}  # the turn itself, tried again
    assert table.credit(req("t2", TURN2, salt="a"), ws, q).hits  # the control
    table.worker_removed(URLS[2])
    assert table.credit(req("t2", TURN2, salt="a"), ws, q).hits == {}  # its worker left


def test_a_failed_turn_is_forgotten_and_a_decode_leg_is_not_learned():
    table, ws = AffinityTable(), fleet()
    q = IndexMatch(len(TURN2), "chars")
    served(table, req("t1", TURN1), ws[2], ok=False)
    assert table.credit(req("t2", TURN2), ws, q).hits == {}
    table.routed(req("t1", TURN1), WorkerView(URLS[1], role="decode"))
    assert len(table) == 0


def test_the_least_recently_used_key_is_forgotten_past_the_bound():
    table, ws = AffinityTable(max_entries=2), fleet()
    for k in ("a", "b", "c"):
        served(table, req(f"{k}1", TURN1, key=k), ws[1])
    assert len(table) == 2
    q = IndexMatch(len(TURN2), "chars")
    assert table.credit(req("a2", TURN2, key="a"), ws, q).hits == {}
    assert table.credit(req("c2", TURN2, key="c"), ws, q).hits


def test_credit_falls_with_the_workers_kv_churn(monkeypatch):
    table, ws = AffinityTable(), fleet(capacity=100_000)
    served(table, req("t1", TURN1), ws[2], output=0)
    q = IndexMatch(len(TURN2), "chars")
    credit = lambda: table.credit(req("t2", TURN2), ws, q).hits.get(URLS[2], Tiers()).total  # noqa: E731
    assert credit() == len(TURN1)
    other = ws[2]
    table.completed(req("x", "y", key=None), other, Outcome(True, prompt_tokens=40_000, cached_tokens=0))
    assert credit() == len(TURN1)  # under half the pool written since: whole
    table.completed(req("x", "y", key=None), other, Outcome(True, prompt_tokens=30_000, cached_tokens=0))
    assert credit() == round(len(TURN1) * 0.6)  # 70% written: falling
    table.completed(req("x", "y", key=None), ws[1], Outcome(True, prompt_tokens=90_000, cached_tokens=0))
    assert credit() == round(len(TURN1) * 0.6)  # another worker's churn is not this one's
    table.completed(req("x", "y", key=None), other, Outcome(True, prompt_tokens=30_000, cached_tokens=0))
    assert credit() == 0


def test_credit_falls_with_age_without_a_capacity_and_ends_at_the_ttl(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(affinity, "_clock", lambda: now[0])
    table, ws = AffinityTable(ttl_s=1000.0), fleet()
    served(table, req("t1", TURN1), ws[2], output=0)
    q = IndexMatch(len(TURN2), "chars")
    now[0] += 250.0
    assert table.credit(req("t2", TURN2), ws, q).hits[URLS[2]].total == round(len(TURN1) * 0.75)
    now[0] += 751.0
    assert table.credit(req("t2", TURN2), ws, q).hits == {}
    assert len(table) == 0


def test_stats_appear_once_a_key_is_seen():
    table, ws = AffinityTable(), fleet()
    served(table, req("x1", TURN1, key=None), ws[0])
    assert table.stats() == {}
    served(table, req("t1", TURN1), ws[1])
    served(table, req("t2", TURN2), ws[1])
    served(table, req("t3", TURN2 + "more"), ws[2])
    assert table.stats() == {"affinity_keys": 1.0, "affinity_credited_total": 0.0, "affinity_kept_total": 1.0,
                             "affinity_moved_total": 1.0}


# -- the policies ---------------------------------------------------------------------
def test_options_parse_and_off_means_no_table():
    assert load_policy("cache_aware").affinity is not None
    assert load_policy("cost", affinity="false").affinity is None
    policy = load_policy("kv_events", affinity="on", affinity_entries="10", affinity_ttl_s="60")
    assert (policy.affinity.max_entries, policy.affinity.ttl_s) == (10, 60.0)


def _cache_aware(**kw) -> CacheAware:
    return CacheAware(max_tree_size=1, **kw)  # a tree too small to keep any conversation


@pytest.mark.parametrize("make", [_cache_aware, lambda **kw: KvEvents(**kw)], ids=["cache_aware", "kv_events"])
def test_cache_aware_rules_follow_the_key_where_the_index_knows_nothing(make):
    ws = fleet()
    as_ids = make is not _cache_aware  # the precise index keys token ids
    turn1 = ids_req("t1", list(range(3000))) if as_ids else req("t1", TURN1)
    turn2 = ids_req("t2", list(range(3400))) if as_ids else req("t2", TURN2)
    policy = make()
    served(policy, turn1, ws[2])
    choice = policy.select(turn2, ws)
    assert (choice.worker.url, choice.reason) == (URLS[2], "prefix")
    assert choice.predicted_cached_tokens > 0
    assert policy.stats()["affinity_credited_total"] == 1.0
    # the control: no key, or affinity off, and the index alone sends it to the least loaded
    keyless = RequestView("t2", turn2.route, text=turn2.text, token_ids=turn2.token_ids)
    assert policy.select(keyless, ws).worker.url == URLS[0]
    off = make(affinity=False)
    served(off, turn1, ws[2])
    assert off.select(turn2, ws).worker.url == URLS[0]


def test_cache_aware_leaves_the_keys_worker_when_the_fleet_is_imbalanced():
    policy = _cache_aware()
    served(policy, req("t1", TURN1), fleet()[2])
    choice = policy.select(req("t2", TURN2), fleet([10, 20, 100, 30]))
    assert (choice.worker.url, choice.reason) == (URLS[0], "imbalanced")


@pytest.mark.parametrize("index", ["approx", "auto"])
def test_cost_prices_the_keys_worker_with_its_probable_hit(index):
    ws = fleet()
    policy = Cost(index=index, max_tree_size=1)
    served(policy, req("t1", TURN1), ws[2])
    choice = policy.select(req("t2", TURN2), ws)
    prompt = len(TURN2) // 4  # what cost prices a text prompt at, in tokens
    assert choice.worker.url == URLS[2]
    assert choice.predicted_cached_tokens == round((len(TURN1) + 50) / len(TURN2) * prompt)
    keyless = Cost(index=index, max_tree_size=1, affinity=False)
    served(keyless, req("t1", TURN1), ws[2])
    assert keyless.select(req("t2", TURN2), ws).worker.url == URLS[0]


def test_cost_leaves_the_keys_worker_when_its_queue_costs_more_than_the_hit_saves():
    ws = fleet()
    policy = Cost(index="approx", max_tree_size=1, hold_wait_s=0)
    served(policy, req("t1", TURN1), ws[2])
    for i in range(4):  # long prompts queued there, not yet started: seconds of prefill
        policy.on_routed(RequestView(f"q{i}", "/generate", text="z" * 200_000), ws[2])
    choice = policy.select(req("t2", TURN2), ws)
    assert choice.worker.url != URLS[2]
    # the control: the same policy with nothing queued there follows the key
    fresh = Cost(index="approx", max_tree_size=1, hold_wait_s=0)
    served(fresh, req("t1", TURN1), ws[2])
    assert fresh.select(req("t2", TURN2), ws).worker.url == URLS[2]


def test_peers_routing_fills_the_table():
    ws = fleet()
    for policy in (_cache_aware(), Cost(index="approx", max_tree_size=1)):
        policy.on_peer_routed(req("t1@p", TURN1), ws[3], 0)
        policy.on_complete(req("t1@p", TURN1), ws[3], Outcome(True, prompt_tokens=len(TURN1), completion_tokens=5))
        assert policy.select(req("t2", TURN2), ws).worker.url == URLS[3]


def test_a_precise_index_that_forgot_nothing_since_the_turn_has_the_last_word():
    """Fed by KV events, the index hears of the engines' evictions: no pages of the last turn
    on its worker means none there, until the index itself lets go of pages (a budget, a
    cleared worker), when it may no longer know."""
    index = BlockIndex(default_page_size=16)
    ws = fleet()
    policy = Cost(index=index)
    turn1, turn2 = ids_req("t1", list(range(3000))), ids_req("t2", list(range(3400)))
    served(policy, turn1, ws[2])
    assert forgetting(index, turn2) == index.forgotten == 0
    assert policy.select(turn2, ws).worker.url == URLS[0]
    index.clear_worker(URLS[0])  # a gap on a worker's stream: the index may have lost pages
    assert forgetting(index, turn2) == 1
    assert policy.select(ids_req("t3", list(range(3400))), ws).worker.url == URLS[2]
    # text the precise index cannot key: a guess, credited whatever the count
    assert forgetting(index, req("t4", TURN2)) is None
