"""The suite's workloads: seeded, well-formed records, loads fitted to the fleet; and one
small suite run end to end (simulated workers, kvgate, sglang-router)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import suite
from bench.offered_load import queue_floor
from bench.suite_report import floor
from bench.trace import BLOCK, expand
from bench.workloads import WORKLOADS, Fleet, chat, offered

TRACE = Path(__file__).parent / "data" / "mooncake_conversation_head500.jsonl"  # see data/README.md
FLEET = Fleet(workers=8)


def make(name: str, size: int, load: float, fleet: Fleet = FLEET, seed: int = 0):
    if name == "chat":
        return chat(size, load, fleet, seed, trace=TRACE)
    return WORKLOADS[name].make(size, load, fleet, seed)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_records_are_well_formed_and_seeded(name):
    records = make(name, 120, 0.5)
    assert 100 <= len(records) <= 120
    assert records[0].timestamp == 0
    assert all(a.timestamp <= b.timestamp for a, b in zip(records, records[1:]))
    for r in records:
        assert (len(r.hash_ids) - 1) * BLOCK < r.input_length <= len(r.hash_ids) * BLOCK
        assert r.output_length > 0
    assert len(expand(records[-1])) == records[-1].input_length
    again = make(name, 120, 0.5)
    assert [(r.timestamp, r.hash_ids) for r in again] == [(r.timestamp, r.hash_ids) for r in records]
    if name != "chat":  # the trace is the trace; the generators follow their seed
        other = make(name, 120, 0.5, seed=1)
        assert [r.hash_ids for r in other] != [r.hash_ids for r in records]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_load_is_fitted_to_the_fleet(name):
    """The offered prefill load at the bounded oracle's hit rate is the asked one, on any
    fleet: twice the workers, twice the arrival rate."""
    small, big = Fleet(workers=4), Fleet(workers=8)
    a, b = make(name, 120, 0.6, small), make(name, 120, 0.6, big)
    la, lb = offered(a, small), offered(b, big)
    assert la["prefill_load_at_bounded_oracle"] == pytest.approx(0.6, rel=0.01)
    assert lb["prefill_load_at_bounded_oracle"] == pytest.approx(0.6, rel=0.01)
    assert lb["req_per_s"] == pytest.approx(2 * la["req_per_s"], rel=0.05)


def test_workloads_share_no_blocks_and_differ_in_reuse():
    ids = {name: {h for r in make(name, 200, 0.5) for h in r.hash_ids} for name in WORKLOADS}
    names = list(ids)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            assert not ids[x] & ids[y], (x, y)
    hit = {name: offered(make(name, 200, 0.5), FLEET)["bounded_oracle_hit_rate"] for name in WORKLOADS}
    assert hit["overload"] < 0.15 and hit["agents"] > 0.7 and hit["rag"] > 0.6


def test_the_queue_floor_serves_in_arrival_order_on_every_gpu():
    """One queue over the fleet: requests that find a GPU idle take their prefill alone, the
    others wait for the first GPU to free, in arrival order."""
    assert queue_floor([0.0, 0.0, 0.0], [1.0, 2.0, 3.0], workers=3) == [1.0, 2.0, 3.0]
    # one GPU: the second waits for the first; the third arrives after both ended
    assert queue_floor([0.0, 0.5, 10.0], [2.0, 1.0, 1.0], workers=1) == [1.0, 2.0, 2.5]
    # two GPUs, three at once: the third starts where the shorter one ended
    assert queue_floor([0.0, 0.0, 0.0], [1.0, 4.0, 1.0], workers=2) == [1.0, 2.0, 4.0]


def test_only_a_load_past_capacity_holds_cost_to_the_queued_floor():
    """Where the bounded oracle's prefill still exceeds the fleet, queues grow under any
    router, and the floor is the queued one; elsewhere it is the idle GPU's."""
    setup = offered(make("overload", 200, 1.3), FLEET)
    assert setup["ttft_queue_floor_mean_s"] > 2 * setup["ttft_floor_mean_s"]
    assert floor(setup) == (setup["ttft_queue_floor_mean_s"], setup["ttft_queue_floor_p99_s"])
    calm = offered(make("overload", 200, 0.5), FLEET)
    assert floor(calm) == (calm["ttft_floor_mean_s"], calm["ttft_floor_p99_s"])


def test_router_specs_skip_smg_without_a_starter(monkeypatch, capsys):
    monkeypatch.delattr(suite.services, "start_smg", raising=False)
    a = suite.build_parser().parse_args(["--sweep", "work_weight=3,48"])
    labels = [s.label for s in suite.router_specs(a)]
    assert labels == ["kvgate:cost", "kvgate:cache_aware", "kvgate:cost[work_weight=3]",
                      "kvgate:cost[work_weight=48]", "sglang-router:cache_aware"]
    assert "start_smg" in capsys.readouterr().err


def test_a_small_suite_runs_end_to_end(tmp_path):
    """Two workloads on two simulated workers through kvgate cost and sglang-router: one row
    each per (workload, router), targets judged, a table and a plot written."""
    out = tmp_path / "suite"
    rc = suite.main(["--workloads", "burst", "overload", "--workers", "2", "--scale", "0.1", "--quick",
                     "--kvgate", "cost", "--smg", "--out", str(out), "--no-results"])
    assert rc == 0
    saved = json.loads((out / "summary.json").read_text())
    rows = {(r["workload"], r["label"]) for r in saved["runs"]}
    assert rows == {(w, lab) for w in ("burst", "overload") for lab in ("kvgate:cost", "sglang-router:cache_aware")}
    assert all(r["errors"] == 0 and r["ok"] == saved["setups"][r["workload"]]["requests"] for r in saved["runs"])
    assert "| burst | kvgate:cost |" in (out / "table.md").read_text()
    assert (out / "suite.png").stat().st_size > 0
    # Each run's logs in a directory of their own, which bench.hit_loss reads whole.
    run_logs = out / "burst" / "logs" / "kvgate_cost" / "1"
    assert (run_logs / "router0.log").exists() and len(list(run_logs.glob("unified-*.log"))) == 2
