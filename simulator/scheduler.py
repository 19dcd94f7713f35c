"""Continuous batching in simulated time (SGLang's scheduler, priced by the cost model).

One loop iteration is one GPU forward step. As in SGLang without mixed chunks, a step is
an extend (prefill) step whenever waiting work can be admitted, otherwise a decode step
over every running request. Decode progress is kept *implicitly*: a running request that
joined at decode step ``s`` has generated ``1 + steps - s`` tokens, and a heap orders
finishes, so a decode step costs O(1) Python work plus the requests that end in it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable

from wire.hashing import digest_to_int64, page_digests, salt_seed

from . import kv_admission, queue_order
from .clock import SimClock
from .cost_model import CostModel
from .radix_cache import RadixCache
from .request import FINISHED, PREFILL, RUNNING, WAITING, Req
from .step_stats import StepStats

log = logging.getLogger("simulator.scheduler")


class Scheduler:
    def __init__(self, cost: CostModel, cache: RadixCache, clock: SimClock, *, page_size: int,
                 max_total_tokens: int, max_running: int, chunk_size: int,
                 on_events: Callable[[list], None] | None = None,
                 on_finish: Callable[[Req], None] | None = None,
                 policy: str = "fcfs", priority: bool = False, low_priority_values_first: bool = False) -> None:
        self.cost, self.cache, self.clock = cost, cache, clock
        self.policy = policy
        self.priority = priority
        self._prio_sign = 1 if low_priority_values_first else -1
        self._unsorted = False
        self._releases = 0  # requests finished or aborted so far (frees memory)
        self._blocked: tuple[Req, int] | None = None  # (head that did not fit, _releases then)
        self.page_size = page_size
        self.capacity = max_total_tokens
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.on_events = on_events
        self.on_finish = on_finish
        self.waiting: deque[Req] = deque()
        self.ready: deque[Req] = deque()  # PD decode requests whose KV has arrived
        self.chunked: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.steps = 0
        self.n_run = 0
        self.sum_start = 0
        self.sum_prompt_run = 0
        self.sum_max_new = 0  # admitted, unfinished
        self.private_prompt = 0  # prompt tokens held outside the radix tree
        self.sim_now = 0.0
        self._heap: list[tuple[int, int, Req]] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._tick: asyncio.Future = asyncio.get_running_loop().create_future()
        self._last_yield = time.monotonic()
        self.forward_steps = 0
        self.busy_sim = 0.0
        self.stats = StepStats(clock.scale)  # lag behind --time-scale; gen_throughput
        self._task: asyncio.Task | None = None
        self.pool = None  # pool_tier.PoolTier: requests visit the Mooncake pool before queueing
        self._prefetching: set[asyncio.Task] = set()

    # ---- public API ----------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._guarded(), name="scheduler")

    async def _guarded(self) -> None:
        """A scheduler bug must end the process loudly, never leave clients hanging."""
        try:
            await self.run()
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception("scheduler loop crashed")
            os._exit(70)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def submit(self, req: Req) -> Req:
        req.done = asyncio.get_running_loop().create_future()
        self.reqs[req.rid] = req
        if req.prefilled:
            self.ready.append(req)
        elif self.pool is not None and req.use_cache:
            self.hash_prompt(req)
            task = asyncio.get_running_loop().create_task(self.pool.prefetch(req, self._enqueue))
            self._prefetching.add(task)
            task.add_done_callback(self._prefetching.discard)
            return req
        else:
            self.waiting.append(req)
            self._unsorted = True
        self._wake.set()
        return req

    def _enqueue(self, req: Req) -> None:
        """A request back from its pool prefetch joins the queue, unless aborted meanwhile."""
        if req.state == WAITING and req.rid in self.reqs:
            self.waiting.append(req)
            self._unsorted = True
            self._wake.set()

    def tick(self) -> asyncio.Future:
        """A future resolved at the next wall-clock instant the scheduler yields.

        Shielded: every stream awaits the same future, and a client that disconnects cancels
        its own wait, which must not cancel everyone else's tick."""
        return asyncio.shield(self._tick)

    def generated(self, req: Req) -> int:
        if req.state == RUNNING:
            return min(req.out_len, 1 + self.steps - req.decode_start)
        if req.state == FINISHED:
            return 0 if req.abort_message is not None and req.first_token_at is None else req.out_len
        return 0

    def abort(self, rid: str | None = None, message: str = "Abort in waiting queue") -> int:
        targets = list(self.reqs.values()) if rid is None else [r for r in (self.reqs.get(rid),) if r]
        for r in targets:
            self._abort(r, message)
        return len(targets)

    @property
    def running_count(self) -> int:
        return self.n_run + (1 if self.chunked else 0)

    @property
    def waiting_count(self) -> int:
        return len(self.waiting) + len(self.ready)

    @property
    def gen_tokens_running(self) -> int:
        return self.n_run * (self.steps + 1) - self.sum_start

    @property
    def used_tokens(self) -> int:
        return self.cache.tiers[0].used_tokens + self.private_prompt + self.gen_tokens_running

    @property
    def load_tokens(self) -> int:
        """What SGLang reports as num_used_tokens: the pool minus free and evictable pages,
        i.e. tokens pinned by requests (an idle cache is not load)."""
        return self.cache.locked_tokens + self.private_prompt + self.gen_tokens_running

    def queued_prompt_tokens(self, hit_rate: float) -> tuple[int, int]:
        """(uncached, all) prompt tokens waiting for prefill, as SGLang's load snapshot counts them."""
        return queue_order.queued_prompt_tokens(self, hit_rate)

    def busy(self) -> bool:
        return bool(self.reqs)

    # ---- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not (self.waiting or self.ready or self.chunked or self.n_run):
                self._notify()
                self._wake.clear()
                await self._wake.wait()
                self.sim_now = max(self.sim_now, self.clock.now())  # idle GPU: time jumps
                self.stats.idle()
                continue
            kv_admission.take_ready(self)
            parts, host_load = self._form_extend()
            if parts:
                dt = self.cost.extend_batch_time([(n, r.extended) for r, n in parts], host_load)
            elif self.n_run:
                dt = self.cost.decode_step_time(self.n_run, self.sum_prompt_run + self.gen_tokens_running)
            else:  # head of queue does not fit and nothing runs to free memory
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
                continue
            self.sim_now += dt
            self.busy_sim += dt
            self.forward_steps += 1
            await self._sleep_until(self.sim_now)
            if parts:
                self._apply_extend(parts)
            else:
                self._apply_decode()
            if self.cache.events and self.on_events:
                self.on_events(self.cache.drain_events())

    async def _sleep_until(self, sim_t: float) -> None:
        delay = self.clock.wall_at(sim_t) - time.monotonic()
        self.stats.late(delay)  # < 0: the process is slower than the simulated GPU, time stretches
        if delay > 0.0005:
            self._notify()
            await asyncio.sleep(delay)
            self._last_yield = time.monotonic()
        elif time.monotonic() - self._last_yield > 0.002:
            self._notify()
            await asyncio.sleep(0)
            self._last_yield = time.monotonic()

    def _notify(self) -> None:
        if not self._tick.done():
            self._tick.set_result(None)
        self._tick = asyncio.get_running_loop().create_future()

    # ---- admission ----------------------------------------------------------------------
    def hash_prompt(self, r: Req) -> None:
        ps = self.page_size
        r.digests = page_digests(r.input_ids, ps, r.cache_salt)
        r.hashes = [digest_to_int64(d) for d in r.digests]

    def _form_extend(self) -> tuple[list[tuple[Req, int]], int]:
        if self.waiting and queue_order.needs_order(self):
            self.waiting = queue_order.ordered(self)
            self._unsorted = False
        budget = self.chunk_size
        parts: list[tuple[Req, int]] = []
        host_load = 0
        if self.chunked is not None:
            r = self.chunked
            take = min(r.prompt_len - r.extended, budget)
            parts.append((r, take))
            budget -= take
        while self.waiting and budget > 0 and self.n_run + len(parts) < self.max_running:
            r = self.waiting[0]
            if self._blocked == (r, self._releases):
                break  # nothing was freed since this head last failed to fit: don't re-match it
            ok, load = kv_admission.admit(self, r)
            if not ok:
                self._blocked = (r, self._releases)
                break
            self.waiting.popleft()
            host_load += load
            take = min(r.prompt_len - r.extended, budget)
            parts.append((r, take))
            budget -= take
        self.chunked = None
        if parts:
            last, take = parts[-1]
            if last.extended + take < last.prompt_len:
                self.chunked = last
        return parts, host_load

    # ---- step effects ------------------------------------------------------------------------
    def _apply_extend(self, parts: list[tuple[Req, int]]) -> None:
        now = time.monotonic()
        for r, take in parts:
            if r.state != PREFILL:  # aborted meanwhile
                continue
            r.extended += take
            if r.use_cache:
                self._cache_prefix(r, r.extended)
            if r.extended < r.prompt_len:
                continue
            r.first_token_at = now
            self.start_decode(r)

    def _cache_prefix(self, r: Req, tokens: int) -> None:
        """Put the computed full pages into the tree, as SGLang's cache_unfinished_req does
        after every chunk: a long prompt becomes reusable (and visible in KV events) while
        it is still being prefilled."""
        ps = self.page_size
        full = tokens // ps
        if full * ps <= r.locked_len:
            return
        have = r.locked_len // ps  # pages already in the tree under r.node (locked)
        path = self.cache.insert(r.hashes[have:full], r.input_ids[have * ps:full * ps], start=r.node,
                                 salt=r.cache_salt)
        self.cache.relock(r.node, path[-1])
        r.node = path[-1]
        self.private_prompt -= full * self.page_size - r.locked_len
        r.locked_len = full * self.page_size

    def start_decode(self, r: Req) -> None:
        if r.first_token_at is None:
            r.first_token_at = time.monotonic()
        if r.out_len <= 1:
            r.state = RUNNING  # so _finish accounts it uniformly
            r.decode_start = self.steps
            self.n_run += 1
            self.sum_start += self.steps
            self.sum_prompt_run += r.prompt_len
            self._finish(r)
            return
        r.state = RUNNING
        r.decode_start = self.steps
        self.n_run += 1
        self.sum_start += self.steps
        self.sum_prompt_run += r.prompt_len
        heapq.heappush(self._heap, (self.steps + r.out_len - 1, next(self._seq), r))

    def _apply_decode(self) -> None:
        self.steps += 1
        self.stats.decoded(self.n_run)
        over = self.used_tokens - self.capacity
        if over > 0:  # each step's new KV comes out of the evictable cache first, as in SGLang;
            # a small margin (1% of the pool) keeps this from running every single step
            self.cache.evict(0, max(over, self.capacity // 100))
        heap = self._heap
        while heap and heap[0][0] <= self.steps:
            _, _, r = heapq.heappop(heap)
            if r.state == RUNNING:
                self._finish(r)

    def _release(self, r: Req, insert_output: bool) -> None:
        self._releases += 1
        was_running = r.state == RUNNING
        if was_running:
            self.n_run -= 1
            self.sum_start -= r.decode_start
            self.sum_prompt_run -= r.prompt_len
        if r.state in (PREFILL, RUNNING):
            self.sum_max_new -= r.max_new
            if insert_output and r.use_cache and r.out_len > 1:
                self._insert_output(r)
            self.private_prompt -= r.prompt_len - r.locked_len
            self.cache.unlock(r.node)
            r.node = None
            over = self.used_tokens - self.capacity
            if over > 0:  # decode may overshoot the pool (SGLang would retract); settle it now
                self.cache.evict(0, over)
        if self.chunked is r:
            self.chunked = None
        r.state = FINISHED
        r.finished_at = time.monotonic()
        self.reqs.pop(r.rid, None)

    def _insert_output(self, r: Req) -> None:
        """Cache prompt + output (minus the last token, whose KV was never computed)."""
        ps = self.page_size
        full_prompt = r.prompt_len // ps
        total = r.prompt_len + r.out_len - 1
        full_all = total // ps
        if full_all <= full_prompt:
            return
        tokens = r.input_ids[full_prompt * ps:] + list(r.planned.out[: total - r.prompt_len])
        prev = r.digests[full_prompt - 1] if full_prompt else salt_seed(r.cache_salt)
        digests = page_digests(tokens[: (full_all - full_prompt) * ps], ps, prev=prev)
        hashes = [digest_to_int64(d) for d in digests]
        # the output pages were private decode tokens until now: no net growth, but
        # page-align: the new pages move into the tree
        self.cache.insert(hashes, tokens, start=r.node if full_prompt else None, salt=r.cache_salt)

    def _finish(self, r: Req) -> None:
        self._release(r, insert_output=True)
        if self.on_finish:
            self.on_finish(r)
        if r.done is not None and not r.done.done():
            r.done.set_result(None)

    def _abort(self, r: Req, message: str) -> None:
        if r.state == FINISHED:
            return
        if r.state == WAITING:
            try:
                self.waiting.remove(r)
            except ValueError:
                try:
                    self.ready.remove(r)
                except ValueError:
                    pass
        r.abort_message = message
        self._release(r, insert_output=False)
        if self.on_finish:
            self.on_finish(r)
        if r.done is not None and not r.done.done():
            r.done.set_result(None)
        self._notify()

    # ---- flush -------------------------------------------------------------------------------
    def flush(self) -> bool:
        if self.reqs:
            return False
        self.cache.reset()
        if self.on_events:
            self.on_events(self.cache.drain_events())
        return True
