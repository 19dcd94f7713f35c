"""``pd_cost`` prices prefill hit, KV transfer and decode load as one pair decision."""

from __future__ import annotations

from policies.base import EngineLoad, Outcome, RequestView, WorkerView
from policies.loader import load_policy


def view(url: str, role: str, **kw) -> WorkerView:
    return WorkerView(url=url, role=role, **kw)


def req(i: int, text: str) -> RequestView:
    return RequestView(request_id=f"r{i}", route="/generate", text=text)


PROMPT = "shared system prompt " * 2000  # ~10k tokens by the text estimate


def test_long_prompt_keeps_its_kv_on_one_host():
    policy = load_policy("pd_cost", index="approx")
    prefills = [view("http://10.0.0.1:30000", "prefill"), view("http://10.0.0.2:30000", "prefill")]
    decodes = [view("http://10.0.0.2:30001", "decode"), view("http://10.0.0.1:30001", "decode")]
    p, d = policy.select_pair(req(0, PROMPT), prefills, decodes)
    assert p.worker.host == d.worker.host


def test_busy_same_host_decode_loses_to_a_cheaper_transfer():
    policy = load_policy("pd_cost", index="approx", decode_cost_s=0.01)
    prefills = [view("http://10.0.0.1:30000", "prefill")]
    busy = view("http://10.0.0.1:30001", "decode", load=EngineLoad(running=200))
    idle = view("http://10.0.0.2:30001", "decode")
    _, d = policy.select_pair(req(0, PROMPT), prefills, [busy, idle])
    assert d.worker is idle


def test_prefix_hit_on_a_prefill_wins_and_the_pair_follows_it():
    policy = load_policy("pd_cost", index="approx")
    a, b = view("http://10.0.0.1:30000", "prefill"), view("http://10.0.0.2:30000", "prefill")
    decodes = [view("http://10.0.0.1:30001", "decode"), view("http://10.0.0.2:30001", "decode")]
    first, _ = policy.select_pair(req(0, PROMPT + " question one"), [a, b], decodes)
    policy.on_routed(req(0, PROMPT + " question one"), first.worker)
    policy.on_complete(req(0, PROMPT + " question one"), first.worker, Outcome(ok=True, prompt_tokens=10000,
                                                                                 cached_tokens=0))
    second, d = policy.select_pair(req(1, PROMPT + " question two"), [a, b], decodes)
    assert second.worker is first.worker and second.predicted_cached_tokens
    assert d.worker.host == second.worker.host


def test_a_prefill_worker_holds_the_prompt_kv_only_until_the_transfer():
    """In PD the prefill engine frees a request's KV once it is sent to decode (the first
    token), however long decoding runs: booking it until completion would price a full
    pool that is not there."""
    policy = load_policy("pd_cost", memory=True)
    prefill = WorkerView("http://10.0.0.1:30000", role="prefill", server_info={"max_total_num_tokens": 100_000})
    req = RequestView("r", "/generate", token_ids=list(range(60_000)), max_tokens=4000)
    policy.on_routed(req, prefill)
    assert policy.stats()["booked_kv_tokens"] == 60_000  # the prompt, no output share
    probe = RequestView("p", "/generate", token_ids=list(range(100_000, 160_000)), max_tokens=10)
    before = policy.price(probe, [prefill])[0][0][0]
    policy.on_first_token(req, prefill)
    assert policy.stats()["booked_kv_tokens"] == 0
    assert policy.price(probe, [prefill])[0][0][0] < before
    policy.on_complete(req, prefill, Outcome(ok=True, completion_tokens=4000))
    assert policy.stats()["booked_kv_tokens"] == 0


def test_a_pair_is_held_while_every_prefill_is_busy_when_asked():
    from policies.base import Hold

    assert load_policy("pd_cost").hold_wait_s == 0  # off by default (bench/RESULTS.md, PD section)
    policy = load_policy("pd_cost", index="approx", attention_tokens=0, hold_wait_s=0.1)
    prefills = [view("http://10.0.0.1:30000", "prefill"), view("http://10.0.0.2:30000", "prefill")]
    decodes = [view("http://10.0.0.1:30001", "decode")]
    busy = []
    for i, p in enumerate(prefills):  # ~2 s of prefill queued on each (50k tokens at 25k/s)
        r = RequestView(f"busy{i}", "/generate", token_ids=list(range(i * 100_000, i * 100_000 + 50_000)))
        policy.on_routed(r, p)
        busy.append(r)
    held = policy.select_pair(RequestView("h", "/generate", text="hold me " * 100, may_hold=True), prefills, decodes)
    assert isinstance(held, Hold) and policy.stats()["holds"] == 1
    p, d = policy.select_pair(RequestView("n", "/generate", text="hold me " * 100), prefills, decodes)
    assert p.worker in prefills and d.worker is decodes[0]  # may not hold: the pair is chosen
    policy.on_first_token(busy[0], prefills[0])  # prefill 0's queue drains
    p, _ = policy.select_pair(RequestView("h", "/generate", text="hold me " * 100, may_hold=True), prefills, decodes)
    assert p.worker is prefills[0]
