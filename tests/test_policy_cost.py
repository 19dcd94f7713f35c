"""cost: lowest predicted time to first token, over either index."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.hit_loss import diversions
from policies.base import EngineLoad, Hold, Outcome, RequestView, WorkerView
from index.block_index import BlockIndex
from index.views import Workers, new_membership
from policies.cost import Cost
from policies.loader import load_policy
from index.prefix import IndexMatch, Tiers
from wire.hashing import page_hashes
from wire.kv_events import BlockStored

PROMPT = "context " * 500  # 4000 chars, ~1000 tokens by the text estimate


def workers(n: int = 3, **kw) -> list[WorkerView]:
    return [WorkerView(f"http://127.0.0.1:{8100 + i}", **kw) for i in range(n)]


def text_req(rid: str, text: str = PROMPT) -> RequestView:
    return RequestView(rid, "/generate", text=text)


def test_registered_and_options_parse_from_strings():
    policy = load_policy("cost", prefill_tokens_per_s="5000", temperature="0")
    assert isinstance(policy, Cost) and policy.prefill_tps == 5000.0
    with pytest.raises(ValueError):
        Cost(index="bogus")


def test_cached_worker_wins_until_its_queue_costs_more_than_a_full_prefill(caplog, tmp_path):
    policy = Cost(prefill_tokens_per_s=10_000)
    ws = workers()
    first = policy.select(text_req("a"), ws)
    policy.on_routed(text_req("a"), first.worker)  # books ~1000 uncached tokens there
    policy.on_first_token(text_req("a"), first.worker)  # ... now decoding, queue is free
    again = policy.select(text_req("b", PROMPT + " more"), ws)
    assert again.worker.url == first.worker.url
    assert again.predicted_cached_tokens >= 990
    # Stack a big prefill backlog on the cached worker: the request should go elsewhere.
    for i in range(3):
        big = RequestView(f"big{i}", "/generate", token_ids=list(range(i * 10_000, i * 10_000 + 5000)))
        policy.select(big, [first.worker])
        policy.on_routed(big, first.worker)
    assert policy.stats()["diverted"] == 0
    with caplog.at_level("DEBUG", logger="kvgate.policies.cost"):
        moved = policy.select(text_req("c", PROMPT + " other"), ws)
    assert moved.worker.url != first.worker.url
    # The hit it left behind is counted: one decision, the ~1000 cached tokens.
    assert policy.stats()["diverted"] == 1
    assert 990 <= policy.stats()["diverted_tokens"] <= 1001
    # ... and at debug, logged with what its holder was predicted to cost (2+ s of queue),
    # which bench.hit_loss reads back from the gateway's log.
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("diverted c:")]
    assert f"{moved.worker.url} predicted TTFT" in line and f"holder {first.worker.url} " in line
    (tmp_path / "router0.log").write_text(caplog.text)
    got = diversions(tmp_path / "router0.log", long_s=1.0)
    assert got["diverted"] == 1 and 990 <= got["tokens"] <= 1001
    assert got["saved_s"] > 1.0 and got["long"] == 1 and got["long_tokens"] == got["tokens"]
    assert policy.stats()["queued_prefill_tokens"] >= 15_000
    # Completion frees the backlog.
    for i in range(3):
        policy.on_complete(RequestView(f"big{i}", "/generate"), first.worker, Outcome(ok=True))
    assert policy.stats()["queued_prefill_tokens"] < 15_000
    back = policy.select(text_req("d", PROMPT + " again"), ws)
    assert back.worker.url in {first.worker.url, moved.worker.url}  # both hold the prefix now
    assert back.predicted_cached_tokens >= 990


@pytest.mark.parametrize("weight, suffix", [(0.0, 25), (1.0, 500)])
def test_a_burst_of_identical_prompts_spreads_by_booked_work(weight, suffix):
    """Greedy TTFT spreads near-identical prompts once their tails (here ~25 tokens each)
    queue up behind the prefix's prefill; with a work weight a shared prefix is worth some
    queue, so the burst spreads once each request brings a longer uncached tail (~500
    tokens), as real ones do. (Tails of one token each would all wait for the one prefill:
    as the booked queue drains with the clock, the warm worker is the fastest by the
    microseconds since.)"""
    policy = Cost(work_weight=weight)
    ws = workers(4)
    landed = Counter()
    for i in range(40):
        req = text_req(f"r{i}", PROMPT + f"{i:04d}" * suffix)
        choice = policy.select(req, ws)
        policy.on_routed(req, choice.worker)
        landed[choice.worker.url] += 1
    assert len(landed) == 4  # a cache hit is not worth an unbounded queue


@pytest.mark.parametrize("weight", ["auto", 12.0])
def test_the_work_weight_bounds_a_herd_on_one_prefix(weight):
    """At its full weight (a saturated fleet; here load-blind) a miss is charged several
    times the prefill it adds, so a burst sharing one prefix stays on its warm worker a
    while, but only until that worker's queue is worth more than the prefills it saves:
    then the prefix spreads, and the burst ends balanced."""
    policy = Cost(load_aware=False, work_weight=weight)
    ws = workers(4)
    landed = Counter()
    for i in range(80):
        req = text_req(f"r{i}", PROMPT + f"{i:04d}" * 500)
        choice = policy.select(req, ws)
        policy.on_routed(req, choice.worker)
        landed[choice.worker.url] += 1
    assert len(landed) == 4 and max(landed.values()) <= 2 * 80 / 4, landed


class _SteppingClock:
    """``time`` for policies.cost whose ``monotonic`` moves ``step`` seconds per call."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 1000.0, step

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


def _warm_home(monkeypatch, n: int, queued: int, **options) -> tuple[Cost, list[WorkerView], WorkerView, str]:
    """``n`` workers, a ~4000-token prefix on one (``home``) with ``queued`` tokens of prefill
    booked behind it; each reading of the clock 10 ms after the last."""
    monkeypatch.setattr("policies.cost.time", _SteppingClock(0.01))
    policy = Cost(load_window_s=1e-6, **options)
    ws = workers(n)
    prefix = "context " * 2000
    first = text_req("first", prefix + "question one")
    home = policy.select(first, ws).worker
    policy.on_routed(first, home)
    policy.on_first_token(first, home)
    _book(policy, home, "queue", queued, 10_000_000)
    return policy, ws, home, prefix


@pytest.mark.parametrize("others_busy, load_aware, stays", [
    (False, True, False),  # idle fleet: little weight, the request takes an idle worker
    (False, False, True),  # load-blind weight: the hit is worth the queue
    (True, True, True),  # every worker busy: the full weight, the hit is worth the queue
])
def test_the_work_weight_follows_how_much_of_the_fleet_is_busy(monkeypatch, others_busy, load_aware, stays):
    """A miss's extra prefill costs the fleet only where requests queue behind it. The warm
    worker here has ~0.8 s of prefill queued (5 prefills of the shared ~4000-token prefix):
    with the other seven idle a miss there hurts nobody and is ~0.2 s; with all of them
    busy it is charged ``work_weight`` times over, and the warm worker keeps the request.
    (Each reading of the clock 10 ms after the last, ten thousand ``load_window_s``: each
    decision sees the fleet as it is, and the queues have barely drained.)"""
    policy, ws, home, prefix = _warm_home(monkeypatch, 8, 20_000, load_aware=load_aware, work_weight=12.0)
    if others_busy:
        for i, w in enumerate(w for w in ws if w is not home):
            _book(policy, w, f"other{i}", 10_000, 20_000_000 + i * 100_000)
    again = policy.select(text_req("again", prefix + "question two"), ws)
    assert (again.worker.url == home.url) is stays
    assert policy.stats()["diverted"] == (0 if stays else 1)
    # idle: a busy share of 1/8 is odds of 1/7, a third of the odds at 3/4 busy (full weight)
    assert policy.stats()["work_weight"] == (12.0 if stays else pytest.approx(12 * (1 / 7) / 3, rel=1e-3))


def test_the_busy_share_is_averaged_over_load_window_s(monkeypatch):
    """A burst is decided within milliseconds: it sees the fleet as it was before it came,
    and the share moves towards what decisions see only as time passes."""
    clock = _SteppingClock(0.0)
    monkeypatch.setattr("policies.cost.time", clock)
    policy = Cost(load_window_s=1.0)
    ws = workers(4)
    policy.select(text_req("first"), ws)  # the first decision takes the share it finds
    assert policy.stats()["busy_share"] == 0.0 and policy.stats()["work_weight"] == 0.0
    for i, w in enumerate(ws):  # every worker gets a queue (~60 s of prefill), at the same instant
        _book(policy, w, f"q{i}", 300_000, i * 1_000_000)
        assert policy.stats()["busy_share"] == 0.0
    clock.now += 1.0  # a second later, all four busy: 1 - 1/e of the way there
    policy.select(text_req("later"), ws)
    share = 1.0 - math.exp(-1.0)
    assert policy.stats()["busy_share"] == pytest.approx(share)
    assert policy.stats()["work_weight"] == pytest.approx(share / (1.0 - share))  # auto: rho / (1 - rho)
    clock.now += 30.0
    policy.select(text_req("much later"), ws)
    # capped at the odds at full_weight_busy (3/4 busy: 3)
    assert policy.stats()["busy_share"] == pytest.approx(1.0) and policy.stats()["work_weight"] == 3.0


@pytest.mark.parametrize("weight_by, home_keeps", [("fleet", True), ("worker", False)])
def test_weight_by_worker_charges_work_where_it_queues(monkeypatch, weight_by, home_keeps):
    """Three of four workers busy: the fleet's weight is full (3). The warm worker's queue
    (0.5 s) is less than a miss on the idle worker charged three times over, so by the
    fleet's share the request stays; by each worker's own share the idle worker's weight
    is 0 (nobody queues there) and the warm, busy one's is 3, so it goes to the idle one."""
    policy, ws, home, prefix = _warm_home(monkeypatch, 4, 12_500, weight_by=weight_by)
    for i, w in enumerate([w for w in ws if w is not home][:2]):
        _book(policy, w, f"other{i}", 20_000, 20_000_000 + i * 100_000)
    again = policy.select(text_req("again", prefix + "question two"), ws)
    assert (again.worker.url == home.url) is home_keeps
    assert policy.stats()["busy_share"] == pytest.approx(0.75)


def test_engine_reported_load_counts_for_traffic_routed_elsewhere():
    policy = Cost(decode_cost_s=0.01)
    busy = WorkerView("http://127.0.0.1:8100", load=EngineLoad(running=50, waiting=0))
    idle = WorkerView("http://127.0.0.1:8101", load=EngineLoad(running=0, waiting=0))
    assert policy.select(text_req("x"), [busy, idle]).worker.url == idle.url


@pytest.mark.parametrize("shared_pool", [False, True])
def test_tier_credits_prefer_gpu_over_host_over_pool(shared_pool):
    index = BlockIndex(shared_pool=shared_pool)
    tokens = list(range(4096))
    hashes = page_hashes(tokens, 16)
    ws = [WorkerView(f"http://127.0.0.1:{8200 + i}", server_info={"page_size": 16}) for i in range(4)]
    for w, medium in zip(ws, ["EXTERNAL", "CPU_PINNED", "GPU"]):
        index.apply(w.url, BlockStored(hashes, None, tokens, 16, None, medium))
    policy = Cost(index=index)
    req = RequestView("t", "/generate", token_ids=tokens + [1, 2, 3])
    costs = [c[0] for c in policy.price(req, ws, index.match(req, ws))[0]]
    assert costs[2] < costs[1] < costs[0] <= costs[3]
    # the fourth worker reported nothing: with a shared pool it loads worker 0's pages too
    assert (costs[3] == costs[0]) is shared_pool
    assert policy.select(req, ws).worker.url == ws[2].url


def test_temperature_randomizes_between_near_equal_workers():
    policy = Cost(temperature=0.05, seed=7)
    ws = workers(3)
    picks = Counter(policy.select(text_req(f"r{i}", f"unrelated {i} " * 40), ws).worker.url for i in range(60))
    assert len(picks) == 3
    greedy = Cost()
    assert len({greedy.select(text_req(f"r{i}", f"unrelated {i} " * 40), ws).worker.url for i in range(20)}) == 1


def test_precise_index_with_text_fallback_is_counted():
    policy = Cost(index="precise", page_size=4)
    ws = workers(2, server_info={"kv_events": {"endpoint": "tcp://*:5557"}})  # feed never started
    for w in ws:
        policy.on_worker_added(w)
    tokens = list(range(64))
    policy.index.precise.apply(ws[1].url, BlockStored(page_hashes(tokens, 4), None, tokens, 4))
    choice = policy.select(RequestView("p", "/generate", token_ids=tokens + [7]), ws)
    assert choice.worker.url == ws[1].url and choice.predicted_cached_tokens == 64
    policy.select(text_req("q"), ws)
    assert policy.stats()["fallback_requests_total"] == 1


def test_a_withdrawn_choice_is_not_taken_for_a_hit_when_asked_again():
    """The gateway drops a choice (its claim lost to a peer's) and asks again: what ``select``
    recorded for the dropped one is gone, so the prompt is not priced as cached there."""
    policy = Cost(index=BlockIndex(default_page_size=4), hold_wait_s=0)
    ws = workers(2)
    request = RequestView("r", "/generate", token_ids=list(range(400)))
    first = policy.select(request, ws)
    assert policy.index.match(RequestView("probe", "/generate", token_ids=list(range(400))), ws).hits
    policy.on_withdrawn(request, first.worker)
    assert not policy.index.match(RequestView("probe2", "/generate", token_ids=list(range(400))), ws).hits
    assert policy.select(request, ws).predicted_cached_tokens == 0


def _book(policy: Cost, worker: WorkerView, rid: str, n_tokens: int, start: int) -> None:
    req = RequestView(rid, "/generate", token_ids=list(range(start, start + n_tokens)))
    policy.select(req, [worker])
    policy.on_routed(req, worker)


def test_the_booked_queue_drains_with_the_clock_and_first_tokens_re_time_it(monkeypatch):
    """The engine works through its queue while it waits: a worker whose queue was booked
    2 s ago reads 2 s closer (so a follow-up stays on its warm worker near the end of a long
    prefill); a first token re-times what is left from that moment, earlier or later than
    predicted; a request that ends before its first token takes its share with it."""
    clock = _SteppingClock(0.0)
    monkeypatch.setattr("policies.cost.time", clock)
    policy = Cost(attention_tokens=0, decode_cost_s=0.0, memory=False, prefill_tokens_per_s=10_000)
    w = workers(1)
    a = RequestView("a", "/generate", token_ids=list(range(30_000)))  # 3 s of prefill
    b = RequestView("b", "/generate", token_ids=list(range(100_000, 110_000)))  # 1 s
    probe = RequestView("p", "/generate", token_ids=list(range(200_000, 200_010)))  # ~1 ms of its own

    def wait() -> float:
        return policy.price(probe, w)[0][0][0] - 10 / 10_000

    for r in (a, b):
        policy.on_routed(r, w[0])
    assert wait() == pytest.approx(4.0)
    clock.now += 2.0
    assert wait() == pytest.approx(2.0)
    clock.now += 0.5  # a reaches its first token before it was due (3 s): b starts now
    policy.on_first_token(a, w[0])
    assert wait() == pytest.approx(1.0)
    clock.now += 2.0  # b is late: 1 s after its start and still no first token
    assert wait() == pytest.approx(0.0)
    c = RequestView("c", "/generate", token_ids=list(range(300_000, 320_000)))  # 2 s, after b
    policy.on_routed(c, w[0])
    assert wait() == pytest.approx(2.0)
    clock.now += 0.5
    policy.on_first_token(b, w[0])  # b started then: c's whole prefill is still ahead
    assert wait() == pytest.approx(2.0)
    policy.on_complete(c, w[0], Outcome(ok=False))  # c gave up in the queue
    assert wait() == pytest.approx(0.0) and policy.stats()["queued_prefill_tokens"] == 0


@pytest.mark.parametrize("learn", [True, False])
def test_the_prefill_speed_is_learned_from_first_tokens_that_timed_a_prefill_alone(monkeypatch, learn):
    """The configured rate is a guess: engines that prefill twice as fast teach it, from
    requests whose first token timed their own prefill (nothing queued ahead of them), and
    every wait is then priced at the measured speed. A request that queued behind another,
    or whose response was not streamed, teaches nothing."""
    clock = _SteppingClock(0.0)
    monkeypatch.setattr("policies.cost.time", clock)
    policy = Cost(attention_tokens=0, decode_cost_s=0.0, memory=False, prefill_tokens_per_s=10_000,
                  learn_prefill=learn)
    w = workers(1, server_info={"max_total_num_tokens": 1_000_000})[0]
    for i in range(41):  # 5,000 tokens: 0.5 s configured, 0.25 s measured
        req = RequestView(f"r{i}", "/generate", token_ids=list(range(i * 10_000, i * 10_000 + 5_000)),
                          max_tokens=1, stream=i > 0)
        policy.on_routed(req, w)
        clock.now += 0.25 if i else 2.0  # r0 is not streamed: its "first token" came after its decode
        policy.on_first_token(req, w)
        policy.on_complete(req, w, Outcome(ok=True, completion_tokens=1))
        clock.now += 1.0
    stats = policy.stats()
    if not learn:
        assert stats["prefill_samples"] == 0 and stats["prefill_tokens_per_s"] == 10_000
        return
    assert stats["prefill_samples"] == 40 and stats["prefill_tokens_per_s"] == pytest.approx(20_000, rel=0.05)
    queued = RequestView("q", "/generate", token_ids=list(range(900_000, 910_000)), stream=True)  # 0.5 s measured
    policy.on_routed(queued, w)
    assert policy.price(RequestView("p", "/generate", token_ids=[1] * 10), [w])[0][0][0] == pytest.approx(0.5, rel=0.06)
    clock.now += 0.5
    policy.on_first_token(queued, w)
    assert policy.stats()["prefill_samples"] == 41  # ``queued`` was alone
    again = RequestView("a", "/generate", token_ids=list(range(920_000, 930_000)), stream=True)
    behind = RequestView("b", "/generate", token_ids=list(range(950_000, 955_000)), stream=True)
    policy.on_routed(again, w)
    policy.on_routed(behind, w)  # routed before ``again``'s first token: the engine may prefill both at once
    clock.now += 3.0  # very late
    policy.on_first_token(again, w)
    policy.on_first_token(behind, w)
    assert policy.stats()["prefill_samples"] == 41  # neither times a prefill alone


def test_a_learned_speed_reprices_what_booked_queues_have_left(monkeypatch):
    """A queue booked at the configured rate is the same work at the learned one: when a
    sample moves the rate, what is left of it is rescaled at once, not at its next first
    token."""
    clock = _SteppingClock(0.0)
    monkeypatch.setattr("policies.cost.time", clock)
    policy = Cost(attention_tokens=0, decode_cost_s=0.0, memory=False, prefill_tokens_per_s=10_000)
    w1, w2 = workers(2, server_info={"max_total_num_tokens": 10_000_000})
    policy.on_routed(RequestView("long", "/generate", token_ids=list(range(1_000_000))), w2)  # 100 s
    sample = RequestView("s", "/generate", token_ids=list(range(2_000_000, 2_005_000)), stream=True)  # 0.5 s
    policy.on_routed(sample, w1)
    clock.now += 0.25  # prefilled twice as fast as configured
    policy.on_first_token(sample, w1)
    scale = math.exp(0.1 * math.log(0.5))  # one sample moves the running average a tenth of the way
    assert policy.stats()["prefill_tokens_per_s"] == pytest.approx(10_000 / scale)
    tiny = RequestView("t", "/generate", token_ids=[7] * 10)
    costs = policy.price(tiny, [w1, w2])[0]
    assert costs[1][0] - costs[0][0] == pytest.approx(99.75 * scale, rel=1e-3)


def test_long_prompts_are_priced_with_attention():
    """One 100k-token prompt takes longer to prefill than three 40k ones (attention grows with
    context): the linear model sends the next request behind the 100k prompt, the default
    model does not."""
    for attention, expect in ((0, 0), (32_768, 1)):
        policy = Cost(attention_tokens=attention)
        ws = workers(2)
        _book(policy, ws[0], "long", 100_000, 0)
        for i in range(3):
            _book(policy, ws[1], f"mid{i}", 40_000, 1_000_000 * (i + 1))
        assert policy.select(text_req("next"), ws).worker.url == ws[expect].url, attention


def test_work_weight_keeps_a_conversation_on_its_warm_worker(monkeypatch):
    monkeypatch.setattr("policies.cost.time", _SteppingClock(0.0))  # the booked queue must not drain meanwhile
    ws = workers(2)
    prompt = "turn one " * 1000  # ~2250 tokens by the text estimate
    for weight, stays in ((0.0, False), (1.0, True)):
        policy = Cost(work_weight=weight, attention_tokens=0, load_aware=False)
        first = text_req("t1", prompt)
        home = policy.select(first, ws).worker
        policy.on_routed(first, home)
        policy.on_first_token(first, home)
        # a backlog on the warm worker a little larger than what its cache saves
        _book(policy, home, "other", 2_600, 10_000_000)
        again = policy.select(text_req("t2", prompt + " turn two"), ws)
        assert (again.worker.url == home.url) is stays, weight


def _decoding(policy: Cost, worker: WorkerView, rid: str, prompt: int, max_new: int) -> RequestView:
    req = RequestView(rid, "/generate", token_ids=list(range(prompt)), max_tokens=max_new)
    policy.on_routed(req, worker)
    policy.on_first_token(req, worker)
    return req


@pytest.mark.parametrize("memory", [True, False])
def test_a_worker_whose_kv_pool_is_booked_full_makes_requests_wait(memory):
    """A full KV pool blocks admission until running requests finish (SGLang stops at the
    first waiting request that does not fit): that wait outweighs a short prefill queue."""
    policy = Cost(memory=memory, prefill_tokens_per_s=10_000, decode_cost_s=0.0, tpot_s=0.05)
    full = WorkerView("http://127.0.0.1:8100", server_info={"max_total_num_tokens": 100_000})
    queued = WorkerView("http://127.0.0.1:8101", load=EngineLoad(max_tokens=100_000))
    for i in range(4):  # ~92k tokens of KV held on `full`, each decoding 2000 more tokens (~100 s)
        _decoding(policy, full, f"d{i}", 22_000, 2000)
    backlog = RequestView("q", "/generate", token_ids=list(range(50_000, 60_000)), max_tokens=10)
    policy.on_routed(backlog, queued)  # 1 s of prefill queued on `queued`
    req = RequestView("new", "/generate", token_ids=list(range(100_000, 120_000)), max_tokens=100)
    ttft = {w.url: c[0] for w, c in zip([full, queued], policy.price(req, [full, queued])[0])}
    choice = policy.select(req, [full, queued])
    if memory:
        assert ttft[full.url] > 90.0  # until the first decodes finish
        assert choice.worker.url == queued.url
    else:
        assert ttft[full.url] < ttft[queued.url]
        assert choice.worker.url == full.url


def test_requests_sharing_a_cached_prefix_hold_its_kv_once():
    """Requests on one worker that reuse its cached system prompt hold that prompt's KV once
    (the engine locks shared pages once): each books only the KV it adds, and the engine's
    report counts the shared pages. Booking every prompt whole would see this 30k pool as
    full after four of them and make the next wait for decodes to end (tpot 1 s)."""
    policy = Cost(tpot_s=1.0, decode_cost_s=0.0, hold_wait_s=0.0)
    w = WorkerView("http://127.0.0.1:8100", server_info={"max_total_num_tokens": 30_000})
    system = "system " * 4000  # ~7000 tokens by the text estimate
    for i in range(5):
        req = text_req(f"q{i}", system + f"question {i} " * 40)
        assert policy.select(req, [w]).worker.url == w.url
        policy.on_routed(req, w)
        policy.on_first_token(req, w)
    assert policy.ledger.book[w.url].kv < 12_000  # one prompt whole, four questions
    w = w.reported(load=EngineLoad(running=5, used_tokens=10_000, max_tokens=30_000))
    ttft = policy.price(text_req("next", system + "question next " * 40), [w])[0][0][0]
    assert ttft < 1.0


def test_a_booking_after_the_engines_report_adds_to_it():
    """The engine's count of used KV is read every poll; what this gateway books after it is
    not in it yet and adds to it (traffic from elsewhere fills the first 20k here)."""
    policy = Cost(tpot_s=1.0, decode_cost_s=0.0, hold_wait_s=0.0)
    w = WorkerView("http://127.0.0.1:8100", load=EngineLoad(used_tokens=20_000, max_tokens=30_000))
    first = RequestView("first", "/generate", token_ids=list(range(8_000)), max_tokens=100)
    assert policy.select(first, [w]).worker.url == w.url  # the report is read: 20k used
    policy.on_routed(first, w)
    policy.on_first_token(first, w)
    probe = RequestView("p", "/generate", token_ids=list(range(50_000, 53_000)), max_tokens=100)
    assert policy.price(probe, [w])[0][0][0] > 50.0  # 20k + 8k booked + 3k does not fit in 30k
    w = w.reported(load=EngineLoad(running=1, used_tokens=12_000, max_tokens=30_000))  # the others ended
    assert policy.price(probe, [w])[0][0][0] < 1.0


def test_completions_free_booked_kv_and_teach_the_time_per_token():
    policy = Cost(tpot_s=1.0)
    w = WorkerView("http://127.0.0.1:8100", server_info={"max_total_num_tokens": 50_000})
    reqs = [_decoding(policy, w, f"d{i}", 20_000, 100) for i in range(2)]
    probe = RequestView("p", "/generate", token_ids=list(range(20_000)), max_tokens=100)
    assert policy.price(probe, [w])[0][0][0] > 50.0  # 2 x 20k booked + 20k does not fit in 50k
    for req in reqs:
        policy.on_complete(req, w, Outcome(ok=True, completion_tokens=100))
    assert policy.price(probe, [w])[0][0][0] < 5.0
    assert policy.ledger.tpot[w.url] < 0.1  # measured: the completions came back at once, not 1 s/token
    assert policy.select(probe, [w]).worker.url == w.url


def test_requests_that_stop_early_teach_a_shorter_kv_hold():
    """Clients ask for max_tokens=4096 and stop at EOS long before: booking and the
    expected hold follow the share of max_tokens that completions really used."""
    policy = Cost(tpot_s=0.01)
    before, history, after = (WorkerView(f"http://127.0.0.1:{8100 + i}", server_info={"max_total_num_tokens": 100_000})
                              for i in range(3))
    probe = RequestView("p", "/generate", token_ids=list(range(30_000)), max_tokens=4096)
    for i in range(3):
        _decoding(policy, before, f"a{i}", 30_000, 4096)
    naive = policy.price(probe, [before])[0][0][0]
    assert naive > 30.0  # ~4096 tokens x 10 ms before any of them frees its KV
    for i in range(100):  # elsewhere, requests that used ~10% of their max_tokens
        req = _decoding(policy, history, f"h{i}", 100, 4096)
        policy.on_complete(req, history, Outcome(ok=True, completion_tokens=410))
    assert policy.stats()["output_share"] < 0.15
    for i in range(3):  # the same bookings on a worker whose time per token is still the default
        _decoding(policy, after, f"b{i}", 30_000, 4096)
    learned = policy.price(probe, [after])[0][0][0]
    assert learned < naive / 4


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_select_takes_the_lowest_score_of_predict(data):
    """``select`` prices only the workers holding part of the prompt and takes the cheapest
    miss by ``min``; whatever the fleet (loads, booked KV, hits in every tier, a pool slower
    than recomputing, a prompt in the pool), it must land on a worker whose ``predict``
    score is the minimum."""
    import policies.cost as cost_module

    real_time, cost_module.time = cost_module.time, _SteppingClock(0.0)  # one instant: queues drain with the clock
    try:
        _select_takes_the_lowest_score_of_predict(data)
    finally:
        cost_module.time = real_time


def _select_takes_the_lowest_score_of_predict(data) -> None:
    ps, n = 4, data.draw(st.integers(1, 8), label="workers")
    pool_tps = data.draw(st.sampled_from([2_000.0, 40_000.0]), label="pool speed")
    index = BlockIndex(default_page_size=ps)
    weight_by = data.draw(st.sampled_from(["fleet", "worker"]), label="weight_by")
    policy = Cost(index=index, prefill_tokens_per_s=25_000, pool_load_tokens_per_s=pool_tps, engine_load="max",
                  weight_by=weight_by)
    prompt = list(range(1, 1 + ps * 40))
    # Every worker known to the index (as once it has published or been routed to): a prompt
    # in the shared pool is then one ``everyone`` entry, and select prices only the workers
    # holding more, the least backlog and those short of KV room.
    known = data.draw(st.booleans(), label="every worker known to the index")
    ws = []
    for i in range(n):
        load = data.draw(st.none() | st.builds(
            EngineLoad, running=st.integers(0, 40), waiting=st.integers(0, 8),
            used_tokens=st.integers(0, 900), max_tokens=st.sampled_from([0, 400, 1000])), label=f"load {i}")
        w = WorkerView(f"http://127.0.0.1:{8300 + i}", load=load, server_info={"max_total_num_tokens": 1000})
        ws.append(w)
        if known:
            index.slot(w.url)
        pages = data.draw(st.just(0) | st.integers(0, 40), label=f"pages held by {i}")  # often none: priced as misses
        if pages:
            tokens = prompt[: pages * ps]
            index.store(w.url, page_hashes(tokens, ps), None, data.draw(st.integers(0, 2)), ps, tokens)
        for r in range(data.draw(st.integers(0, 3), label=f"booked on {i}")):
            booked = RequestView(f"b{i}-{r}", "/generate", token_ids=list(range(5000, 5000 + 300)), max_tokens=200)
            policy.on_routed(booked, w)
            if data.draw(st.booleans()):
                policy.on_first_token(booked, w)
    probe = RequestView("probe", "/generate", token_ids=prompt, max_tokens=100)
    costs, scores = policy.price(probe, ws, index.match(probe, ws))
    chosen = policy.select(probe, ws)
    assert scores[ws.index(chosen.worker)] <= min(scores) + 1e-9
    # ``diverted`` counts the hit given up: the most any worker would reuse, less the chosen's
    cached, most = costs[ws.index(chosen.worker)][2], max(c[2] for c in costs)
    assert (policy.diverted, policy.diverted_tokens) == ((1, most - cached) if most > cached else (0, 0.0))
    # Each worker its own work weight (weight_by=worker): the shortcut's choice is still a minimum.
    weights = [data.draw(st.floats(0.0, 5.0), label=f"weight {i}") for i in range(n)]
    b = replace(policy.backlogs(probe, ws), weights=weights)
    found = policy.pricer.cheapest(b)
    if found is not None:
        _, scores = policy.pricer.price(b)
        assert scores[found[0]] <= min(scores) + 1e-9


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_select_on_a_saturated_fleet_takes_the_lowest_score_of_predict(data):
    """Every worker's KV pool full, so the request waits for KV everywhere; ``select``
    prices those waits cheapest queue first and rules workers out by when their first
    booked request ends, and must still land on ``predict``'s minimum: bookings started
    at different times, some still queued, each worker with its own time per token."""
    import policies.cost as cost_module

    clock = _SteppingClock(0.0)
    real_time, cost_module.time = cost_module.time, clock
    try:
        policy = Cost(index="approx", prefill_tokens_per_s=data.draw(st.sampled_from([2_000.0, 25_000.0])),
                      tpot_s=data.draw(st.sampled_from([0.001, 0.03])), hold_wait_s=0.0)
        n = data.draw(st.integers(2, 8), label="workers")
        ws = [WorkerView(f"http://127.0.0.1:{8500 + i}", load=EngineLoad(used_tokens=10_000, max_tokens=10_000))
              for i in range(n)]
        for i, w in enumerate(ws):
            for r in range(data.draw(st.integers(1, 5), label=f"booked on {i}")):
                clock.now += data.draw(st.floats(0, 2) | st.just(0.0), label="time passes")
                booked = RequestView(f"b{i}-{r}", "/generate",
                                     token_ids=[1] * data.draw(st.integers(100, 3000), label="prompt"),
                                     max_tokens=data.draw(st.integers(10, 500), label="max_tokens"))
                policy.on_routed(booked, w)
                state = data.draw(st.sampled_from(["queued", "started", "started", "done"]), label="state")
                if state != "queued":
                    policy.on_first_token(booked, w)
                if state == "done":  # teaches this worker its time per token
                    clock.now += data.draw(st.floats(0, 5), label="decoding")
                    policy.on_complete(booked, w, Outcome(ok=True, completion_tokens=data.draw(st.integers(2, 500))))
        clock.now += data.draw(st.floats(0, 3), label="time passes")
        probe = RequestView("probe", "/generate", token_ids=[2] * data.draw(st.integers(1, 4000) | st.just(50), label="probe"),
                            max_tokens=data.draw(st.integers(1, 500), label="probe max_tokens"))
        _, scores = policy.price(probe, ws, IndexMatch())
        chosen = policy.select(probe, ws)
        assert scores[ws.index(chosen.worker)] <= min(scores) + 1e-9
    finally:
        cost_module.time = real_time


def _hold_setup(**kw) -> tuple[Cost, list[WorkerView], list[RequestView]]:
    """Two workers, each with ~2 s of prefill queued (50k tokens at 25k tokens/s)."""
    policy = Cost(attention_tokens=0, decode_cost_s=0.0, hold_wait_s=0.5, **kw)
    ws = workers(2)
    booked = []
    for i, w in enumerate(ws):
        req = RequestView(f"busy{i}", "/generate", token_ids=list(range(i * 100_000, i * 100_000 + 50_000)))
        policy.on_routed(req, w)
        booked.append(req)
    return policy, ws, booked


def test_hold_when_every_worker_would_keep_the_request_waiting():
    """Late binding: with every worker's queue longer than ``hold_wait_s`` the request is
    held (nothing booked for it), and it is routed once a queue drains."""
    policy, ws, booked = _hold_setup()
    req = RequestView("r", "/generate", text=PROMPT, may_hold=True)
    held = policy.select(req, ws)
    assert isinstance(held, Hold) and 0.05 <= held.retry_s <= 1.0 and "wait" in held.reason
    stats = policy.stats()
    assert stats["holds"] == 1 and stats["queued_prefill_tokens"] == 100_000  # nothing booked for `r`
    assert not policy.ledger.picked and policy.index.match(req, ws).hits == {}  # no speculative index entry
    # The gateway may not hold it (a retry, or past max_hold_secs): the policy must choose.
    assert policy.select(RequestView("r2", "/generate", text=PROMPT), ws).worker in ws
    # Worker 1's prefill reaches its first token: its queue is free, so the held request goes there.
    policy.on_first_token(booked[1], ws[1])
    choice = policy.select(req, ws)
    assert not isinstance(choice, Hold) and choice.worker.url == ws[1].url


def test_a_held_request_stops_chasing_once_it_has_waited_as_long_as_it_would_wait():
    """A request held as long as its predicted wait is committed to the best worker, so a
    long prompt is not overtaken forever by short ones that fit sooner."""
    for patience, held_s, holds in ((1.0, 1.0, True), (1.0, 2.5, False), (2.0, 2.5, True), (0.0, 0.0, False)):
        policy, ws, _ = _hold_setup(hold_patience=patience)
        req = RequestView("r", "/generate", text=PROMPT, may_hold=True, held_s=held_s)
        assert isinstance(policy.select(req, ws), Hold) is holds, (patience, held_s)


def test_no_hold_when_off_or_below_the_threshold():
    policy, ws, _ = _hold_setup()
    policy.hold_wait_s = 0.0
    assert not isinstance(policy.select(RequestView("a", "/generate", text=PROMPT, may_hold=True), ws), Hold)
    policy, ws, _ = _hold_setup()
    policy.hold_wait_s = 3.0  # the 2 s queues are short enough
    assert not isinstance(policy.select(RequestView("b", "/generate", text=PROMPT, may_hold=True), ws), Hold)


def test_no_hold_while_some_worker_could_start_the_request_at_once():
    """The worker holding the prompt's prefix has a queue, so it keeps the request waiting,
    but a third worker is idle: holding would leave a burst on that prefix waiting for its
    one warm worker, one first token at a time, so the request is committed."""
    policy, ws, _ = _hold_setup(load_aware=False, work_weight=12.0)
    idle = WorkerView("http://127.0.0.1:8199")
    prompt = "context " * 4000  # ~8000 tokens: a miss is 0.32 s, x 13 with the weight
    warm = RequestView("warm", "/generate", text=prompt)
    policy.select(warm, [ws[0]])
    policy.on_routed(warm, ws[0])
    policy.on_first_token(warm, ws[0])
    again = RequestView("again", "/generate", text=prompt + "more", may_hold=True)
    assert isinstance(policy.select(again, ws), Hold)  # both workers queue ~2 s: held
    choice = policy.select(again, [*ws, idle])
    assert not isinstance(choice, Hold)
    assert choice.worker.url == ws[0].url  # the prefix is worth its queue at the full weight


def _walk(lives, over: float, now: float, queue_wait: float, tpot: float) -> float:
    """The KV wait by its definition: sort every booked request by expected end, walk until
    ``over`` tokens are freed (all of them: the last end)."""
    if not lives:
        return 0.0
    ends = sorted(((live.first_token_at if live.first_token_at is not None else now + queue_wait)
                   + live.output * tpot, live.footprint) for live in lives)
    freed, end = 0.0, now
    for end, footprint in ends:
        freed += footprint
        if freed >= over:
            break
    return max(end - now, 0.0)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_kv_release_schedule_answers_as_the_full_sort_does(data):
    """``KvReleases`` keeps its sort across questions and bisects; whatever the bookings,
    first tokens, completions and time per token in between, each answer is the walk's
    (and ``first``, the bound ``select`` prunes with, is the walk's first end)."""
    from policies.cost_ledger import Live as _Live
    from policies.kv_release import KvReleases

    releases, now, n = KvReleases(), 100.0, 0
    small = st.floats(0, 50, allow_nan=False)
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(st.sampled_from(["add", "add", "add", "start", "end", "ask", "ask"]), label="op")
        if op == "add":
            output = data.draw(st.sampled_from([0.0, 10.0, 100.0, 1000.0]) | st.floats(0, 1000), label="output")
            live = _Live("w", 0.0, data.draw(st.integers(1, 500), label="kv"), output, output)
            if data.draw(st.booleans(), label="running"):
                live.first_token_at = now - data.draw(small, label="started ago")
            releases.add(f"r{n}", live)
            n += 1
        elif op in ("start", "end") and releases.lives:
            rid = data.draw(st.sampled_from(sorted(releases.lives)), label=op)
            if op == "end":
                releases.pop(rid)
            elif releases.lives[rid].first_token_at is None:
                releases.lives[rid].first_token_at = now - data.draw(small, label="started ago")
                releases.started(releases.lives[rid])
        else:
            over = data.draw(st.floats(0.5, 3000, allow_nan=False), label="over")
            wait = data.draw(st.sampled_from([0.0, 0.5, 2.0]) | small, label="queue wait")
            tpot = data.draw(st.sampled_from([0.01, 0.03]), label="tpot")
            now += data.draw(st.floats(0, 2, allow_nan=False), label="time passes")
            assert releases.wait(over, now, wait, tpot) == _walk(releases.lives.values(), over, now, wait, tpot)
            # the bound select prunes with: the first end, what any shortfall waits at least
            assert releases.first(now, wait, tpot) == _walk(releases.lives.values(), 1e-9, now, wait, tpot)


def _backlogs_by_definition(policy, request, workers, match, now, avg_at):
    """Every worker's backlog recomputed from the bookings and reports, as ``cost`` did on
    every decision before ``FleetBacklog`` kept rows (a reported queue's drain written as
    the time it ends, and its waiting requests priced at the average prefill when that
    report was first seen: ``avg_at``, which keeps the booked KV then too). Returns the
    bases, the hit states and the busy count."""
    from policies.fleet_backlog import IDLE

    prompt = float(request.prompt_tokens_estimate)
    inv_prefill = 1.0 / policy.prefill_tps
    need = prompt + 0.5 * policy.ledger.out_ratio * float(request.max_tokens)
    scale = prompt / match.query_len if match.unit != "tokens" else 1.0
    hits, bases, busy = {}, [], 0
    for w in workers:
        url, load = w.url, w.load
        book = policy.ledger.book.get(url, IDLE)
        running, kv, capacity, static = book.decoding, book.kv, 0, 0.0
        drained_at = book.done if book.queued > 0 else -math.inf  # the booked queue drains from its last change
        if load is not None:
            if policy.pricer.rows.pricing.engine_load != "off":
                backlog = load.waiting * avg_at.setdefault((url, repr(load)), policy.ledger.avg_uncached)
                if policy.pricer.rows.pricing.engine_load == "max":  # the reported queue as it is
                    static = backlog * inv_prefill
                elif backlog > 0:  # the reported queue drains at the prefill rate from its report
                    drained_at = max(drained_at, load.timestamp + backlog * inv_prefill)
                running = max(running, load.running)
            # the engine's count plus what was booked or released since that report was first seen
            kv_then = avg_at.setdefault(("kv", url, repr(load)), kv)
            capacity, kv = load.max_tokens, max(kv, load.used_tokens + kv - kv_then)
        wait, decode = max(static, drained_at - now, 0.0), running * policy.pricer.decode_cost_s
        if kv and policy.pricer.rows.pricing.memory:
            capacity = capacity or w.server_info.get("max_total_num_tokens") or 0
        else:
            capacity = 0
        if url in match.hits and url not in hits:
            t = match.hits[url]
            hits[url] = (len(bases), t if scale == 1.0 else Tiers(*(x * scale for x in t)), (wait, decode, kv, capacity))
        releases = policy.ledger.kv.get(url)
        if capacity and kv + need > capacity and releases is not None and releases.lives:
            wait = max(wait, releases.wait(kv + need - capacity, now, wait, policy.ledger.tpot.get(url, policy.ledger.default_tpot_s)))
        busy += wait > 0.0
        bases.append(wait + decode)
    return bases, hits, busy


@dataclass(slots=True)
class _PlainView:
    """A worker view a plugin's caller built itself: replacing its report bumps no
    ``WorkerView.reports``, so ``FleetBacklog`` must read every report on every decision."""

    url: str
    role: str = "unified"
    load: EngineLoad | None = None
    server_info: dict = field(default_factory=dict)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_backlog_rows_kept_across_decisions_price_as_recomputing_them(data):
    """``FleetBacklog`` recomputes a worker's row only when its bookings or report change and
    re-prices draining engine queues and KV waits per decision; whatever happens in between
    (routings, first tokens, completions, polls, new server_info, time passing, another list
    of workers), every decision must see what recomputing everything gives."""
    clock = _SteppingClock(0.0)
    policy = Cost(index="approx", prefill_tokens_per_s=5_000,
                        engine_load=data.draw(st.sampled_from(["drain", "max", "off"]), label="engine_load"),
                        memory=data.draw(st.booleans(), label="memory"))
    n = data.draw(st.integers(1, 4), label="workers")
    view = data.draw(st.sampled_from([WorkerView, _PlainView]), label="view type")
    fleet = [view(f"http://127.0.0.1:{8400 + i}", server_info={"max_total_num_tokens": 3000}) for i in range(n)]
    avg_at: dict = {}
    live: list[tuple[RequestView, WorkerView]] = []
    standing = list(fleet)
    current = {v.url: v for v in fleet}
    tokens: dict[tuple[str, ...], int] = {}  # a token per url order, as the registry's

    def replaced(old, **report) -> None:
        """A new report, as the gateway's registry gives one: the view replaced (and counted
        in ``WorkerView.reports`` where it is one)."""
        new = old.reported(**report) if isinstance(old, WorkerView) else replace(old, **report)
        fleet[fleet.index(old)] = current[old.url] = new
    size = st.integers(1, 2000)
    import policies.cost as cost_module

    real_time, cost_module.time = cost_module.time, clock
    try:
        for step in range(data.draw(st.integers(1, 30), label="steps")):
            op = data.draw(st.sampled_from(["route", "route", "first", "end", "poll", "poll", "info", "remove",
                                            "decide", "decide", "decide", "decide"]), label="op")
            w = fleet[data.draw(st.integers(0, n - 1), label="worker")]
            if op == "route":
                r = RequestView(f"r{step}", "/generate", token_ids=[1] * data.draw(size, label="prompt"),
                                max_tokens=data.draw(st.integers(1, 500), label="max_tokens"))
                policy.on_routed(r, w)
                if data.draw(st.booleans(), label="started at once"):
                    policy.on_first_token(r, w)
                live.append((r, w))
            elif op in ("first", "end") and live:
                r, at = live[data.draw(st.integers(0, len(live) - 1), label="which")]
                if op == "first":
                    policy.on_first_token(r, at)
                else:
                    live.remove((r, at))
                    policy.on_complete(r, at, Outcome(ok=True, completion_tokens=data.draw(st.integers(0, 500))))
            elif op == "poll":
                age = data.draw(st.sampled_from([0.0, 0.01]) | st.floats(0, 0.5), label="poll age")
                replaced(w, load=None if data.draw(st.integers(0, 5)) == 0 else EngineLoad(
                    running=data.draw(st.integers(0, 9)), waiting=data.draw(st.integers(0, 6)),
                    used_tokens=data.draw(st.integers(0, 3000)), max_tokens=data.draw(st.sampled_from([0, 2500, 3000])),
                    timestamp=clock.now - age - step * 1e-6))
            elif op == "info":
                replaced(w, server_info={"max_total_num_tokens": data.draw(st.sampled_from([0, 1500, 3000]))})
            elif op == "remove":  # the worker leaves (its bookings are forgotten) and comes back
                policy.on_worker_removed(w)
                live = [(r, at) for r, at in live if at.url != w.url]
            else:
                dt = data.draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, -0.2]) | st.floats(0, 1), label="time passes")
                # Back, too (a clock the test steps), but never before a report was taken.
                clock.now = max([clock.now + dt] + [v.load.timestamp for v in fleet if v.load is not None])
                chosen = data.draw(st.permutations(fleet), label="order")[:data.draw(st.integers(1, n))]
                if data.draw(st.booleans(), label="the last list, reordered in place"):
                    chosen = standing
                    chosen[:] = [current[v.url] for v in chosen]  # a caller passes the current views
                    chosen.reverse()
                standing = chosen
                if data.draw(st.integers(0, 9), label="a worker listed twice") == 0:
                    chosen.append(chosen[0])
                offered = chosen
                if data.draw(st.booleans(), label="as the gateway's registry hands them (a membership token)"):
                    offered = Workers(chosen, tokens.setdefault(tuple(v.url for v in chosen), new_membership()))
                probe = RequestView(f"p{step}", "/generate", text="x" * data.draw(size, label="probe"),
                                    max_tokens=data.draw(st.integers(1, 500)))
                held = {v.url: Tiers(*data.draw(st.tuples(size, size, size))) for v in chosen
                        if data.draw(st.integers(0, 3)) > 0}
                if data.draw(st.booleans(), label="a hit on a worker not offered"):
                    held["http://127.0.0.1:9"] = Tiers(5)
                match = IndexMatch(data.draw(st.integers(1, 4000)), "chars", held)
                want = _backlogs_by_definition(policy, probe, chosen, match, clock.now, avg_at)
                b = policy.backlogs(probe, offered, match)
                assert (b.bases, b.hits, b.busy) == want
                for kept in policy.pricer.rows._fleets:  # what ``Fleet.tight`` bisects stays sorted and in step
                    assert kept.headroom == sorted(kept.headroom) and kept.room == [r for r, _ in kept.headroom]
    finally:
        cost_module.time = real_time


def test_backlog_rows_follow_a_new_server_info_and_a_clock_set_back(monkeypatch):
    """The two changes a decision notices without being told: a worker with no load report
    takes its KV capacity from ``server_info`` (replaced when the gateway refreshes it), and
    an engine queue that had drained drains again if the clock is set back (tests do)."""
    clock = _SteppingClock(0.0)
    monkeypatch.setattr("policies.cost.time", clock)
    policy = Cost(index="approx", prefill_tokens_per_s=5_000)
    w = WorkerView("http://127.0.0.1:8500", server_info={"max_total_num_tokens": 3000})
    booked = RequestView("b", "/generate", token_ids=[1] * 1000, max_tokens=400)
    policy.on_routed(booked, w)
    policy.on_first_token(booked, w)
    avg_at: dict = {}

    def decide() -> list[float]:
        probe = RequestView(f"p{clock.now}", "/generate", text="x" * 800, max_tokens=100)
        b = policy.backlogs(probe, [w], IndexMatch(800, "chars"))
        assert (b.bases, b.hits, b.busy) == _backlogs_by_definition(
            policy, probe, [w], IndexMatch(800, "chars"), clock.now, avg_at)
        return b.bases

    fits = decide()
    w = w.reported(server_info={"max_total_num_tokens": 1000})  # the worker came back with a smaller pool
    assert decide()[0] > fits[0] + 1.0  # it now waits for the booked request's KV
    w = w.reported(server_info={"max_total_num_tokens": 1400})  # 1200 booked + 250 for the probe: 50 short
    assert decide()[0] > fits[0] + 1.0
    w = w.reported(server_info={"max_total_num_tokens": 3000}, load=EngineLoad(waiting=4, timestamp=clock.now))
    policy.ledger.avg_uncached = 2_500.0  # 10k tokens reported queued: 2 s at 5k tokens/s
    draining = decide()[0]
    clock.now += 10.0
    settled = decide()[0]
    clock.now -= 9.5
    assert settled < decide()[0] < draining


@pytest.mark.parametrize("peer_routes_there", [False, True])
def test_a_peers_request_on_the_same_worker_spoils_the_prefill_sample(peer_routes_there):
    """A streamed request alone on its worker times its prefill at its first token, unless a
    peer's request reached that worker meanwhile: it may have been sent before ours reached
    the engine, so the first token may time its prefill too. A peer's own request, booked
    from a record that came late over the bus, times nothing here. (One of ours routed there
    meanwhile spoils it as well: the prefill test above.)"""
    policy = Cost()
    worker = workers(1)[0]
    mine = RequestView("mine", "/generate", token_ids=list(range(4000)), stream=True)
    policy.select(mine, [worker])
    policy.on_routed(mine, worker)
    if peer_routes_there:
        theirs = RequestView("theirs", "/generate", token_ids=list(range(10_000, 14_000)), stream=True)
        policy.on_peer_routed(theirs, worker, 0)
        policy.on_first_token(theirs, worker)
    policy.on_first_token(mine, worker)
    assert policy.stats()["prefill_samples"] == (0 if peer_routes_there else 1)


@pytest.mark.parametrize("window_s, home_keeps", [(0.0, 6), (1.0, 1)])
def test_a_copy_of_a_prefix_many_requests_want_shares_its_charge_with_them(monkeypatch, window_s, home_keeps):
    """Three of four workers busy: the fleet's weight is full (3) and the warm worker's queue
    (0.5 s) is less than a miss charged three times over, so requests for its prefix stay
    there. Counting the requests for that prefix within the window, the second that asks
    shares a copy's charge with the first (1.5), which is less than the queue, and goes to
    the idle worker; from then on both hold it. (Decided, not booked: the queues stay.)"""
    policy, ws, home, prefix = _warm_home(monkeypatch, 4, 12_500, demand_window_s=window_s)
    for i, w in enumerate([w for w in ws if w is not home][:2]):
        _book(policy, w, f"other{i}", 20_000, 20_000_000 + i * 100_000)
    landed = [policy.select(text_req(f"asked{i}", prefix + f"question {i}"), ws).worker.url for i in range(6)]
    assert landed.count(home.url) == home_keeps
    assert policy.stats()["busy_share"] == pytest.approx(0.75)
    assert policy.stats()["shared_charges"] == (5 if window_s else 0)  # every ask after the first
