"""``cost``'s ledger and pricer in isolation: pure inputs, exact outputs."""

from __future__ import annotations

import math

import pytest

from index.prefix import Tiers
from policies.base import EngineLoad, Outcome, RequestView, WorkerView
from policies.cost_ledger import Ledger
from policies.cost_pricer import Backlogs, Pricer, prefill_tokens
from policies.work_weight import WorkWeight


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def req(rid: str, prompt: int, max_tokens: int | None = 100, stream: bool = False) -> RequestView:
    return RequestView(rid, "/generate", token_ids=[1] * prompt, max_tokens=max_tokens, stream=stream)


W = WorkerView("http://w:1")
W2 = WorkerView("http://w:2")


def ledger(clock: Clock, tps: float = 10_000.0, tpot: float = 0.03) -> tuple[Ledger, list]:
    calls: list = []
    return Ledger(tps, tpot, clock, touched=calls.append, repriced=lambda: calls.append("repriced")), calls


# -- the ledger -----------------------------------------------------------------------------
def test_routed_first_token_and_completed_keep_the_books():
    clock = Clock(100.0)
    book, touched = ledger(clock)
    book.routed(req("a", 1000), W, full=1000.0)
    b = book.book[W.url]
    assert (b.queued, b.done, b.decoding, b.kv) == (1000.0, 100.0 + 1000.0 * 1e-4, 0, 1050.0)  # prompt + half of 100
    live = book.live["a"]
    assert (live.tokens, live.footprint, live.output, live.max_tokens, live.routed_at) == (1000.0, 1050.0, 100.0,
                                                                                          100.0, 100.0)
    assert book.avg_max_new == 256.0 + 0.05 * (100.0 - 256.0) and book.avg_uncached == 50.0
    assert touched == [W.url]
    clock.now = 100.05
    book.first_token("a")
    assert (b.queued, b.done, b.decoding, b.kv) == (0.0, 100.05, 1, 1050.0)
    assert live.first_token_at == 100.05 and live.tokens == 0.0
    clock.now = 101.05
    book.completed("a", Outcome(ok=True, completion_tokens=51))
    assert (b.queued, b.decoding, b.kv) == (0.0, 0, 0.0)
    assert book.out_ratio == 1.0 + 0.05 * (0.51 - 1.0)
    assert book.tpot[W.url] == pytest.approx(1.0 / 50)  # the first sample stands
    assert not book.live and not book.kv[W.url].lives


def test_the_work_chosen_is_booked_where_it_was_chosen_and_full_elsewhere():
    book, _ = ledger(Clock())
    book.chose("a", W.url, 400.0)  # a hit: 400 of its 1000 tokens left to prefill
    book.routed(req("a", 1000), W, full=1000.0)
    book.chose("b", W.url, 400.0)
    book.routed(req("b", 1000), W2, full=1000.0)  # the gateway retried it elsewhere
    assert book.book[W.url].queued == 400.0 and book.book[W2.url].queued == 1000.0 and not book.picked


def test_a_request_that_ends_before_its_first_token_takes_its_work_back():
    clock = Clock(100.0)
    book, _ = ledger(clock)
    book.routed(req("a", 2000), W, full=2000.0)
    book.routed(req("b", 1000), W, full=1000.0)
    book.completed("a", Outcome(ok=False, status=500))
    b = book.book[W.url]
    assert b.queued == 1000.0 and b.done == pytest.approx(100.1) and b.kv == 1050.0


def test_a_prefill_worker_books_no_output_and_frees_its_kv_at_the_first_token():
    book, _ = ledger(Clock())
    book.routed(req("a", 1000), W, full=1000.0, keeps_output=False)
    assert book.book[W.url].kv == 1000.0
    book.first_token("a", releases_kv=True)
    assert book.book[W.url].kv == 0.0 and book.book[W.url].decoding == 1


def test_a_prefill_timed_alone_rescales_the_speed_and_what_booked_queues_have_left():
    clock = Clock(100.0)
    book, calls = ledger(clock)
    book.routed(req("a", 2500, stream=True), W, full=2500.0)  # nothing else there: 0.25 s, timed alone
    assert book.live["a"].alone == 0.25
    book.routed(req("b", 20_000), W2, full=20_000.0)  # 2 s queued on the other worker
    clock.now = 101.0  # 4x the predicted 0.25 s
    book.first_token("a")
    scale = 0.1 * math.log(4.0)
    inv = 1e-4 * math.exp(scale)
    assert book.prefill_samples == 1 and book.log_scale == scale
    assert book.inv_prefill == inv and book.prefill_tps == 1.0 / inv and calls[-1] == "repriced"
    assert book.book[W2.url].done == 101.0 + (102.0 - 101.0) * (inv / 1e-4)  # the second left, at the new speed
    book.routed(req("c", 2500, stream=True), W, full=2500.0)  # alone again: a sample
    assert book.live["c"].alone > 0.0
    book.routed(req("d", 2500, stream=True), W, full=2500.0)  # behind c: times no prefill alone, and the
    assert book.live["d"].alone == 0.0 and book.live["c"].alone == 0.0  # engine may prefill c and d in one step
    clock.now = 102.0
    book.first_token("c")
    assert book.prefill_samples == 1


def test_no_speed_sample_from_a_queued_engine_or_a_pool_it_does_not_fit():
    book, _ = ledger(Clock())
    busy = WorkerView("http://w:3", load=EngineLoad(waiting=1))
    full = WorkerView("http://w:4", server_info={"max_total_num_tokens": 2000})
    book.routed(req("a", 2500, stream=True), busy, full=2500.0)
    book.routed(req("b", 2500, stream=True), full, full=2500.0)
    book.routed(req("c", 2500, stream=True), W, full=2500.0, times_prefill=False)
    assert [book.live[r].alone for r in "abc"] == [0.0, 0.0, 0.0]


def test_a_removed_worker_is_forgotten():
    book, touched = ledger(Clock())
    book.routed(req("a", 100), W, full=100.0)
    book.worker_removed(W.url)
    assert W.url not in book.book and W.url not in book.kv and touched[-1] == W.url


# -- the pricer -----------------------------------------------------------------------------
def pricer(book: Ledger, **kw) -> Pricer:
    args = dict(host_tps=5_000.0, pool_tps=2_500.0, decode_cost_s=0.01, attention_tokens=0.0, work_weight=12.0,
                load_aware=True, load_window_s=0.0, full_weight_busy=0.75, engine_load="drain", memory=True)
    args.update(kw)
    return Pricer(book, **args)


def test_the_prefill_formula():
    assert prefill_tokens(1000.0, 500.0, 1 / 1000) == 2000.0  # 1000 x (1 + (500 + 500) / 1000)
    assert prefill_tokens(1000.0, 0.0, 0.0) == 1000.0
    assert prefill_tokens(1000.0, 500.0, 1 / 1000, 0.5) == 1000.0  # scaled before the rest
    assert prefill_tokens(3.0, 1.0, 0.1, 0.7) == 0.7 * 3.0 * (1.0 + (1.0 + 3.0 / 2.0) * 0.1)


def weight_of(w: WorkWeight, busy: int, workers: int, now: float) -> float:
    return w.decide(busy, [f"w{i}" for i in range(workers)], [0.0] * workers, [0.0] * workers, now)[0]


@pytest.mark.parametrize("busy, workers, weight", [
    (0, 4, 0.0), (1, 4, 12.0 * (1 / 3) / 3), (2, 4, 12.0 * 1.0 / 3), (3, 4, 12.0), (4, 4, 12.0), (0, 0, 12.0)])
def test_the_weight_follows_rho_over_one_less_rho(busy, workers, weight):
    assert weight_of(WorkWeight(12.0, True, 0.0, 0.75), busy, workers, 1.0) == pytest.approx(weight)  # no window
    assert weight_of(WorkWeight(12.0, False, 0.0, 0.75), busy, workers, 1.0) == 12.0
    assert weight_of(WorkWeight("auto", True, 0.0, 0.75), busy, workers, 1.0) == pytest.approx(weight / 4)


def test_the_busy_share_is_averaged_over_the_window():
    w = WorkWeight(12.0, True, 1.0, 0.75)
    weight_of(w, 4, 4, 10.0)  # the first decision takes the share as it finds it
    assert w.busy_share == 1.0
    weight_of(w, 0, 4, 11.0)
    assert w.busy_share == pytest.approx(math.exp(-1.0))


def test_each_workers_weight_follows_its_own_busy_share():
    """With ``per_worker``: a worker with a queue (its base above its decode cost) has been
    busy all along, one without never: the full weight and none; the fleet's is half-way."""
    w = WorkWeight("auto", True, 1.0, 0.75, per_worker=True)
    fleet, each = w.decide(1, ["a", "b"], [0.5, 0.01], [0.01, 0.01], 10.0)
    assert each == [3.0, 0.0] and fleet == pytest.approx(1.0)  # a share of 1/2: odds 1
    assert w.decide(1, ["a", "b"], [0.01, 0.5], [0.01, 0.01], 11.0)[1] == pytest.approx(
        [w.of(math.exp(-1.0)), w.of(1.0 - math.exp(-1.0))])


def test_a_hit_priced_with_a_kv_wait_and_tier_loads():
    clock = Clock(100.0)
    book, _ = ledger(clock)
    book.routed(req("a", 1000), W, full=1000.0)  # footprint 1050, 100 output tokens
    book.first_token("a")  # its KV back at 100 + 100 x 0.03 = 103
    p = pricer(book)
    held = Tiers(gpu=1000, host=500, pool=500)
    b = Backlogs(prompt=3000.0, full=0.3, output=50.0, now=101.0, bases=[0.01], weight=2.0,
                 hits={W.url: (0, held, (0.0, 0.01, 1050.0, 2000.0))}, most=2000.0)
    score, cost = p.hit(W.url, held, b, 0.0, 0.01, 1050.0, 2000.0)
    own = 1000.0 / 10_000.0  # the uncached tokens (attention ignored)
    ttft = 2.0 + 0.01 + own + 500 / 5_000.0 + 500 / 2_500.0  # waits 2 s for 100 tokens of KV
    assert cost == (pytest.approx(ttft), 1000.0, 2000.0)
    assert score == pytest.approx(ttft + 2.0 * own)
    assert p.delay(b, W.url, cost) == pytest.approx(2.01)  # not spent on its own prefill or loads
    roomy = p.hit(W.url, Tiers(gpu=1000, host=500, pool=500), b, 0.0, 0.01, 1050.0, 10_000.0)[1]
    assert roomy[0] == pytest.approx(ttft - 2.0)


def test_price_and_the_fast_path_agree():
    book, _ = ledger(Clock())
    p = pricer(book)
    hits = {W2.url: (1, Tiers(gpu=900), (0.5, 0.0, 0.0, 0.0))}
    b = Backlogs(prompt=1000.0, full=0.1, output=0.0, now=0.0, bases=[0.2, 0.5, 0.3], weight=3.0, hits=hits,
                 most=900.0)
    costs, scores = p.price(b)
    assert costs[0] == (0.2 + 0.1, 1000.0, 0.0) and scores[0] == (0.2 + 0.1) + 3.0 / 10_000 * 1000.0 * 1.0
    assert p.cheapest(b) == (scores.index(min(scores)), costs[scores.index(min(scores))])
