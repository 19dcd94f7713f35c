"""The scheduler's token accounting under random load (in-process, simulated time, fast)."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.clock import SimClock
from simulator.cost_model import CostModel
from simulator.generation import plan_output
from simulator.profiles import get_profile
from simulator.protocol import SamplingParams
from simulator.radix_cache import RadixCache, build_tiers
from simulator.scheduler import FINISHED, Req, Scheduler

PS = 16

reqs = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 400), st.integers(0, 60), st.booleans(),
                          st.sampled_from([None, "salt"])), min_size=1, max_size=25)


async def _run(spec, pool: int, host: int) -> tuple[Scheduler, list[Req]]:
    prof = get_profile("tiny-test", max_total_num_tokens=pool, chunked_prefill_size=256, max_running_requests=8)
    cache = RadixCache(PS, build_tiers(pool, host), write_through=False)
    sched = Scheduler(CostModel(prof), cache, SimClock(1e6), page_size=PS, max_total_tokens=pool,
                      max_running=8, chunk_size=256)
    sched.start()
    rng = random.Random(0)
    submitted: list[Req] = []
    for i, (prefix, extra, out, abort, salt) in enumerate(spec):
        ids = [prefix] * 200 + [rng.randrange(256) for _ in range(extra)]
        r = Req(rid=f"r{i}", input_ids=ids, planned=plan_output(i, out, SamplingParams()), cache_salt=salt)
        submitted.append(sched.submit(r))
        if abort:
            await asyncio.sleep(0)
            sched.abort(r.rid)
    await asyncio.wait_for(asyncio.gather(*(r.done for r in submitted)), 20)
    await sched.stop()
    return sched, submitted


@settings(max_examples=40, deadline=None)
@given(reqs, st.sampled_from([(2048, 0), (1024, 2048), (4096, 4096)]))
def test_accounting_returns_to_zero(spec, pools):
    pool, host = pools
    sched, submitted = asyncio.run(_run(spec, pool, host))
    assert all(r.state == FINISHED for r in submitted)
    assert (sched.n_run, sched.private_prompt, sched.sum_max_new, sched.sum_start) == (0, 0, 0, 0)
    assert sched.cache.locked_tokens == 0 and sched.load_tokens == 0
    assert sched.used_tokens == sched.cache.tiers[0].used_tokens <= pool
    assert not sched.reqs and not sched.waiting and sched.chunked is None
    for r in submitted:
        assert r.cached_tokens <= max(0, (r.prompt_len - 1) // PS * PS)
        if r.abort_message is None:
            assert sched.generated(r) == r.out_len and r.first_token_at is not None


def test_shared_prefix_hits_and_queueing():
    spec = [(1, 50, 5, False, None)] * 6
    sched, submitted = asyncio.run(_run(spec, 1 << 16, 0))
    # the first extend of the shared 200-token prefix is reused by later requests
    assert submitted[0].cached_tokens == 0
    assert any(r.cached_tokens >= 192 for r in submitted[1:])


def test_chunked_prefill_caches_each_chunk():
    async def run() -> tuple[list[int], int]:
        prof = get_profile("tiny-test", max_total_num_tokens=1 << 16, chunked_prefill_size=256)
        cache = RadixCache(PS, build_tiers(1 << 16), clock=lambda: 0.0)
        sched = Scheduler(CostModel(prof), cache, SimClock(1.0), page_size=PS, max_total_tokens=1 << 16,
                          max_running=8, chunk_size=256)
        sched.start()
        r = sched.submit(Req(rid="long", input_ids=list(range(200)) * 5, planned=plan_output(1, 2, SamplingParams())))
        seen = []
        while r.state != FINISHED:
            seen.append(cache.tiers[0].used_tokens)
            await asyncio.sleep(0.001)
        await sched.stop()
        return seen, r.prompt_len

    seen, n = asyncio.run(run())
    # pages appeared chunk by chunk (256, 512, ...) before the 1000-token prefill finished
    assert 256 in seen and 512 in seen and max(seen) <= n


def _order_after_blocker(policy: str, priority: bool, reqs: list[Req]) -> list[str]:
    """Submit a long blocker, then ``reqs`` while it runs; report their admission order."""
    async def run() -> list[str]:
        prof = get_profile("tiny-test", max_total_num_tokens=1 << 16)
        cache = RadixCache(PS, build_tiers(1 << 16))
        sched = Scheduler(CostModel(prof), cache, SimClock(100.0), page_size=PS, max_total_tokens=1 << 16,
                          max_running=2, chunk_size=4096, policy=policy, priority=priority)
        order: list[str] = []
        sched.on_finish = lambda r: order.append(r.rid)
        sched.start()
        warm = sched.submit(Req(rid="warm", input_ids=[7] * 300, planned=plan_output(0, 1, SamplingParams())))
        await warm.done
        blocker = sched.submit(Req(rid="blocker", input_ids=[1, 2, 3], planned=plan_output(0, 30, SamplingParams())))
        filler = sched.submit(Req(rid="filler", input_ids=[4, 5, 6], planned=plan_output(0, 30, SamplingParams())))
        for r in reqs:
            sched.submit(r)
        await asyncio.wait_for(asyncio.gather(blocker.done, filler.done, *(r.done for r in reqs)), 20)
        await sched.stop()
        return [rid for rid in order if rid not in ("warm", "blocker", "filler")]

    return asyncio.run(run())


def _mk(rid: str, ids: list[int], priority: int | None = None) -> Req:
    return Req(rid=rid, input_ids=ids, planned=plan_output(1, 1, SamplingParams()), priority=priority)


def test_priority_and_lpm_reorder_the_waiting_queue():
    reqs = lambda: [_mk("cold", [9] * 300, 1), _mk("hot", [7] * 300, 5)]  # noqa: E731
    assert _order_after_blocker("fcfs", False, reqs()) == ["cold", "hot"]
    assert _order_after_blocker("fcfs", True, reqs()) == ["hot", "cold"]  # larger priority first
    assert _order_after_blocker("lpm", False, reqs()) == ["hot", "cold"]  # "hot" shares the warm prefix
