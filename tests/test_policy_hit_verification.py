"""Hit verification: drift over a window, hysteresis, and the cost policy's degrade path."""

from __future__ import annotations

from policies.base import Outcome, RequestView, WorkerView
from policies.cost import Cost
from policies.hit_verification import HitVerifier


def test_drift_is_the_share_of_predicted_hits_that_did_not_happen():
    v = HitVerifier(window=4, min_samples=2, degrade_above=0.5, recover_below=0.2)
    v.observe(100, 100)
    v.observe(100, 40)  # 60 of 200 predicted tokens missing
    assert abs(v.drift - 0.3) < 1e-9 and not v.degraded
    v.observe(100, 0)
    v.observe(100, 0)  # 260 of 400 missing
    assert v.degraded and v.degradations == 1
    v.observe(100, 100)  # window slides: 200 of 400 missing, still above recover_below
    assert v.degraded
    v.observe(100, 150)  # under-prediction is not drift
    v.observe(100, 100)
    v.observe(100, 100)
    assert not v.degraded and v.drift == 0.0
    assert v.predicted_total == 800 and v.actual_total == 590


def test_hits_the_index_never_predicted_are_reported_once_per_episode(caplog):
    """A tokenizer or chat template that is not the engine's: the engines reuse prefixes
    the precise index never matched. Nothing to degrade (no load was concentrated), but
    the share is a stat and a warning, re-armed once it falls."""
    v = HitVerifier(window=8, min_samples=4)
    with caplog.at_level("WARNING", logger="kvgate.policies.hit_verification"):
        for _ in range(3):
            v.observe(0, 100)
        assert not caplog.records  # too few samples yet
        v.observe(50, 100)
        assert v.unpredicted == 350 / 400 and not v.degraded
        for _ in range(4):
            v.observe(0, 100)
        assert len(caplog.records) == 1 and "tokenizer or chat template" in caplog.text
        for _ in range(8):
            v.observe(100, 100)
        assert v.unpredicted == 0.0 and v.stats()["hit_unpredicted_ratio"] == 0.0
        for _ in range(8):
            v.observe(0, 100)
        assert len(caplog.records) == 2


def test_prediction_scales_with_the_engines_prompt_tokens_and_skips_unreported():
    v = HitVerifier(min_samples=1)
    v.expect("a", 0.5, 10)
    v.complete("a", Outcome(ok=True, prompt_tokens=1000, cached_tokens=500))
    v.expect("b", 0.5, 10)
    v.complete("b", Outcome(ok=True, prompt_tokens=None, cached_tokens=10))
    v.expect("c", 0.5, 10)
    v.complete("c", Outcome(ok=True, prompt_tokens=100, cached_tokens=None))  # no cache report
    v.complete("unknown", Outcome(ok=True, prompt_tokens=100, cached_tokens=0))
    assert v.samples == 2 and v.predicted_total == 510 and v.drift == 0.0


def test_cost_policy_ignores_hits_while_degraded():
    policy = Cost(drift_window=10, drift_min_samples=5)
    ws = [WorkerView(f"http://127.0.0.1:{8300 + i}") for i in range(2)]
    text = "shared prefix " * 200
    owner = policy.select(RequestView("seed", "/generate", text=text), ws).worker
    for i in range(6):
        r = RequestView(f"r{i}", "/generate", text=text)
        c = policy.select(r, ws)
        policy.on_complete(r, c.worker, Outcome(ok=True, prompt_tokens=700, cached_tokens=0))
    assert policy.verifier.degraded
    # With hits ignored the owner has no edge: a decode backlog sends the request away.
    for i in range(10):  # ten requests decoding there
        busy = RequestView(f"busy{i}", "/generate", text="other " * 10)
        policy.on_routed(busy, owner)
        policy.on_first_token(busy, owner)
    choice = policy.select(RequestView("x", "/generate", text=text), ws)
    assert choice.worker.url != owner.url and choice.reason.startswith("degraded")
