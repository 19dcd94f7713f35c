"""Golden decisions: ``cost`` and ``pd_cost`` decide exactly as they did when the fixture was
recorded (tests/data/cost_golden.json).

Scripted, seeded traffic under a controlled clock (``time.monotonic`` is replaced, so every
module that reads the clock reads this one): routed, first-token and completion hooks,
engine load reports, KV capacity pressure, a precise index filled by KV events in three
tiers with a shared pool, the approximate tree, held requests, temperature sampling and
learned prefill speed. Every decision (worker, reason, predicted cached tokens, ``Hold``
retry) and the final ``stats()`` are compared for equality, floats included: the proof that
a refactoring of the routing core changed no decision. Regenerate (only for an intended
change of behaviour) with ``KVGATE_GOLDEN_WRITE=1``.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path


from index.block_index import BlockIndex
from policies.base import Choice, EngineLoad, Hold, Outcome, RequestView, WorkerView
from policies.cost import Cost
from policies.pd_cost import PDCost
from wire.hashing import page_hashes
from wire.kv_events import BlockRemoved, BlockStored

FIXTURE = Path(__file__).parent / "data" / "cost_golden.json"
PS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def full_prices(policy: Cost, request: RequestView, workers: list[WorkerView]) -> list[list[float]]:
    """Every worker's (ttft, uncached, cached, score) by the policy's full pricing."""
    costs, scores = policy.price(request, workers)
    return [[*c, s] for c, s in zip(costs, scores)]


class Script:
    """One scripted run: traffic, engine, KV events, holds."""

    def __init__(self, clock: Clock, seed: int, policy: Cost, workers: list[WorkerView], *, index: BlockIndex | None,
                 text_share: float = 0.0, pd_decodes: list[WorkerView] | None = None) -> None:
        self.clock, self.rng, self.policy, self.workers = clock, random.Random(seed), policy, workers
        self.index, self.text_share, self.decodes = index, text_share, pd_decodes
        self.events: list[tuple[float, int, str, object]] = []  # (time, seq, kind, payload)
        self.seq = 0
        self.held: list[tuple[RequestView, float, float]] = []  # (request, first held at, retry at)
        self.log: list[list] = []
        self.n = 0
        # Shared prefixes (system prompts): three families; conversations grow turn by turn.
        self.prefixes = [list(range(1_000_000 * (k + 1), 1_000_000 * (k + 1) + size))
                         for k, size in enumerate((2048, 4096, 8192))]
        self.convs: list[list[int]] = []
        if index is not None:  # the second family sits in the shared pool from the start
            index.apply_batch(workers[0].url, [BlockStored(block_hashes=page_hashes(self.prefixes[1], PS)[:200],
                                                           parent_block_hash=None, token_ids=[], block_size=PS,
                                                           medium="EXTERNAL")])

    def at(self, t: float, kind: str, payload: object) -> None:
        self.seq += 1
        self.events.append((t, self.seq, kind, payload))

    def prompt(self) -> list[int]:
        rng = self.rng
        if self.convs and rng.random() < 0.5:  # a follow-up turn
            conv = rng.choice(self.convs)
            conv.extend(rng.randrange(50_000) for _ in range(rng.randrange(50, 1500)))
            return list(conv)
        base = list(rng.choice(self.prefixes)) if rng.random() < 0.7 else []
        base.extend(rng.randrange(50_000) for _ in range(rng.randrange(100, 12_000)))
        if rng.random() < 0.4:
            self.convs.append(list(base))
            if len(self.convs) > 30:
                self.convs.pop(0)
        return base

    def request(self) -> RequestView:
        rng = self.rng
        self.n += 1
        tokens = self.prompt()
        max_tokens = rng.choice([None, 16, 128, 512, 2048])
        stream = rng.random() < 0.8
        if rng.random() < self.text_share:
            return RequestView(f"q{self.n}", "/generate", text="".join(f"w{t % 97} " for t in tokens[:3000]),
                               max_tokens=max_tokens, stream=stream, may_hold=True)
        return RequestView(f"q{self.n}", "/generate", token_ids=tokens, max_tokens=max_tokens, stream=stream,
                           may_hold=rng.random() < 0.7)

    def decide(self, request: RequestView) -> Choice | Hold:
        if self.decodes is not None:
            out = self.policy.select_pair(request, self.workers, self.decodes)
            if isinstance(out, Hold):
                self.log.append([request.request_id, "hold", out.reason, out.retry_s])
                return out
            p, d = out
            self.log.append([request.request_id, self.workers.index(p.worker), self.decodes.index(d.worker),
                             p.reason, d.reason, p.predicted_cached_tokens])
            return p
        out = self.policy.select(request, self.workers)
        if isinstance(out, Hold):
            self.log.append([request.request_id, "hold", out.reason, out.retry_s])
        else:
            self.log.append([request.request_id, self.workers.index(out.worker), out.reason,
                             out.predicted_cached_tokens])
        return out

    def route(self, request: RequestView, choice: Choice) -> None:
        rng, now, policy = self.rng, self.clock.now, self.policy
        worker = choice.worker
        if rng.random() < 0.03:  # the gateway retried it elsewhere
            worker = rng.choice(self.workers)
        policy.on_routed(request, worker)
        prompt = request.prompt_tokens_estimate
        if rng.random() < 0.04:  # fails before its first token
            self.at(now + rng.uniform(0.01, 0.5), "fail", (request, worker))
            return
        first = now + rng.uniform(0.02, 0.3) + prompt / rng.choice([15_000.0, 25_000.0, 40_000.0])
        self.at(first, "first", (request, worker))
        out = rng.randrange(1, (request.max_tokens or 256) + 1)
        self.at(first + out * rng.uniform(0.005, 0.04), "done", (request, worker, out))

    def kv_stored(self, request: RequestView, worker: WorkerView) -> None:
        if self.index is None or request.token_ids is None:
            return
        rng = self.rng
        hashes = page_hashes(request.token_ids, PS)
        medium = rng.choices(["GPU", "CPU", "EXTERNAL"], [0.7, 0.2, 0.1])[0]
        self.index.apply_batch(worker.url, [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                                        block_size=PS, medium=medium)])
        if rng.random() < 0.15 and len(hashes) > 8:  # evicted from the GPU, kept in host memory
            k = rng.randrange(len(hashes) // 2, len(hashes))
            self.index.apply_batch(worker.url, [BlockRemoved(block_hashes=hashes[k:], medium="GPU"),
                                                BlockStored(block_hashes=hashes[k:], parent_block_hash=hashes[k - 1],
                                                            token_ids=[], block_size=PS, medium="CPU")])

    def hooks_until(self, t: float) -> None:
        """Fire every engine event due by ``t`` in time order, the clock at each; a held
        request is decided again after each first token or completion."""
        policy = self.policy
        while True:
            due = [e for e in self.events if e[0] <= t]
            if not due:
                break
            e = min(due)
            self.events.remove(e)
            self.clock.now = max(self.clock.now, e[0])
            kind, payload = e[2], e[3]
            if kind == "first":
                request, worker = payload
                policy.on_first_token(request, worker)
                self.kv_stored(request, worker)
            elif kind == "done":
                request, worker, out = payload
                prompt = request.prompt_tokens_estimate
                cached = self.rng.randrange(0, prompt + 1) if prompt else 0
                policy.on_complete(request, worker, Outcome(ok=True, prompt_tokens=prompt, cached_tokens=cached,
                                                            completion_tokens=out))
            else:
                request, worker = payload
                policy.on_complete(request, worker, Outcome(ok=False, status=500, error="boom"))
            if kind != "fail" or self.rng.random() < 0.5:
                self.retry_held(wake=True)
        self.clock.now = max(self.clock.now, t)

    def retry_held(self, wake: bool) -> None:
        now = self.clock.now
        keep = []
        for request, since, retry_at in self.held[:3] if wake else self.held:
            if not wake and retry_at > now:
                keep.append((request, since, retry_at))
                continue
            request.held_s = now - since
            out = self.decide(request)
            if isinstance(out, Hold):
                keep.append((request, since, now + out.retry_s))
            else:
                self.route(request, out)
        self.held = keep + (self.held[3:] if wake else [])

    def reports(self) -> None:
        rng, now = self.rng, self.clock.now
        for i, w in enumerate(self.workers):
            if w.url.endswith("5") or rng.random() < 0.5:  # one never reports: server_info capacity
                continue
            cap = w.server_info.get("max_total_num_tokens", 0)
            self.workers[i] = w.reported(load=EngineLoad(  # replaced, as the gateway's poller does
                running=rng.randrange(0, 12), waiting=rng.choice([0, 0, 0, 1, 3]),
                used_tokens=rng.randrange(0, cap + 1), max_tokens=cap, timestamp=now))

    def run(self, decisions: int, gap: float) -> None:
        rng = self.rng
        next_report = self.clock.now
        removed = False
        while self.n < decisions:
            t = self.clock.now + rng.expovariate(1.0 / gap)
            if rng.random() < 0.05:
                t += rng.uniform(0.5, 3.0)  # a pause: queues drain, the busy share falls
            self.hooks_until(t)
            if self.clock.now >= next_report:
                self.reports()
                next_report = self.clock.now + 0.25
            self.retry_held(wake=False)
            if not removed and self.n >= decisions * 2 // 3 and len(self.workers) > 3:
                gone = self.workers.pop()
                self.policy.on_worker_removed(gone)
                removed = True
            request = self.request()
            out = self.decide(request)
            if isinstance(out, Hold):
                self.held.append((request, self.clock.now, self.clock.now + out.retry_s))
            else:
                self.route(request, out)

    def finish(self, probes: int = 4) -> dict:
        stats = {k: float(v) for k, v in sorted(self.policy.stats().items())}
        priced = []
        if self.decodes is None:
            for k in range(probes):
                probe = self.request()
                priced.append(full_prices(self.policy, probe, self.workers))
        return {"decisions": self.log, "stats": stats, "priced": priced}


def _workers(n: int, cap: int, hosts: int = 0, role: str = "unified", port: int = 8100) -> list[WorkerView]:
    return [WorkerView(f"http://10.0.0.{(i % hosts) + 1 if hosts else 1}:{port + i}", role=role,
                       server_info={"page_size": PS, "max_total_num_tokens": cap}) for i in range(n)]


def scenarios(monkeypatch) -> dict:
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    out = {}

    # Precise index, three tiers and the pool; late binding, learned prefill, engine queues drained.
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=2.0)
    ws = _workers(6, 60_000)
    policy = Cost(index=index, hold_wait_s=0.1, learn_prefill=True, tpot_s=0.02)
    script = Script(clock, 1, policy, ws, index=index)
    script.run(320, 0.12)
    out["precise"] = script.finish()

    # The same under a tighter KV pool and more traffic, load-blind: KV waits on queued workers.
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=1.0)
    ws = _workers(5, 30_000)
    policy = Cost(index=index, load_aware=False, work_weight=4.0, attention_tokens=20_000, tpot_s=0.05,
                  pool_load_tokens_per_s=3_000.0)  # a pool slower than prefill: hits priced above misses
    script = Script(clock, 2, policy, ws, index=index)
    script.run(220, 0.01)
    out["tight"] = script.finish()

    # Temperature sampling: every decision fully scored.
    index = BlockIndex(default_page_size=PS)
    ws = _workers(5, 50_000)
    policy = Cost(index=index, temperature=0.05, seed=7, pool_load_tokens_per_s=20_000.0)
    script = Script(clock, 3, policy, ws, index=index)
    script.run(150, 0.08)
    out["sampled"] = script.finish()

    # The approximate tree, text and token requests, engine queues taken as reported.
    ws = _workers(4, 40_000)
    policy = Cost(index="approx", engine_load="max", hold_wait_s=0.05, prefill_tokens_per_s=12_000.0)
    script = Script(clock, 4, policy, ws, index=None, text_share=0.4)
    script.run(150, 0.1)
    out["approx"] = script.finish()

    # Hit verification degrades routing to load alone (engines report other cached tokens
    # than predicted), then recovers.
    index = BlockIndex(default_page_size=PS)
    ws = _workers(4, 50_000)
    policy = Cost(index=index, drift_window=16, drift_min_samples=8, drift_degrade_above=0.35,
                  drift_recover_below=0.3)
    script = Script(clock, 6, policy, ws, index=index)
    script.run(150, 0.08)
    out["degraded"] = script.finish()

    # pd_cost: pairs over hosts, prefill workers that free KV at the first token.
    index = BlockIndex(default_page_size=PS)
    prefills = _workers(3, 40_000, hosts=3, role="prefill", port=30000)
    decodes = _workers(3, 80_000, hosts=3, role="decode", port=31000)
    policy = PDCost(index=index, hold_wait_s=0.1, decode_cost_s=0.001)
    script = Script(clock, 5, policy, prefills, index=index, pd_decodes=decodes)
    script.run(150, 0.03)
    out["pd"] = script.finish()
    return out


def test_decisions_match_the_golden_fixture(monkeypatch):
    got = json.loads(json.dumps(scenarios(monkeypatch)))
    if os.environ.get("KVGATE_GOLDEN_WRITE"):
        FIXTURE.write_text(json.dumps(got, indent=None, separators=(",", ":")) + "\n")
    want = json.loads(FIXTURE.read_text())
    for name in want:
        for k, (a, b) in enumerate(zip(got[name]["decisions"], want[name]["decisions"])):
            assert a == b, f"{name}: decision {k} differs"
        assert len(got[name]["decisions"]) == len(want[name]["decisions"]), name
        assert got[name]["stats"] == want[name]["stats"], name
        assert got[name]["priced"] == want[name]["priced"], name
    assert got.keys() == want.keys()


def test_the_fixture_exercises_what_it_proves():
    want = json.loads(FIXTURE.read_text())
    decisions = [d for run in want.values() for d in run["decisions"]]
    assert len(decisions) >= 900
    assert sum(d[1] == "hold" for d in decisions) >= 10
    assert want["precise"]["stats"]["prefill_samples"] > 0 and want["precise"]["stats"]["diverted"] > 0
    assert want["precise"]["stats"]["prefill_tokens_per_s"] != 25_000.0
    reasons = [d[2] for d in want["degraded"]["decisions"] if d[1] != "hold"]
    assert any(r.startswith("degraded") for r in reasons) and any(r.startswith("ttft") for r in reasons)
