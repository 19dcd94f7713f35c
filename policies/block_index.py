"""Precise prefix index: the blocks each worker reported through SGLang KV events.

Every worker gets a slot; a block hash maps to one int with three bits per slot, set when
the worker holds the block on GPU (bit ``3*slot``), on GPU or host (``3*slot+1``), in any
tier including the shared pool (``3*slot+2``). A request's page-hash chain
(``wire.hashing.page_hashes`` with the worker's ``page_size`` and ``cache_salt``) is looked
up with ``map(dict.get)`` and AND-accumulated (``itertools.accumulate``), both in C: bit
``3*slot+t`` of the running AND is set exactly while every page so far is in tier <= t on
that worker. The few positions where the running AND changes (found by bisection) give
every worker's prefix length per tier. The cost is a C-speed pass over the pages plus a
little Python per worker that actually holds the prefix, independent of fleet size.
Each worker's own raw tier bits per block live in its slot's dict (used for updates).

Parent links are kept for each stored block so a worker's chains can be read back
(``chain``) and blocks whose parent the worker never reported are counted (``orphans``:
a sign of lost events).

The Mooncake pool (medium ``EXTERNAL``/``DISK``) is one store shared by every engine
attached to it, so by default (``shared_pool``) a page any engine announced there counts for
every worker: it is kept once, in ``pool``, and a worker's prefix extends through it
whatever that worker holds itself. Per-worker pool bits remain for fleets whose engines do
not share one pool (``shared_pool=False``).

Speculative entries cover the time between routing a request and the engine's
``BlockStored`` arriving: ``record`` marks the request's pages the worker was not already
known to hold as on its GPU for ``speculative_ttl_s`` seconds; the walk ORs them in. The
page-hash chain of a prompt is computed once per request and resumed from earlier turns
(``policies.page_hash_cache``).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from itertools import accumulate, repeat, takewhile
from operator import and_, attrgetter, or_

from policies.base import RequestView, WorkerView
from policies.prefix_index import NO_HIT, IndexMatch, Tiers, Unit
from policies.page_hash_cache import PageHashCache
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, BlockStoredRef, Event

TIER_OF_MEDIUM = {"GPU": 0, "CPU_PINNED": 1, "CPU": 1, "DISK": 2, "EXTERNAL": 2}
# Raw tier bits of one slot (1 GPU, 2 host, 4 pool) -> its "at most this slow" bits.
_CUMULATIVE = [0, 7, 6, 7, 4, 7, 6, 7]
_url = attrgetter("url")


def medium_tier(medium: str | None) -> int:
    return TIER_OF_MEDIUM.get(medium.upper(), 0) if medium else 0


def _bit_indexes(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class BlockIndex:
    """``PrefixIndex`` over KV-event block hashes; lengths are in tokens."""

    unit: Unit = "tokens"

    def __init__(self, default_page_size: int = 1, speculative_ttl_s: float = 3.0,
                 hash_cache: int = 64, shared_pool: bool = True) -> None:
        self.default_page_size = int(default_page_size)
        self.shared_pool = bool(shared_pool)
        self.pool: set[int] = set()  # page hashes in the shared store (when shared_pool)
        self.speculative_ttl_s = float(speculative_ttl_s)
        self.blocks: dict[int, int] = {}
        self.parent: dict[int, int | None] = {}
        self._slots: dict[str, int] = {}
        self._urls: list[str | None] = []
        self._owned: list[dict[int, int]] = []  # per slot: block hash -> raw tier bits
        self._free: list[int] = []
        self._page_size: dict[str, int] = {}
        self._spec: dict[int, int] = {}
        self._spec_until: dict[int, dict[int, float]] = {}  # slot -> page hash -> expiry
        self._spec_queue: deque[tuple[float, int, list[int]]] = deque()
        self._hashes: OrderedDict[tuple, tuple[list[int], list[int]]] = OrderedDict()
        self._hash_cache = hash_cache
        self.chains = PageHashCache()
        self._last_match: tuple[str, dict[str, Tiers]] | None = None
        self._version = 0  # bumps when slots or page sizes change
        self._groups: dict[tuple[str, ...], tuple[int, list[tuple[int, int]]]] = {}
        self.orphans = 0
        self.events_applied = 0
        self.clears = 0

    # -- workers ------------------------------------------------------------------------
    def slot(self, url: str) -> int:
        s = self._slots.get(url)
        if s is None:
            if self._free:
                s = self._free.pop()
                self._urls[s] = url
            else:
                s = len(self._urls)
                self._urls.append(url)
                self._owned.append({})
            self._slots[url] = s
            self._version += 1
        return s

    def set_page_size(self, url: str, page_size: int) -> None:
        self._page_size[url] = int(page_size)
        self._version += 1

    def page_size_of(self, worker: WorkerView) -> int:
        """The engine's page size: from its events' ``block_size``, else ``server_info``, else
        the default (not remembered, so a later server_info or event still wins)."""
        ps = self._page_size.get(worker.url)
        if ps is None:
            reported = worker.server_info.get("page_size")
            if not reported:
                return self.default_page_size
            ps = self._page_size[worker.url] = int(reported)
            self._version += 1
        return ps

    def remove_worker(self, url: str) -> None:
        if url in self._slots:
            self.clear_worker(url)
            s = self._slots.pop(url)
            self._urls[s] = None
            self._free.append(s)
        self._page_size.pop(url, None)
        self._version += 1

    def clear_worker(self, url: str) -> None:
        """Forget every block of ``url``: after AllBlocksCleared, a reconnect or a lost gap."""
        s = self._slots.get(url)
        if s is None:
            return
        self.clears += 1
        keep = ~(7 << (3 * s))
        blocks, parent = self.blocks, self.parent
        for h in self._owned[s]:
            m = blocks.get(h, 0) & keep
            if m:
                blocks[h] = m
            else:
                blocks.pop(h, None)
                parent.pop(h, None)
        self._owned[s] = {}
        keep = ~(7 << (3 * s))
        for h in self._spec_until.pop(s, {}):
            m = self._spec.get(h, 0) & keep
            if m:
                self._spec[h] = m
            else:
                self._spec.pop(h, None)

    def worker_size(self, url: str) -> int:
        s = self._slots.get(url)
        return len(self._owned[s]) if s is not None else 0

    # -- events -------------------------------------------------------------------------
    def apply_batch(self, url: str, events: Sequence[Event | BlockStoredRef]) -> None:
        """A decoded batch, with the per-event work kept to a dict lookup for the medium."""
        stored, removed, tiers = (BlockStored, BlockStoredRef), BlockRemoved, TIER_OF_MEDIUM
        for event in events:
            if isinstance(event, stored):
                tier = tiers.get(event.medium or "GPU")
                self.store(url, event.block_hashes, event.parent_block_hash,
                           medium_tier(event.medium) if tier is None else tier, event.block_size)
            elif isinstance(event, removed):
                tier = tiers.get(event.medium or "GPU")
                self.remove(url, event.block_hashes, medium_tier(event.medium) if tier is None else tier)
            elif isinstance(event, AllBlocksCleared):
                self.clear_worker(url)
        self.events_applied += len(events)

    def apply(self, url: str, event: Event | BlockStoredRef) -> None:
        self.events_applied += 1
        if isinstance(event, (BlockStored, BlockStoredRef)):
            self.store(url, event.block_hashes, event.parent_block_hash, medium_tier(event.medium),
                       event.block_size)
        elif isinstance(event, BlockRemoved):
            self.remove(url, event.block_hashes, medium_tier(event.medium))
        elif isinstance(event, AllBlocksCleared):
            self.clear_worker(url)

    def store(self, url: str, hashes: Sequence[int], parent: int | None, tier: int = 0,
              block_size: int | None = None) -> None:
        if block_size and self._page_size.get(url) != block_size:  # the engine's own word
            self.set_page_size(url, block_size)
        if tier == 2 and self.shared_pool:
            self.slot(url)
            self.pool.update(hashes)
            return
        s = self.slot(url)
        shift = 3 * s
        keep = ~(7 << shift)
        blocks, parents, owned = self.blocks, self.parent, self._owned[s]
        if parent is not None and parent not in owned:
            self.orphans += 1
        for h in hashes:
            raw = owned.get(h, 0) | (1 << tier)
            owned[h] = raw
            blocks[h] = (blocks.get(h, 0) & keep) | (_CUMULATIVE[raw] << shift)
            parents[h] = parent
            parent = h

    def remove(self, url: str, hashes: Sequence[int], tier: int = 0) -> None:
        if tier == 2 and self.shared_pool:  # the store evicted it: gone for everyone
            self.pool.difference_update(hashes)
            return
        s = self._slots.get(url)
        if s is None:
            return
        shift = 3 * s
        keep = ~(7 << shift)
        blocks, owned = self.blocks, self._owned[s]
        for h in hashes:
            raw = owned.get(h)
            if raw is None:
                continue
            raw &= ~(1 << tier)
            m = (blocks.get(h, 0) & keep) | (_CUMULATIVE[raw] << shift)
            if raw:
                owned[h] = raw
            else:
                del owned[h]
            if m:
                blocks[h] = m
            else:
                blocks.pop(h, None)
                self.parent.pop(h, None)

    def chain(self, h: int, limit: int = 1 << 20) -> list[int]:
        """The stored chain ending at ``h``, root first."""
        out: list[int] = []
        cur: int | None = h
        while cur is not None and cur in self.parent and len(out) < limit:
            out.append(cur)
            cur = self.parent[cur]
        return out[::-1]

    # -- requests -----------------------------------------------------------------------
    def usable(self, request: RequestView) -> bool:
        return request.token_ids is not None

    def hashes_for(self, request: RequestView, page_size: int) -> list[int]:
        """Page hashes of the request, cached briefly: select and record both need them."""
        tokens = request.token_ids or []
        key = (request.request_id, page_size, request.cache_salt)
        got = self._hashes.get(key)
        # The cache holds the token list itself, so identity cannot be a recycled id().
        if got is None or got[0] is not tokens:
            got = (tokens, self.chains.hashes(tokens, page_size, request.cache_salt))
            self._hashes[key] = got
            if len(self._hashes) > self._hash_cache:
                self._hashes.popitem(last=False)
        return got[1]

    def _candidates(self, workers: Sequence[WorkerView]) -> list[tuple[int, int, list[str]]]:
        """(page size, mask of the candidates' bits, their urls) groups, cached per worker set."""
        key = tuple(map(_url, workers))
        got = self._groups.get(key)
        if got is not None and got[0] == self._version:
            return got[1]
        groups: dict[int, tuple[int, list[str]]] = {}
        for w in workers:
            s = self._slots.get(w.url)
            if s is not None:
                ps = self.page_size_of(w)
                mask, urls = groups.get(ps, (0, []))
                groups[ps] = (mask | (7 << (3 * s)), urls + [w.url])
        if len(self._groups) > 256:
            self._groups.clear()
        self._groups[key] = (self._version, [(ps, m, u) for ps, (m, u) in groups.items()])
        return self._groups[key][1]

    def match(self, request: RequestView, workers: Sequence[WorkerView]) -> IndexMatch:
        result = IndexMatch(len(request.token_ids or ()), "tokens")
        if request.token_ids is None:
            return result
        if self._spec_queue and self._spec_queue[0][0] <= time.monotonic():
            self.expire(limit=4)  # a few per decision keeps pace with record() and bounds latency
        for ps, wanted, urls in self._candidates(workers):
            chain = self.hashes_for(request, ps)
            self._walk(chain, wanted, ps, result.hits)
            if self.pool:
                self._extend_through_pool(chain, ps, urls, result.hits)
        self._last_match = (request.request_id, result.hits)
        return result

    @staticmethod
    def _prefix_pages(masks: list[int], wanted: int) -> dict[int, int]:
        """Bit index -> number of leading pages whose mask has that bit (bits of ``wanted``)."""
        if not masks or not masks[0] & wanted:
            return {}
        masks[0] &= wanted
        acc = list(accumulate(masks, and_))
        n = len(acc)
        if not acc[-1]:  # bit sets only shrink, so the values fall: bisect for the first 0
            lo, n = 0, n - 1
            while lo < n:
                mid = (lo + n) // 2
                if acc[mid]:
                    lo = mid + 1
                else:
                    n = mid
        pages: dict[int, int] = dict.fromkeys(_bit_indexes(acc[n - 1]), n)
        stack = [(0, n - 1)]
        while stack:  # bisect for the few positions where the running AND loses bits
            lo, hi = stack.pop()
            if acc[lo] == acc[hi]:
                continue
            if hi - lo == 1:
                for b in _bit_indexes(acc[lo] & ~acc[hi]):
                    pages[b] = hi
                continue
            mid = (lo + hi) // 2
            stack.append((lo, mid))
            stack.append((mid, hi))
        return pages

    def _walk(self, chain: list[int], wanted: int, ps: int, hits: dict[str, Tiers]) -> None:
        masks = list(map(self.blocks.get, chain, repeat(0)))
        if self._spec:  # speculative pages count as GPU; OR them in, all in C
            spec = list(map(self._spec.get, chain, repeat(0)))
            if any(spec):
                masks = list(map(or_, masks, spec))
        pages = self._prefix_pages(masks, wanted)
        urls = self._urls
        for b, a in pages.items():
            if b % 3 == 2:  # the "any tier" bit: one entry per worker holding the prefix
                g, h = pages.get(b - 2, 0), pages.get(b - 1, 0)
                hits[urls[b // 3]] = Tiers(g * ps, (h - g) * ps, (a - h) * ps)

    def _extend_through_pool(self, chain: list[int], ps: int, urls: list[str], hits: dict[str, Tiers]) -> None:
        """Any worker can load the shared pool's leading pages past what it holds itself."""
        pooled = sum(1 for _ in takewhile(self.pool.__contains__, chain)) * ps
        if not pooled:
            return
        for url in urls:
            t = hits.get(url, NO_HIT)
            if pooled > t.total:
                hits[url] = Tiers(t.gpu, t.host, pooled - t.gpu - t.host)

    def record(self, request: RequestView, worker: WorkerView) -> None:
        if request.token_ids is None or self.speculative_ttl_s <= 0:
            return
        s = self.slot(worker.url)
        ps = self.page_size_of(worker)
        hashes = self.hashes_for(request, ps)
        last = self._last_match
        if last is not None and last[0] == request.request_id and worker.url in last[1]:
            # Pages the worker already holds on GPU (reported, or speculative) need no entry.
            hashes = hashes[last[1][worker.url].gpu // ps:]
        if not hashes:
            return
        until = time.monotonic() + self.speculative_ttl_s
        bits = 7 << (3 * s)
        spec = self._spec
        for h in hashes:
            spec[h] = spec.get(h, 0) | bits
        self._spec_until.setdefault(s, {}).update(zip(hashes, repeat(until)))
        self._spec_queue.append((until, s, hashes))

    def expire(self, now: float | None = None, limit: int | None = None) -> None:
        now = time.monotonic() if now is None else now
        q, spec = self._spec_queue, self._spec
        while q and q[0][0] <= now and limit != 0:
            limit = None if limit is None else limit - 1
            until, s, hashes = q.popleft()
            clear = ~(7 << (3 * s))
            spec_until = self._spec_until.get(s, {})
            for h in hashes:
                if spec_until.get(h) == until:  # not refreshed by a later request
                    del spec_until[h]
                    m = spec.get(h, 0) & clear
                    if m:
                        spec[h] = m
                    else:
                        spec.pop(h, None)

    def maintain(self, now: float | None = None) -> None:
        self.expire(now)

    def stats(self) -> Mapping[str, float]:
        return {
            "index_blocks": len(self.blocks),
            "index_pool_blocks": len(self.pool),
            "index_speculative_blocks": len(self._spec),
            "index_workers": len(self._slots),
            "index_orphan_blocks": self.orphans,
            "index_events_applied": self.events_applied,
            "index_worker_clears": self.clears,
        }
