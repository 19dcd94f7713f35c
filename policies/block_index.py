"""Precise prefix index: the blocks each worker reported through SGLang KV events.

Blocks are named by *page keys* (``policies.page_keys``): a chain of Python hashes of each
page's token tuple, seeded by the request's ``cache_salt``. SGLang names them by a SHA-256
chain (``wire.hashing``), ~1 us per page in Python, which made hashing the prompt the
largest part of a routing decision. ``BlockStored`` events carry every block's tokens and
parent, so the index computes each block's key when the event arrives (off the decision
path) and keeps ``block hash -> key`` for the events that name blocks by hash only
(``BlockRemoved``, tiers reporting a block again). A prompt is then matched by its page
keys, ~5x cheaper than its SHA chain, and no SHA-256 runs at decision time. Where a chain
starts (``parent_block_hash`` is None) the first page's SHA is checked against the event's
hash to learn which salt, if any, the engine hashed with, so salted and unsalted chains stay
apart exactly as their SHA chains do.

Blocks whose key cannot be derived (an event without token ids, a parent the index never
saw, a chain start hashed some other way) are kept under their block hash instead
(``index_hash_keyed_blocks``). While any exist the walk also computes the prompt's SHA chain
(memoised across turns, ``policies.page_hash_cache``) and ORs both lookups, so matches
stay exactly what a SHA-keyed index gives; the cost comes back only while such blocks do. A
block first seen without tokens moves to its page key when an event brings them.

Every worker gets a slot; a key maps to one int with three bits per slot, set when the
worker holds the block on GPU (bit ``3*slot``), on GPU or host (``3*slot+1``), in any tier
including the shared pool (``3*slot+2``). The prompt's keys are looked up with
``map(dict.get)`` and AND-accumulated (``itertools.accumulate``), both in C: bit
``3*slot+t`` of the running AND is set exactly while every page so far is in tier <= t on
that worker; it stops at the first page no candidate holds, so a prompt's new pages cost
no lookup. The few positions where the running AND changes (found by bisection) give every
worker's prefix length per tier. Each worker's own raw tier bits per block hash live in its
slot's dict (used for updates).

Every page up to there is still looked up (~0.2 us each in a 1M-entry dict, memory
latency): bisecting on the raw masks would be exact only if no worker ever held a block
without its parent, and lost events, out-of-order tier changes and expiring speculative
entries all make such holes. Proving their absence needs per-block child counts; not done.

Parent links (by block hash) are kept for each stored block so a worker's chains can be
read back (``chain``) and blocks whose parent the worker never reported are counted
(``orphans``: a sign of lost events).

The Mooncake pool (medium ``EXTERNAL``/``DISK``) is one store shared by every engine
attached to it, so by default (``shared_pool``) a page any engine announced there counts for
every worker: it is kept once, in ``pool``, and a worker's prefix extends through it
whatever that worker holds itself. Per-worker pool bits remain for fleets whose engines do
not share one pool (``shared_pool=False``).

Speculative entries cover the time between routing a request and the engine's
``BlockStored`` arriving: ``record`` marks the request's pages the worker was not already
known to hold as on its GPU for ``speculative_ttl_s`` seconds, by the page keys the walk
already computed; the walk ORs them in, from the first page where a recorded run starts.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate, chain as chained, compress, count, filterfalse, islice, repeat, takewhile
from operator import and_, attrgetter, or_

from policies.base import RequestView, WorkerView
from policies.page_hash_cache import PageHashCache
from policies.page_keys import page_keys, seed
from policies.prefix_index import IndexMatch, Tiers, Unit
from wire.hashing import page_hashes
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
    """``PrefixIndex`` over KV-event blocks, keyed by page keys; lengths are in tokens."""

    unit: Unit = "tokens"

    def __init__(self, default_page_size: int = 1, speculative_ttl_s: float = 3.0,
                 hash_cache: int = 64, shared_pool: bool = True) -> None:
        self.default_page_size = int(default_page_size)
        self.shared_pool = bool(shared_pool)
        self.pool: set[int] = set()  # keys of pages in the shared store (when shared_pool)
        self.speculative_ttl_s = float(speculative_ttl_s)
        self.blocks: dict[int, int] = {}  # key -> tier bits of every slot
        self.parent: dict[int, int | None] = {}  # block hash -> parent block hash
        self._key: dict[int, int] = {}  # block hash -> page key, for blocks learned with tokens
        self._by_hash: set[int] = set()  # block hashes that are their own key (no tokens known)
        self._slots: dict[str, int] = {}
        self._urls: list[str | None] = []
        self._owned: list[dict[int, int]] = []  # per slot: block hash -> raw tier bits
        self._keep: list[int] = []  # per slot: the mask that clears its bits
        self._cumulative: list[list[int]] = []  # per slot: _CUMULATIVE shifted into place
        self._free: list[int] = []
        self._page_size: dict[str, int] = {}
        self._spec: dict[int, int] = {}
        self._spec_until: dict[int, dict[int, float]] = {}  # slot -> page key -> expiry
        self._spec_queue: deque[tuple[float, int, list[int]]] = deque()
        self._spec_starts: dict[int, int] = {}  # first key of each queued record -> how many
        self._prompts: OrderedDict[tuple, list] = OrderedDict()  # -> [tokens, keys, SHA chain]
        self._hash_cache = hash_cache
        self.chains = PageHashCache()
        self._last_match: tuple[str, dict[str, Tiers]] | None = None
        self._version = 0  # bumps when slots or page sizes change
        self._groups: dict[tuple[str, ...], tuple[int, list[tuple[int, int, list[str], frozenset[str]]]]] = {}
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
                self._keep.append(~(7 << 3 * s))
                self._cumulative.append([c << 3 * s for c in _CUMULATIVE])
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
        blocks, key_of = self.blocks, self._key
        for h in self._owned[s]:
            k = key_of.get(h, h)
            m = blocks.get(k, 0) & keep
            if m:
                blocks[k] = m
            else:
                blocks.pop(k, None)
                self._drop(h, k)
        self._owned[s] = {}
        for k in self._spec_until.pop(s, {}):
            m = self._spec.get(k, 0) & keep
            if m:
                self._spec[k] = m
            else:
                self._spec.pop(k, None)

    def worker_size(self, url: str) -> int:
        s = self._slots.get(url)
        return len(self._owned[s]) if s is not None else 0

    # -- keys ---------------------------------------------------------------------------
    def key_of(self, block_hash: int) -> int:
        """The key a reported block is indexed by (its block hash when no tokens were seen)."""
        return self._key.get(block_hash, block_hash)

    def _chain_start(self, block_hash: int, first_page: list[int], cache_salt: str | None) -> int | None:
        """The key before a chain's first block: the seed of whichever salt the engine hashed
        the page with (checked against its hash), or None when neither fits."""
        try:
            for salt in ((cache_salt, None) if cache_salt else (None,)):
                if page_hashes(first_page, len(first_page), salt)[0] == block_hash:
                    return seed(salt)
        except (OverflowError, TypeError):  # ids SGLang could not have hashed: keep it by hash
            pass
        return None

    def _learn(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int] | None,
               page_size: int, cache_salt: str | None) -> list[int]:
        """Keys for the blocks of one ``BlockStored``, remembering those derived from tokens."""
        key_of = self._key
        if len(hashes) == 1:  # SGLang sends one page per event: keep that path short
            h = hashes[0]
            k = key_of.get(h)
            if k is not None:
                return [k]
            if token_ids and len(token_ids) >= page_size:
                if parent is None:
                    start = self._chain_start(h, list(token_ids[:page_size]), cache_salt)
                else:
                    start = key_of.get(parent)
                if start is not None:
                    page = tuple(token_ids if len(token_ids) == page_size else token_ids[:page_size])
                    k = hash((start, page))  # page_keys' step, inlined
                    if self._by_hash:
                        self._rekey(hashes, [k])
                    key_of[h] = k
                    return [k]
            self._by_hash.add(h)
            return [h]
        if token_ids and hashes and len(token_ids) >= len(hashes) * page_size:
            if parent is None:
                start = self._chain_start(hashes[0], list(token_ids[:page_size]), cache_salt)
            else:
                start = key_of.get(parent)
            if start is not None:
                keys = page_keys(token_ids[: len(hashes) * page_size], page_size, start)
                if self._by_hash:
                    self._rekey(hashes, keys)
                return [key_of.setdefault(h, k) for h, k in zip(hashes, keys)]
        out = []
        by_hash = self._by_hash
        for h in hashes:
            k = key_of.get(h)
            if k is None:
                k = h
                by_hash.add(h)
            out.append(k)
        return out

    def _rekey(self, hashes: Sequence[int], keys: Sequence[int]) -> None:
        """Move blocks first reported without tokens to the keys their tokens give."""
        blocks, pool, by_hash = self.blocks, self.pool, self._by_hash
        for h, k in zip(hashes, keys):
            if h in by_hash and h not in self._key:
                by_hash.discard(h)
                m = blocks.pop(h, 0)
                if m:
                    blocks[k] = blocks.get(k, 0) | m
                if h in pool:
                    pool.discard(h)
                    pool.add(k)

    def _drop(self, h: int, k: int) -> None:
        """Forget block hash ``h`` once no worker holds it and the pool does not either."""
        self.parent.pop(h, None)
        if k not in self.pool:
            self._key.pop(h, None)
            self._by_hash.discard(h)

    # -- events -------------------------------------------------------------------------
    def apply_batch(self, url: str, events: Sequence[Event | BlockStoredRef]) -> None:
        """A decoded batch, with the per-event work kept to a dict lookup for the medium."""
        stored, removed, tiers = (BlockStored, BlockStoredRef), BlockRemoved, TIER_OF_MEDIUM
        for event in events:
            if isinstance(event, stored):
                tier = tiers.get(event.medium or "GPU")
                self.store(url, event.block_hashes, event.parent_block_hash,
                           medium_tier(event.medium) if tier is None else tier, event.block_size,
                           getattr(event, "token_ids", None), event.cache_salt)
            elif isinstance(event, removed):
                tier = tiers.get(event.medium or "GPU")
                self.remove(url, event.block_hashes, medium_tier(event.medium) if tier is None else tier)
            elif isinstance(event, AllBlocksCleared):
                self.clear_worker(url)
        self.events_applied += len(events)

    def apply(self, url: str, event: Event | BlockStoredRef) -> None:
        self.apply_batch(url, [event])

    def store(self, url: str, hashes: Sequence[int], parent: int | None, tier: int = 0,
              block_size: int | None = None, token_ids: Sequence[int] | None = None,
              cache_salt: str | None = None) -> None:
        if block_size and self._page_size.get(url) != block_size:  # the engine's own word
            self.set_page_size(url, block_size)
        keys = self._learn(hashes, parent, token_ids,
                           block_size or self._page_size.get(url, self.default_page_size), cache_salt)
        s = self._slots.get(url)
        if s is None:
            s = self.slot(url)
        if tier == 2 and self.shared_pool:
            self.pool.update(keys)
            return
        keep, cumulative = self._keep[s], self._cumulative[s]
        blocks, parents, owned = self.blocks, self.parent, self._owned[s]
        if parent is not None and parent not in owned:
            self.orphans += 1
        bit = 1 << tier
        for h, k in zip(hashes, keys):
            raw = owned.get(h, 0) | bit
            owned[h] = raw
            blocks[k] = (blocks.get(k, 0) & keep) | cumulative[raw]
            parents[h] = parent
            parent = h

    def remove(self, url: str, hashes: Sequence[int], tier: int = 0) -> None:
        key_of = self._key
        if tier == 2 and self.shared_pool:  # the store evicted it: gone for everyone
            for h in hashes:
                k = key_of.get(h, h)
                self.pool.discard(k)
                if k not in self.blocks:
                    self._drop(h, k)
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
            k = key_of.get(h, h)
            m = (blocks.get(k, 0) & keep) | (_CUMULATIVE[raw] << shift)
            if raw:
                owned[h] = raw
            else:
                del owned[h]
            if m:
                blocks[k] = m
            else:
                blocks.pop(k, None)
                self._drop(h, k)

    def chain(self, h: int, limit: int = 1 << 20) -> list[int]:
        """The stored chain ending at block hash ``h``, root first."""
        out: list[int] = []
        cur: int | None = h
        while cur is not None and cur in self.parent and len(out) < limit:
            out.append(cur)
            cur = self.parent[cur]
        return out[::-1]

    # -- requests -----------------------------------------------------------------------
    def usable(self, request: RequestView) -> bool:
        return request.token_ids is not None

    def _prompt(self, request: RequestView, page_size: int) -> list:
        """[tokens, page keys, SHA chain or None] of the request, cached briefly: select and
        record both need them."""
        tokens = request.token_ids or []
        key = (request.request_id, page_size, request.cache_salt)
        got = self._prompts.get(key)
        # The cache holds the token list itself, so identity cannot be a recycled id().
        if got is None or got[0] is not tokens:
            got = [tokens, page_keys(tokens, page_size, seed(request.cache_salt)), None]
            self._prompts[key] = got
            if len(self._prompts) > self._hash_cache:
                self._prompts.popitem(last=False)
        return got

    def keys_for(self, request: RequestView, page_size: int) -> list[int]:
        """The request's page keys (see ``policies.page_keys``)."""
        return self._prompt(request, page_size)[1]

    def hashes_for(self, request: RequestView, page_size: int) -> list[int]:
        """The request's SHA page chain, needed only while blocks are keyed by hash."""
        got = self._prompt(request, page_size)
        if got[2] is None:
            got[2] = self.chains.hashes(got[0], page_size, request.cache_salt)
        return got[2]

    def _candidates(self, workers: Sequence[WorkerView]) -> list[tuple[int, int, list[str], frozenset[str]]]:
        """(page size, mask of the candidates' bits, their urls as a list and a set) groups,
        cached per worker set."""
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
        self._groups[key] = (self._version, [(ps, m, u, frozenset(u)) for ps, (m, u) in groups.items()])
        return self._groups[key][1]

    def match(self, request: RequestView, workers: Sequence[WorkerView]) -> IndexMatch:
        result = IndexMatch(len(request.token_ids or ()), "tokens")
        if request.token_ids is None:
            return result
        if self._spec_queue and self._spec_queue[0][0] <= time.monotonic():
            self.expire(limit=4)  # a few per decision keeps pace with record() and bounds latency
        for ps, wanted, urls, members in self._candidates(workers):
            keys = self.keys_for(request, ps)
            hashes = self.hashes_for(request, ps) if self._by_hash else None
            self._walk(keys, hashes, wanted, ps, result.hits)
            if self.pool:
                self._extend_through_pool(keys, hashes, ps, urls, members, result.hits)
        self._last_match = (request.request_id, result.hits)
        return result

    @staticmethod
    def _prefix_pages(masks: Iterable[int], wanted: int) -> dict[int, int]:
        """Bit index -> number of leading pages whose mask has that bit (bits of ``wanted``).
        The running AND stops at the first page no candidate holds, so lookups past it
        (a prompt's new pages, a miss) are never made."""
        acc = list(takewhile(bool, accumulate(masks, and_, initial=wanted)))[1:]
        if not acc:
            return {}
        n = len(acc)
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

    def _walk(self, keys: list[int], hashes: list[int] | None, wanted: int, ps: int,
              hits: dict[str, Tiers]) -> None:
        get = self.blocks.get
        masks = map(get, keys, repeat(0))
        if hashes is not None:  # some blocks are known by hash only: look those up too
            masks = map(or_, masks, map(get, hashes, repeat(0)))
        if self._spec:  # speculative pages count as GPU; OR them in, all in C
            # They come in runs recorded from some prompt's page on, and a key names its whole
            # prefix, so a run that reaches this chain starts on it: no page before the first
            # run start found here (in a small dict) needs a look in the large one.
            first = next(compress(count(), map(self._spec_starts.__contains__, keys)), None)
            if first is not None:
                spec = map(self._spec.get, islice(keys, first, None), repeat(0))
                masks = map(or_, masks, chained(repeat(0, first), spec))
        pages = self._prefix_pages(masks, wanted)
        urls = self._urls
        for b, a in pages.items():
            if b % 3 == 2:  # the "any tier" bit: one entry per worker holding the prefix
                g, h = pages.get(b - 2, 0), pages.get(b - 1, 0)
                hits[urls[b // 3]] = Tiers(g * ps, (h - g) * ps, (a - h) * ps)

    def _extend_through_pool(self, keys: list[int], hashes: list[int] | None, ps: int,
                             urls: list[str], members: frozenset[str], hits: dict[str, Tiers]) -> None:
        """Any worker can load the shared pool's leading pages past what it holds itself."""
        pooled_ = self.pool.__contains__
        held = map(pooled_, keys) if hashes is None else map(or_, map(pooled_, keys), map(pooled_, hashes))
        pooled = len(list(takewhile(bool, held))) * ps
        if not pooled:
            return
        for url, t in list(hits.items()):  # the few workers holding some of it themselves
            if pooled > t.total and url in members:
                hits[url] = Tiers(t.gpu, t.host, pooled - t.gpu - t.host)
        # Every other candidate, in C and sharing one tuple: with a pooled prompt that is
        # the whole fleet.
        hits.update(zip(filterfalse(hits.__contains__, urls), repeat(Tiers(0, 0, pooled))))

    def record(self, request: RequestView, worker: WorkerView) -> None:
        if request.token_ids is None or self.speculative_ttl_s <= 0:
            return
        s = self.slot(worker.url)
        ps = self.page_size_of(worker)
        keys = self.keys_for(request, ps)
        last = self._last_match
        if last is not None and last[0] == request.request_id and worker.url in last[1]:
            # Pages the worker already holds on GPU (reported, or speculative) need no entry.
            keys = keys[last[1][worker.url].gpu // ps:]
        if not keys:
            return
        until = time.monotonic() + self.speculative_ttl_s
        bits = 7 << (3 * s)
        spec = self._spec
        spec.update(zip(keys, map(or_, map(spec.get, keys, repeat(0)), repeat(bits))))  # in C
        self._spec_until.setdefault(s, {}).update(zip(keys, repeat(until)))
        self._spec_queue.append((until, s, keys))
        self._spec_starts[keys[0]] = self._spec_starts.get(keys[0], 0) + 1

    def expire(self, now: float | None = None, limit: int | None = None) -> None:
        now = time.monotonic() if now is None else now
        q, spec = self._spec_queue, self._spec
        while q and q[0][0] <= now and limit != 0:
            limit = None if limit is None else limit - 1
            until, s, keys = q.popleft()
            left = self._spec_starts.pop(keys[0], 1) - 1
            if left:
                self._spec_starts[keys[0]] = left
            clear = ~(7 << (3 * s))
            spec_until = self._spec_until.get(s, {})
            for k in keys:
                if spec_until.get(k) == until:  # not refreshed by a later request
                    del spec_until[k]
                    m = spec.get(k, 0) & clear
                    if m:
                        spec[k] = m
                    else:
                        spec.pop(k, None)

    def maintain(self, now: float | None = None) -> None:
        self.expire(now)

    def stats(self) -> Mapping[str, float]:
        return {
            "index_blocks": len(self.blocks),
            "index_pool_blocks": len(self.pool),
            "index_hash_keyed_blocks": len(self._by_hash),
            "index_speculative_blocks": len(self._spec),
            "index_workers": len(self._slots),
            "index_orphan_blocks": self.orphans,
            "index_events_applied": self.events_applied,
            "index_worker_clears": self.clears,
        }
