"""Precise prefix index: the blocks each worker reported through SGLang KV events.

Every worker gets a slot; a block hash maps to one int whose bit ``3*slot + tier`` says the
worker holds that block in that tier (0 GPU, 1 host, 2 pool). A request's page-hash chain
(``wire.hashing.page_hashes`` with the worker's ``page_size`` and the request's
``cache_salt``) is walked until no candidate holds the next page; three running bitmasks
(GPU only, GPU or host, any tier) say at which page each worker drops out of each tier.
One dict lookup and a few int operations per page, however many workers there are.

Parent links are kept for each stored block so a worker's chains can be read back
(``chain``) and blocks whose parent the worker never reported are counted (``orphans``:
a sign of lost events).

Speculative entries cover the time between routing a request and the engine's
``BlockStored`` arriving: ``record`` marks the request's pages as on the worker's GPU for
``speculative_ttl_s`` seconds.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

from policies.base import RequestView, WorkerView
from policies.prefix_index import IndexMatch, Tiers, Unit
from wire.hashing import page_hashes
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event

TIER_OF_MEDIUM = {"GPU": 0, "CPU_PINNED": 1, "CPU": 1, "DISK": 2, "EXTERNAL": 2}


def medium_tier(medium: str | None) -> int:
    return TIER_OF_MEDIUM.get(medium.upper(), 0) if medium else 0


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield (low.bit_length() - 1) // 3
        mask ^= low


class BlockIndex:
    """``PrefixIndex`` over KV-event block hashes; lengths are in tokens."""

    unit: Unit = "tokens"

    def __init__(self, default_page_size: int = 1, speculative_ttl_s: float = 3.0,
                 hash_cache: int = 64) -> None:
        self.default_page_size = int(default_page_size)
        self.speculative_ttl_s = float(speculative_ttl_s)
        self.blocks: dict[int, int] = {}
        self.parent: dict[int, int | None] = {}
        self._slots: dict[str, int] = {}
        self._urls: list[str | None] = []
        self._owned: list[set[int]] = []
        self._free: list[int] = []
        self._page_size: dict[str, int] = {}
        self._spec: dict[int, int] = {}
        self._spec_until: dict[tuple[int, int], float] = {}
        self._spec_queue: deque[tuple[float, int, list[int]]] = deque()
        self._hashes: OrderedDict[tuple, tuple[list[int], list[int]]] = OrderedDict()
        self._hash_cache = hash_cache
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
                self._owned.append(set())
            self._slots[url] = s
        return s

    def set_page_size(self, url: str, page_size: int) -> None:
        self._page_size[url] = int(page_size)

    def page_size_of(self, worker: WorkerView) -> int:
        ps = self._page_size.get(worker.url)
        if ps is None:
            ps = int(worker.server_info.get("page_size") or self.default_page_size)
            self._page_size[worker.url] = ps
        return ps

    def remove_worker(self, url: str) -> None:
        if url in self._slots:
            self.clear_worker(url)
            s = self._slots.pop(url)
            self._urls[s] = None
            self._free.append(s)
        self._page_size.pop(url, None)

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
        self._owned[s] = set()
        bit = 1 << (3 * s)
        for _, slot, hashes in self._spec_queue:
            if slot == s:
                for h in hashes:
                    self._spec_until.pop((s, h), None)
                    m = self._spec.get(h, 0) & ~bit
                    if m:
                        self._spec[h] = m
                    else:
                        self._spec.pop(h, None)

    def worker_size(self, url: str) -> int:
        s = self._slots.get(url)
        return len(self._owned[s]) if s is not None else 0

    # -- events -------------------------------------------------------------------------
    def apply(self, url: str, event: Event) -> None:
        self.events_applied += 1
        if isinstance(event, BlockStored):
            self.store(url, event.block_hashes, event.parent_block_hash, medium_tier(event.medium))
        elif isinstance(event, BlockRemoved):
            self.remove(url, event.block_hashes, medium_tier(event.medium))
        elif isinstance(event, AllBlocksCleared):
            self.clear_worker(url)

    def store(self, url: str, hashes: Sequence[int], parent: int | None, tier: int = 0) -> None:
        s = self.slot(url)
        bit = 1 << (3 * s + tier)
        slot_mask = 7 << (3 * s)
        blocks, parents, owned = self.blocks, self.parent, self._owned[s]
        if parent is not None and not (blocks.get(parent, 0) & slot_mask):
            self.orphans += 1
        for h in hashes:
            blocks[h] = blocks.get(h, 0) | bit
            parents[h] = parent
            owned.add(h)
            parent = h

    def remove(self, url: str, hashes: Sequence[int], tier: int = 0) -> None:
        s = self._slots.get(url)
        if s is None:
            return
        clear = ~(1 << (3 * s + tier))
        slot_mask = 7 << (3 * s)
        blocks, owned = self.blocks, self._owned[s]
        for h in hashes:
            m = blocks.get(h)
            if m is None:
                continue
            m &= clear
            if m:
                blocks[h] = m
            else:
                del blocks[h]
                self.parent.pop(h, None)
            if not m & slot_mask:
                owned.discard(h)

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
            got = (tokens, page_hashes(tokens, page_size, request.cache_salt))
            self._hashes[key] = got
            if len(self._hashes) > self._hash_cache:
                self._hashes.popitem(last=False)
        return got[1]

    def match(self, request: RequestView, workers: Sequence[WorkerView]) -> IndexMatch:
        result = IndexMatch(len(request.token_ids or ()), "tokens")
        if request.token_ids is None:
            return result
        if self._spec_queue and self._spec_queue[0][0] <= time.monotonic():
            self.expire()
        groups: dict[int, int] = {}
        for w in workers:
            s = self._slots.get(w.url)
            if s is not None:
                ps = self.page_size_of(w)
                groups[ps] = groups.get(ps, 0) | (1 << (3 * s))
        for ps, wanted in groups.items():
            self._walk(self.hashes_for(request, ps), wanted, ps, result.hits)
        return result

    def _walk(self, chain: list[int], wanted: int, ps: int, hits: dict[str, Tiers]) -> None:
        blocks, spec = self.blocks, self._spec
        g = h = a = wanted
        gl: dict[int, int] = {}
        hl: dict[int, int] = {}
        al: dict[int, int] = {}
        depth = 0
        for depth, hsh in enumerate(chain):  # noqa: B007 (depth is used after the loop)
            m = blocks.get(hsh, 0) | spec.get(hsh, 0)
            m1 = m >> 1
            ng = g & m
            nh = h & (m | m1)
            na = a & (m | m1 | (m1 >> 1))
            if ng != g:
                for s in _bits(g ^ ng):
                    gl[s] = depth
                g = ng
            if nh != h:
                for s in _bits(h ^ nh):
                    hl[s] = depth
                h = nh
            if na != a:
                for s in _bits(a ^ na):
                    al[s] = depth
                a = na
                if not a:
                    break
        else:
            depth = len(chain)
            for s in _bits(g):
                gl[s] = depth
            for s in _bits(h):
                hl[s] = depth
            for s in _bits(a):
                al[s] = depth
        urls = self._urls
        for s, pages in al.items():
            if pages:
                gp, hp = gl[s], hl[s]
                hits[urls[s]] = Tiers(gp * ps, (hp - gp) * ps, (pages - hp) * ps)

    def record(self, request: RequestView, worker: WorkerView) -> None:
        if request.token_ids is None or self.speculative_ttl_s <= 0:
            return
        s = self.slot(worker.url)
        hashes = self.hashes_for(request, self.page_size_of(worker))
        if not hashes:
            return
        until = time.monotonic() + self.speculative_ttl_s
        bit = 1 << (3 * s)
        spec, spec_until = self._spec, self._spec_until
        for h in hashes:
            spec[h] = spec.get(h, 0) | bit
            spec_until[(s, h)] = until
        self._spec_queue.append((until, s, hashes))

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        q, spec, spec_until = self._spec_queue, self._spec, self._spec_until
        while q and q[0][0] <= now:
            until, s, hashes = q.popleft()
            clear = ~(1 << (3 * s))
            for h in hashes:
                if spec_until.get((s, h)) == until:  # not refreshed by a later request
                    del spec_until[(s, h)]
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
            "index_speculative_blocks": len(self._spec),
            "index_workers": len(self._slots),
            "index_orphan_blocks": self.orphans,
            "index_events_applied": self.events_applied,
            "index_worker_clears": self.clears,
        }
