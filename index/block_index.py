"""Precise prefix index: the blocks each worker reported through SGLang KV events.

``BlockIndex`` applies the events and matches prompts, composing the parts that keep the
state: ``worker_slots`` (whose bits are whose), ``block_places`` (each block's page in the
trie, holders, shared-pool flags), ``hash_keyed`` (blocks without a place and the SHA-chain
match), ``speculative`` (routed requests' pages until their events come), ``block_budget``
(LRU eviction past ``max_blocks``), and ``block_masks`` (the mask reads of a match, in C).
A prompt is matched by packing its ids once and walking the trie; no SHA at decision time
while every block has its place.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from itertools import filterfalse, repeat

from index.block_budget import BlockBudget
from index.block_masks import _held_on_path, _pooled_on_path, medium_tier
from index.block_places import BlockPlaces
from index.hash_keyed import HashKeyed
from index.page_trie import Path, Run, walk
from index.prefix import IndexMatch, Tiers, Unit
from index.speculative import Speculative
from index.views import RequestView, WorkerView
from index.worker_slots import WorkerSlots
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, BlockStoredRef, Event


class BlockIndex:
    """``PrefixIndex`` over KV-event blocks, placed in a page trie; lengths are in tokens."""

    unit: Unit = "tokens"

    def __init__(self, default_page_size: int = 1, speculative_ttl_s: float = 3.0,
                 shared_pool: bool = True, max_blocks: int = 0) -> None:
        max_blocks = max(int(max_blocks), 0)  # 0: no budget
        lru: OrderedDict[Run, None] | None = OrderedDict() if max_blocks else None
        self._workers = WorkerSlots(default_page_size)
        self._keyed = HashKeyed()
        self._places = BlockPlaces(self._workers, self._keyed, lru, shared_pool)
        self._spec = Speculative(speculative_ttl_s, self._places.roots, lru, self._places.root)
        self._budget = BlockBudget(max_blocks, lru, self._places, self._workers, self._keyed, self._spec)
        # The parts' containers under the names the hot paths and tests read (never rebound).
        self._slots, self._urls, self._page_size = self._workers.by_url, self._workers.urls, self._workers.page_sizes
        self._roots, self._where, self._holders = self._places.roots, self._places.where, self._places.holders
        self.pool = self._places.pool
        self._hashed, self._by_hash, self.chains = self._keyed.hashed, self._keyed.by_hash, self._keyed.chains
        self._spec_runs, self._spec_queue, self._lru = self._spec.runs, self._spec.queue, lru
        self._last_match: tuple[str, IndexMatch] | None = None
        self._recorded: OrderedDict[str, tuple] = OrderedDict()  # request id -> its last record, for retract
        self._last_walk: tuple | None = None  # (request id, page size, epoch, walk result)
        self._epoch = 0  # bumps on every change, so a cached walk is known to be current
        self.events_applied = 0
        self.clears = 0

    # Settings and counters kept by the parts.
    default_page_size = property(lambda self: self._workers.default_page_size,
                                 lambda self, ps: setattr(self._workers, "default_page_size", int(ps)))
    shared_pool = property(lambda self: self._places.shared_pool,
                           lambda self, on: setattr(self._places, "shared_pool", bool(on)))
    speculative_ttl_s = property(lambda self: self._spec.ttl_s,
                                 lambda self, ttl_s: setattr(self._spec, "ttl_s", float(ttl_s)))
    max_blocks = property(lambda self: self._budget.max_blocks)
    evicted = property(lambda self: self._budget.evicted)
    dropped = property(lambda self: self._budget.dropped)

    @property
    def forgotten(self) -> int:
        """How often the index let go of pages an engine may still hold: its budget evicted
        or dropped them, or a worker was cleared (a lost gap, a reconnect, AllBlocksCleared).
        While it stands still, every page the engines reported is known here."""
        return self._budget.evicted + self._budget.dropped + self.clears
    orphans = property(lambda self: self._places.orphans)

    # -- workers ------------------------------------------------------------------------
    def slot(self, url: str) -> int:
        return self._workers.slot(url)

    def set_page_size(self, url: str, page_size: int) -> None:
        self._workers.set_page_size(url, page_size)

    def page_size_of(self, worker: WorkerView) -> int:
        return self._workers.page_size_of(worker)

    def worker_size(self, url: str) -> int:
        return self._workers.worker_size(url)

    def remove_worker(self, url: str) -> None:
        if url in self._slots:
            self.clear_worker(url)
        self._workers.remove(url)

    def clear_worker(self, url: str) -> None:
        """Forget every block of ``url``: after AllBlocksCleared, a reconnect or a lost gap."""
        s = self._slots.get(url)
        if s is None:
            return
        self.clears += 1
        self._epoch += 1
        self._places.clear_slot(s)
        self._spec.clear_slot(s, self._workers.keep[s])

    # -- events -------------------------------------------------------------------------
    def apply_batch(self, url: str, events: Sequence[Event | BlockStoredRef]) -> None:
        """A decoded batch, with the per-event work kept to a dict lookup for the medium.

        SGLang sends one page per ``BlockStored``, and the pages one scheduler step stored
        arrive together, each the child of the one before: such a run of events is applied
        as one store, so a new chain is appended to the trie whole instead of page by page.
        Consecutive removals in one medium are applied as one too (an eviction's pages)."""
        stored, removed = (BlockStored, BlockStoredRef), BlockRemoved
        i, n = 0, len(events)
        while i < n:
            event = events[i]
            i += 1
            if isinstance(event, stored):
                hashes, tokens = event.block_hashes, getattr(event, "token_ids", None)
                kind, size, same = type(event), event.block_size, (event.medium, event.cache_salt, event.lora_id)
                # Joined only while every event's tokens are whole pages (or none has tokens).
                whole = tokens is None or (len(tokens) == len(hashes) * size and hashes)
                while whole and i < n:
                    nxt = events[i]
                    if (type(nxt) is not kind or nxt.parent_block_hash != hashes[-1]
                            or nxt.block_size != size or (nxt.medium, nxt.cache_salt, nxt.lora_id) != same):
                        break
                    if tokens is not None and len(nxt.token_ids) != len(nxt.block_hashes) * size:
                        break
                    if hashes is event.block_hashes:
                        hashes, tokens = list(hashes), (list(tokens) if tokens is not None else None)
                    hashes += nxt.block_hashes
                    if tokens is not None:
                        tokens += nxt.token_ids
                    i += 1
                self.store(url, hashes, event.parent_block_hash, medium_tier(event.medium), event.block_size,
                           tokens, event.cache_salt)
            elif isinstance(event, removed):
                hashes = event.block_hashes
                while i < n and type(events[i]) is BlockRemoved and events[i].medium == event.medium:
                    if hashes is event.block_hashes:
                        hashes = list(hashes)
                    hashes += events[i].block_hashes  # type: ignore[union-attr]
                    i += 1
                self.remove(url, hashes, medium_tier(event.medium))
            elif isinstance(event, AllBlocksCleared):
                self.clear_worker(url)
        self.events_applied += len(events)

    def apply(self, url: str, event: Event | BlockStoredRef) -> None:
        self.apply_batch(url, [event])

    def store(self, url: str, hashes: Sequence[int], parent: int | None, tier: int = 0,
              block_size: int | None = None, token_ids: Sequence[int] | None = None,
              cache_salt: str | None = None) -> None:
        if block_size and self._page_size.get(url) != block_size:  # the engine's own word
            self._workers.set_page_size(url, block_size)
        self._epoch += 1
        budget = self._budget
        if parent is not None and budget.evicted and budget.drop_orphan(parent, hashes, token_ids):
            return
        self._places.store(url, hashes, parent, tier,
                           block_size or self._page_size.get(url, self._workers.default_page_size),
                           token_ids, cache_salt)
        if budget.fit():
            self._epoch += 1

    def remove(self, url: str, hashes: Sequence[int], tier: int = 0) -> None:
        self._epoch += 1
        self._places.remove(url, hashes, tier)

    def known_blocks(self) -> int:
        """What ``max_blocks`` bounds: blocks placed in the trie or kept by hash."""
        return self._budget.known_blocks()

    # -- requests -----------------------------------------------------------------------
    def usable(self, request: RequestView) -> bool:
        return request.token_ids is not None

    def hashes_for(self, request: RequestView, page_size: int) -> list[int]:
        """The request's SHA page chain, needed only while blocks are keyed by hash."""
        return self._keyed.hashes_for(request, page_size)

    def _walk(self, request: RequestView, page_size: int) -> tuple[bytes, Path, Run | None, int]:
        """The request's packed ids and its path in the trie (cached until the index changes)."""
        packed = self._keyed.prompt(request)[1]
        last = self._last_walk
        if (last is not None and last[0] == request.request_id and last[1] == page_size
                and last[2] == self._epoch and last[3][0] is packed):
            return last[3]
        root = self._roots.get((page_size, request.cache_salt or None))
        if packed is None or root is None:
            got: tuple[bytes, Path, Run | None, int] = (packed or b"", [], root, 0)
        else:
            got = (packed, *walk(root, packed))
            if got[1]:
                self._budget.touch(got[1][-1][0])
        self._last_walk = (request.request_id, page_size, self._epoch, got)
        return got

    def match(self, request: RequestView, workers: Sequence[WorkerView]) -> IndexMatch:
        result = IndexMatch(len(request.token_ids or ()), "tokens")
        if request.token_ids is None:
            return result
        if self._spec_queue and self._spec_queue[0][0] <= time.monotonic():
            self.expire(limit=4)  # a few per decision keeps pace with record() and bounds latency
        for ps, wanted, urls, members, known in self._workers.candidates(workers):
            _, path, _, _ = self._walk(request, ps)
            floor = 0
            if self._by_hash:  # some blocks are known by hash only: page by page, with their SHA chain
                pages, pooled = self._keyed.held(request, ps, path, wanted, self.pool)
            elif path:
                (pages, floor), pooled = _held_on_path(path, wanted), _pooled_on_path(path)
            else:
                continue
            hits = result.hits
            for b, a in pages.items():
                if b % 3 == 2:  # the "any tier" bit: one entry per worker holding more than the floor
                    g, h = pages.get(b - 2, floor), pages.get(b - 1, floor)
                    hits[self._urls[b // 3]] = Tiers(g * ps, (h - g) * ps, (a - h) * ps)
            if floor and not known:  # workers the index never heard of hold nothing: list the others
                at_floor = Tiers(floor * ps, 0, 0)
                hits.update((u, at_floor) for u in urls if u not in hits and u in self._slots)
                floor = 0
            if floor or pooled:
                self._extend_to_all(floor * ps, pooled * ps, urls, members, result, len(workers))
        self._last_match = (request.request_id, result)
        return result

    @staticmethod
    def _extend_to_all(held: int, pooled: int, urls: list[str], members: frozenset[str], result: IndexMatch,
                       candidates: int) -> None:
        """What every worker of the group reuses: the leading tokens all of them hold on GPU
        (``held``), then the shared pool's leading tokens past what each holds itself."""
        hits = result.hits
        if pooled > held:
            for url, t in list(hits.items()):  # the few workers holding more themselves
                if pooled > t.total and url in members:
                    hits[url] = Tiers(t.gpu, t.host, pooled - t.gpu - t.host)
        base = Tiers(held, 0, max(pooled - held, 0))
        if len(urls) == candidates:  # every candidate is in this group: one entry says it
            result.everyone = base
        else:  # page sizes differ: only this group's
            hits.update(zip(filterfalse(hits.__contains__, urls), repeat(base)))

    # -- speculative entries ------------------------------------------------------------
    def record(self, request: RequestView, worker: WorkerView) -> None:
        """Mark the request's pages ``worker`` is not known to hold as on its GPU for
        ``speculative_ttl_s``, adding the pages to the trie if they are new."""
        if request.token_ids is None or self._spec.ttl_s <= 0:
            return
        s = self._workers.slot(worker.url)
        ps = self._workers.page_size_of(worker)
        walked = self._walk(request, ps)
        last = self._last_match
        skip = 0
        if last is not None and last[0] == request.request_id:
            # Pages the worker already holds on GPU (reported, or speculative) need no entry.
            skip = last[1].get(worker.url).gpu // ps
        entry = self._spec.record(s, walked, ps, request.cache_salt or None, skip)
        if entry is not None:
            self._epoch += 1
            self._recorded[request.request_id] = entry
            if len(self._recorded) > 4096:  # a retract follows its record within milliseconds
                self._recorded.popitem(last=False)

    def retract(self, request: RequestView, worker: WorkerView) -> None:
        """Undo the request's last ``record`` on ``worker`` (it went elsewhere after all)."""
        entry = self._recorded.get(request.request_id)
        if entry is not None and self._slots.get(worker.url) == entry[1]:
            del self._recorded[request.request_id]
            self._spec.retract(entry)
            self._epoch += 1

    def expire(self, now: float | None = None, limit: int | None = None) -> None:
        self._epoch += self._spec.expire(now, limit)

    def maintain(self, now: float | None = None) -> None:
        self.expire(now)

    def speculative_pages(self) -> int:
        """Pages carrying some worker's speculative bits (counted, for stats and tests)."""
        return self._spec.pages()

    def stats(self) -> Mapping[str, float]:
        return {
            "index_blocks": len(self._holders),
            "index_pool_blocks": len(self.pool),
            "index_hash_keyed_blocks": len(self._by_hash),
            "index_speculative_blocks": self.speculative_pages(),
            "index_workers": len(self._slots),
            "index_orphan_blocks": self.orphans,
            "index_events_applied": self.events_applied,
            "index_worker_clears": self.clears,
            "index_known_blocks": self.known_blocks(),
            "index_max_blocks": self.max_blocks,
            "index_evicted_blocks": self.evicted,
            "index_dropped_blocks": self.dropped,
        }
