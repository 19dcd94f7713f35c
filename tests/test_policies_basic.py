"""The simple built-in policies as pure functions over worker snapshots."""

from __future__ import annotations

import asyncio
import collections

import pytest

from policies.base import EngineLoad, NoWorkerAvailable, RequestView, WorkerView
from policies.loader import load_policy


def workers(n: int, **kw) -> list[WorkerView]:
    return [WorkerView(url=f"http://w{i}:1", **kw) for i in range(n)]


def req(session: str | None = None) -> RequestView:
    return RequestView(request_id="r", route="/generate", text="hello", session_key=session)


def test_round_robin_cycles_through_every_worker():
    ws = workers(3)
    policy = load_policy("round_robin")
    picks = [policy.select(req(), ws).worker.url for _ in range(6)]
    assert picks == [w.url for w in ws] * 2


def test_least_load_picks_fewest_in_flight():
    ws = [WorkerView(url=f"http://w{i}:1", in_flight=n) for i, n in enumerate((5, 1, 3))]
    assert load_policy("least_load").select(req(), ws).worker is ws[1]


def test_power_of_two_never_picks_the_busier_of_its_pair():
    ws = workers(2)
    ws[0] = ws[0].reported(load=EngineLoad(running=10, waiting=5))
    policy = load_policy("power_of_two", seed=1)
    assert {policy.select(req(), ws).worker.url for _ in range(20)} == {ws[1].url}


def test_power_of_two_counts_in_flight_booked_since_the_last_load_report():
    ws = [WorkerView(url="http://w0:1", load=EngineLoad(running=0), in_flight=6),
          WorkerView(url="http://w1:1", load=EngineLoad(running=2))]
    assert load_policy("power_of_two", seed=3).select(req(), ws).worker is ws[1]


def test_consistent_hash_is_sticky_and_moves_few_sessions_when_a_worker_leaves():
    ws = workers(5)
    policy = load_policy("consistent_hash")
    before = {f"s{i}": policy.select(req(f"s{i}"), ws).worker.url for i in range(500)}
    assert before == {f"s{i}": policy.select(req(f"s{i}"), ws).worker.url for i in range(500)}
    assert len(set(before.values())) == 5
    gone = ws.pop()
    after = {s: policy.select(req(s), ws).worker.url for s in before}
    moved = [s for s in before if before[s] != after[s]]
    assert all(before[s] == gone.url for s in moved)  # only the removed worker's sessions move
    spread = collections.Counter(before.values())
    assert max(spread.values()) < 2.5 * min(spread.values())


def test_random_and_empty_pool():
    ws = workers(4)
    policy = load_policy("random", seed=7)
    assert len({policy.select(req(), ws).worker.url for _ in range(100)}) == 4
    with pytest.raises(NoWorkerAvailable):
        policy.select(req(), [])


def test_unknown_policy_names_the_available_ones():
    with pytest.raises(ValueError, match="round_robin"):
        load_policy("no_such_policy")


def test_only_prompt_reading_policies_ask_for_the_prompt():
    from policies.loader import load_policy_class

    assert not any(load_policy_class(n).needs_prompt
                   for n in ("round_robin", "random", "least_load", "power_of_two", "consistent_hash"))
    assert all(load_policy_class(n).needs_prompt for n in ("cache_aware", "kv_events", "cost", "pd_cost"))


def test_view_without_prompt_skips_template_and_tokenizer():
    from gateway.encoding import PromptEncoder
    from gateway.request import CHAT, build_view, parse_body
    from wire.tokenizer import ByteTokenizer

    body = parse_body(b'{"model":"m","messages":[{"role":"user","content":"hello"}]}', CHAT)
    full = asyncio.run(build_view(body, CHAT, {}, "r", PromptEncoder(ByteTokenizer())))
    bare = asyncio.run(build_view(body, CHAT, {}, "r", PromptEncoder(ByteTokenizer()), with_prompt=False))
    assert full.text and full.token_ids and bare.text is None and bare.token_ids is None
    assert bare.model == "m"


def test_same_urls_sees_through_replaced_views_but_not_a_changed_fleet():
    from index.views import SameUrls

    views = [WorkerView(f"http://127.0.0.1:{p}") for p in (1, 2, 3)]
    same = SameUrls()
    assert same.changed(views) and same.urls == [v.url for v in views]
    assert not same.changed(views)  # the same objects
    replaced = [views[0], views[1].with_in_flight(4), views[2]]  # as the gateway replaces them
    assert not same.changed(replaced)
    assert same.changed(replaced[::-1])  # another order: positions move
    assert same.changed(replaced[:2])  # a worker left
    assert same.changed(tuple(replaced))  # any sequence
