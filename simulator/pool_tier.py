"""HiCache's L3 tier on a real Mooncake Store: backup, prefetch, and pool-residency events.

What SGLang's HiCache does with ``--hicache-storage-backend mooncake``, and so this does:

* **Backup.** Every page that reaches the host tier (on insert with ``write_through``, on
  device eviction with ``write_back``) is queued and put to the store by a background
  task, batched; a page that made it becomes storage-resident in the trie, which publishes
  ``BlockStored(medium="EXTERNAL")`` exactly as ``engine_patches/l3_events.py`` makes real
  SGLang do. A host page evicted before its backup ran is written back into the storage
  tier by ``RadixCache.evict`` at once (so announced a few milliseconds before its put
  lands) and its put goes to the front of the queue: the scheduler never waits on a put.
* **Prefetch.** Before a request queues, the pages after its device/host prefix are looked
  up in the pool (``batch_is_exist``) and the leading hits fetched for real (``get_batch``,
  timed). Hits are recorded as storage-resident (``BlockStored EXTERNAL`` for pages another
  engine wrote); pages this engine believed pooled but the master evicted are dropped
  (``BlockRemoved EXTERNAL``).
* **Prefetch policy** (``--hicache-storage-prefetch-policy``): ``wait_complete`` queues the
  request once the load is done; ``timeout`` waits at most ``prefetch_timeout_base +
  prefetch_timeout_per_ki_token * tokens/1024`` and credits the share loaded by then;
  ``best_effort`` queues at once and credits what was loaded when the scheduler admits it.

Timing model (a choice, documented here): a pool load costs, in simulated seconds, the
measured wall time of the existence query plus the measured wall time of the real
``get_batch`` times ``(profile.kv_bytes_per_token / kv_bytes_per_token) / speedup`` - the
real model's KV bytes over the bytes really moved, at ``speedup`` times the bandwidth
this box really delivered. Both are timed inside the transfer thread (executor queueing
is not transfer time). ``--storage-speedup`` defaults to auto: at start each worker times
an uncontended 64-page get and picks the speedup that maps that rate to
``--storage-bandwidth-gbps`` (5 GB/s: an RDMA Mooncake pool, the figure behind
``policies.cost``'s 40k tokens/s for an 8B model). So an uncontended load costs what 5 GB/s
would, and one slowed by real contention here (other workers' backups, a busy CPU) costs
proportionally more. With ``--storage-timing link`` a load is instead charged the model's
bytes over ``--storage-bandwidth-gbps`` (``link_bytes_per_s``), whatever the loopback took:
machine-independent figures, with loopback that outlasts the charge counted as lag
(``PoolStats.max_lag_sim_s``). Loopback measured here: ~0.1 GB/s at 64 B/token pages (per-object
overhead dominates), ~0.3 at 256, ~0.9-1.3 at 1024, ~1.7-2 at 4096. The L2 -> L1 leg (host
to GPU over PCIe) is then charged by the scheduler like any host hit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass

from wire.hashing import chain_digests, salt_seed, uint32_le

from .clock import SimClock
from .pool_store import PageStore
from .radix_cache import Match, Node, RadixCache
from .scheduler import WAITING

log = logging.getLogger("simulator.pool")

STORAGE = 2  # tier index: device, host, storage
POLICIES = ("best_effort", "wait_complete", "timeout")
BACKUP_BATCH = 64  # pages per put_batch
DIGEST_CACHE = 1 << 20


@dataclass(slots=True)
class Prefetch:
    """One request's pool load: ``pages`` fetched, starting at simulated ``start``, taking
    ``load_s`` simulated seconds, cut off after ``limit_s`` (timeout policy)."""

    pages: int
    start: float
    load_s: float
    limit_s: float = float("inf")

    def credited(self, now: float, policy: str) -> int:
        if policy == "wait_complete" or self.load_s <= 0:
            return self.pages
        done = min(now - self.start, self.limit_s) / self.load_s
        return int(self.pages * max(0.0, min(1.0, done)))


@dataclass(slots=True)
class PoolStats:
    backups: int = 0
    backup_pages: int = 0
    backup_wall_s: float = 0.0
    queries: int = 0
    hit_pages: int = 0
    fetched_pages: int = 0
    fetch_wall_s: float = 0.0
    fetch_bytes: int = 0
    query_wall_s: float = 0.0
    load_sim_s: float = 0.0  # what the loads were charged, simulated seconds
    max_lag_sim_s: float = 0.0  # link timing: a real load that outlasted its charge
    prefetch_wall_s: float = 0.0  # submit -> queued, wall (incl. the policy's wait)


class PoolTier:
    def __init__(self, store: PageStore, cache: RadixCache, clock: SimClock, *, page_size: int,
                 policy: str = "best_effort", bytes_ratio: float = 1.0, speedup: float = 5.0,
                 timeout_base: float = 1.0, timeout_per_ki_token: float = 0.25,
                 publish: Callable[[list], None] | None = None, link_bytes_per_s: float | None = None,
                 model_page_bytes: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"prefetch policy {policy!r}; expected one of {POLICIES}")
        self.store, self.cache, self.clock = store, cache, clock
        self.page_size = page_size
        self.policy = policy
        self.scale = bytes_ratio / speedup if link_bytes_per_s is None else 0.0
        self.link_s_per_page = model_page_bytes / link_bytes_per_s if link_bytes_per_s else 0.0
        self.timeout_base, self.timeout_per_ki = timeout_base, timeout_per_ki_token
        self.publish = publish
        self.stats = PoolStats()
        self._backlog: dict[Node, None] = {}  # insertion-ordered set: parents before children
        self._writeback: list[bytes] = []  # digests of pages already marked pooled, put pending
        self._wake = asyncio.Event()
        self._quiet = False  # set while this module itself adds storage residency
        self._digests: dict[int, bytes] = {}
        self._tasks: set[asyncio.Task] = set()
        self._fetcher = ThreadPoolExecutor(2, thread_name_prefix="pool-fetch")
        cache.on_tier_add = self._on_tier_add

    def start(self) -> None:
        self._spawn(self._backup_loop())

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fetcher.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- backup ---------------------------------------------------------------------------
    def _on_tier_add(self, node: Node, tier: int) -> None:
        if tier == 1 and not node.present & (1 << STORAGE):
            self._backlog[node] = None
            self._wake.set()
        elif tier == STORAGE and not self._quiet:
            # evicted from host before its backup ran: the trie already says "pooled"
            self._backlog.pop(node, None)
            self._writeback.append(self._digest_of(node))
            self._wake.set()

    async def _backup_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._writeback or self._backlog:
                if self._writeback:
                    urgent, self._writeback = self._writeback, []
                    for i in range(0, len(urgent), BACKUP_BATCH):
                        await self._put(urgent[i:i + BACKUP_BATCH])
                    continue
                batch = []
                for node in self._backlog:
                    batch.append(node)
                    if len(batch) >= BACKUP_BATCH:
                        break
                for node in batch:
                    del self._backlog[node]
                live = [n for n in batch if n.present and not n.present & (1 << STORAGE)]
                if not live:
                    continue
                if not await self._put([self._digest_of(n) for n in live]):
                    continue
                self._quiet = True
                try:
                    for n in live:
                        self.cache.add_tier(n, STORAGE)
                finally:
                    self._quiet = False
                self._flush_events()

    async def _put(self, digests: list[bytes]) -> int:
        t0 = time.monotonic()
        try:
            ok = await asyncio.to_thread(self.store.put_pages, digests)
        except Exception:
            log.exception("pool backup failed")
            ok = 0
        self.stats.backup_wall_s += time.monotonic() - t0
        if ok:
            self.stats.backups += 1
            self.stats.backup_pages += ok
        return ok

    def _digest_of(self, node: Node) -> bytes:
        """A page's SHA-256 chain digest (the pool key), rebuilt from the trie path; nodes
        carry only the int64 event hash."""
        d = self._digests.get(node.key)
        if d is not None:
            return d
        chain = []
        n = node
        while n.parent is not None and n.key not in self._digests:
            chain.append(n)
            n = n.parent
        prev = self._digests[n.key] if n.parent is not None else salt_seed(node.salt)
        if len(self._digests) > DIGEST_CACHE:
            self._digests.clear()
        for x in reversed(chain):
            prev = chain_digests(uint32_le(x.tokens), self.page_size, prev)[0]
            self._digests[x.key] = prev
        return prev

    def _flush_events(self) -> None:
        if self.cache.events and self.publish is not None:
            self.publish(self.cache.drain_events())

    # ---- prefetch ----------------------------------------------------------------------------
    async def prefetch(self, req, enqueue: Callable[[object], None]) -> None:
        """Look the request's uncached pages up in the pool, load the hits, then queue it."""
        t0 = time.monotonic()
        try:
            wait = await self._prefetch(req)
        except Exception:
            log.exception("pool prefetch failed for %s", req.rid)
            wait = 0.0
        if wait > 0:
            await asyncio.sleep(wait)
        self.stats.prefetch_wall_s += time.monotonic() - t0
        enqueue(req)

    async def _prefetch(self, req) -> float:
        """Returns the wall seconds still to wait before the request may queue."""
        ps = self.page_size
        usable = (req.prompt_len - 1) // ps  # always extend >= 1 token, as the scheduler does
        start = self.clock.now()
        req.pool = Prefetch(0, start, 0.0)
        m = self.cache.match(req.hashes[:usable], touch=False)
        local = 0  # leading pages on device or host: no pool load needed
        for n in m.nodes:
            if not n.present & 0b11:
                break
            local += 1
        tail = req.digests[local:usable]
        if not tail:
            return 0.0
        for h, d in zip(req.hashes[local:usable], tail):
            self._digests[h] = d
        loop = asyncio.get_running_loop()
        # own thread: a load must not queue behind backups in the default executor
        hit, query_s = await loop.run_in_executor(self._fetcher, self.store.timed, self.store.hit_prefix, tail)
        got, get_s = 0, 0.0
        if hit:
            got, get_s = await loop.run_in_executor(self._fetcher, self.store.timed, self.store.get_pages, tail[:hit])
        st = self.stats
        st.queries += 1
        st.hit_pages += hit
        st.fetched_pages += got
        st.fetch_wall_s += get_s
        st.fetch_bytes += hit * self.store.page_bytes
        st.query_wall_s += query_s
        if req.state != WAITING:  # aborted meanwhile
            return 0.0
        parent = m.nodes[local - 1] if local else None
        if parent is not None and not parent.present:
            return 0.0  # the prefix left the trie while we were away; serve it cold
        self._quiet = True
        try:
            self.cache.mark(req.hashes[local:local + got], req.input_ids[local * ps:], STORAGE,
                            start=parent, salt=req.cache_salt)
        finally:
            self._quiet = False
        for n in m.nodes[local + got:]:
            if n.present & (1 << STORAGE):
                self.cache.drop_tier(n, STORAGE)  # announced earlier, gone from the pool now
        self._flush_events()
        if self.link_s_per_page:
            load_s = got * self.link_s_per_page
            lag = self.clock.now() - (start + load_s)
            if lag > st.max_lag_sim_s:
                st.max_lag_sim_s = lag
        else:
            load_s = query_s + get_s * self.scale
        st.load_sim_s += load_s
        limit = float("inf")
        if self.policy == "timeout":
            limit = self.timeout_base + self.timeout_per_ki * req.prompt_len / 1024
        req.pool = Prefetch(got, start, load_s, limit)
        if self.policy == "best_effort" or not got:
            return 0.0
        until = start + min(load_s, limit)
        return max(0.0, (until - self.clock.now()) / self.clock.scale)

    # ---- admission ---------------------------------------------------------------------------
    def limit(self, m: Match, req, now: float) -> Match:
        """Cut the match where it needs more pool pages than this request's prefetch loaded."""
        pf = req.pool
        allowed = pf.credited(now, self.policy) if pf is not None else 0
        if m.per_tier[STORAGE] <= allowed:
            return m
        seen = 0
        for i, n in enumerate(m.nodes):
            if (n.present & -n.present).bit_length() - 1 == STORAGE:
                seen += 1
                if seen > allowed:
                    nodes = m.nodes[:i]
                    per = [0] * len(m.per_tier)
                    for x in nodes:
                        per[(x.present & -x.present).bit_length() - 1] += 1
                    return Match(nodes, per)
        return m
