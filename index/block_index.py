"""Precise prefix index: the blocks each worker reported through SGLang KV events.

Pages live in a trie of page runs keyed by their tokens (``index.page_trie``).
``BlockStored`` events carry each block's tokens and parent, so each block gets its place
in the trie when its event arrives, and ``block hash -> (run, offset)`` serves the events
that name blocks by hash only (``BlockRemoved``, tiers reporting a block again). A prompt is
matched by packing its ids once and comparing them with the runs in C: no hash of the
prompt and no per-page lookup at decision time. (SGLang names pages by a SHA-256 chain,
``wire.hashing``, ~1 us per page in Python; a chain of Python hashes per page plus a lookup
per page in a dict of a million entries was the previous design, ~95 us per 2,600-token
prompt on a 1M-block fleet against ~35 us now, 15 of them packing the ids.) Where a chain
starts (``parent_block_hash`` is None) the first page's SHA is checked against the event's
hash to learn which salt, if any, the engine hashed with, and each (page size, salt) has its
own root, so salted and unsalted chains stay apart exactly as their SHA chains do.

Blocks that cannot be placed (an event without token ids, a parent the index never saw, a
chain start hashed some other way) are kept by block hash instead
(``index_hash_keyed_blocks``). While any exist the walk also computes the prompt's SHA chain
(memoised across turns, ``index.page_hash_cache``) and ORs both, page by page, so matches
stay exactly what a SHA-keyed index gives; the cost comes back only while such blocks do. A
block first seen without tokens moves to its place when an event brings them.

Every worker gets a slot; a page's mask is one int with three bits per slot, set when the
worker holds the block on GPU (bit ``3*slot``), on GPU or host (``3*slot+1``), in any tier
including the shared pool (``3*slot+2``). Along the prompt's path the masks are
AND-accumulated: bit ``3*slot+t`` of the running AND is set exactly while every page so far
is in tier <= t on that worker, so the positions where it loses bits give every worker's
prefix length per tier. A run whose matched pages all carry one mask (the usual case: a
conversation's pages are stored and evicted together) costs one AND; others are accumulated
in C and bisected for the few positions where bits drop. The pages every candidate holds on
GPU (up to the first bit that drops: a system prompt on the whole fleet) are one number,
``IndexMatch.everyone``, and only workers holding more are listed: listing all 64 cost ~75
us of a match through such a prefix. A page held out of order (a hole from a lost event, an
expiring speculative entry) ends the prefix there, as it would in the engine. Each worker's
own raw tier bits per block hash live in its slot's dict (used for updates), and how many
workers hold each hash decides when a block is forgotten.

Blocks whose parent the worker never reported are counted (``orphans``: a sign of lost
events). Parent links themselves are not kept: the trie's runs are the chains, and a dict
entry per block was ~20% of the index's memory with nothing reading it.

The Mooncake pool (medium ``EXTERNAL``/``DISK``) is one store shared by every engine
attached to it, so by default (``shared_pool``) a page any engine announced there counts for
every worker: it is flagged once on its page, and a worker's prefix extends through the
pool's leading pages whatever that worker holds itself. Per-worker pool bits remain for
fleets whose engines do not share one pool (``shared_pool=False``).

A memory budget (``max_blocks``; policy option ``max_index_blocks``) bounds the blocks known.
The index then keeps its runs in least recently used order (the run a prompt's path ends in,
and a store's deepest page, become the newest) and, past the budget, forgets the oldest run's
pages past its last branch, deepest first and only as many as it must: a conversation's own
pages, as SGLang's radix cache evicts its least recently used leaves, while a prefix shared
by several stays as long as any branch under it is used. Forgetting is for every worker at
once (the pages leave the trie), and once the index has forgotten anything, chains reported
under a parent it does not know are dropped rather than kept by hash (``_drop_orphan``).

Speculative entries cover the time between routing a request and the engine's
``BlockStored`` arriving: ``record`` marks the request's pages the worker was not already
known to hold as on its GPU for ``speculative_ttl_s`` seconds, adding the pages to the trie
if they are new (one append or one new run); expiry clears them and trims what no block
names.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from itertools import chain as chained, filterfalse, repeat, takewhile
from operator import and_, attrgetter, or_

from index.block_masks import (
    _CUMULATIVE, _bit_indexes, _combine, _held_on_path, _held_pages, _name, _path_masks, _pooled_on_path, _set_mask,
    medium_tier,
)
from index.views import RequestView, WorkerView
from index.page_hash_cache import PageHashCache
from index.page_trie import Path, Run, detach, grow, step, trim, walk
from index.prefix import IndexMatch, Tiers, Unit
from wire.hashing import page_hashes, uint32_le
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, BlockStoredRef, Event

log = logging.getLogger("kvgate.policies.kv_events")

_url = attrgetter("url")
Place = tuple[Run, int]


class BlockIndex:
    """``PrefixIndex`` over KV-event blocks, placed in a page trie; lengths are in tokens."""

    unit: Unit = "tokens"

    def __init__(self, default_page_size: int = 1, speculative_ttl_s: float = 3.0,
                 shared_pool: bool = True, max_blocks: int = 0) -> None:
        self.default_page_size = int(default_page_size)
        self.max_blocks = max(int(max_blocks), 0)  # 0: no budget
        # Runs least recently matched or stored first, when there is a budget to keep.
        self._lru: OrderedDict[Run, None] | None = OrderedDict() if self.max_blocks else None
        self.evicted = 0
        self.dropped = 0
        self.shared_pool = bool(shared_pool)
        self.pool: set[int] = set()  # block hashes in the shared store (when shared_pool)
        self.speculative_ttl_s = float(speculative_ttl_s)
        self._roots: dict[tuple[int, str | None], Run] = {}  # (page size, salt) -> trie root
        self._where: dict[int, Place] = {}  # block hash -> its page in the trie
        self._holders: dict[int, int] = {}  # block hash -> how many workers hold it
        self._hashed: dict[int, int] = {}  # block hash -> tier bits, for blocks with no place
        self._by_hash: set[int] = set()  # block hashes held (or pooled) with no place
        self._slots: dict[str, int] = {}
        self._urls: list[str | None] = []
        self._owned: list[dict[int, int]] = []  # per slot: block hash -> raw tier bits
        self._keep: list[int] = []  # per slot: the mask that clears its bits
        self._cumulative: list[list[int]] = []  # per slot: _CUMULATIVE shifted into place
        self._free: list[int] = []
        self._page_size: dict[str, int] = {}
        self._spec_runs: dict[int, set[Run]] = {}  # slot -> runs holding its speculative bits
        self._dirty: set[Run] = set()  # runs with pages no hash names any more, to trim
        self._spec_queue: deque[tuple[float, int, list[tuple[Run, int, int]]]] = deque()
        self._last_prompt: list = [None, None, {}, None]  # [tokens, packed, SHA chains, salt]
        self.chains = PageHashCache()
        self._last_match: tuple[str, IndexMatch] | None = None
        self._last_walk: tuple | None = None  # (request id, page size, epoch, walk result)
        self._epoch = 0  # bumps on every change, so a cached walk is known to be current
        self._version = 0  # bumps when slots or page sizes change
        self._groups: dict[tuple[str, ...], tuple[int, list[tuple[int, int, list[str], frozenset[str]]]]] = {}
        self._last_candidates: tuple[int, list[WorkerView], list] = (-1, [], [])
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
        self._epoch += 1
        keep = self._keep[s]
        owned, self._owned[s] = self._owned[s], {}
        for h in owned:
            self._set_bits(h, keep, 0)
            self._unhold(h)
        self._trim_dirty()
        for run in self._spec_runs.pop(s, ()):
            if run.until is None or run.until.pop(s, None) is None:
                continue
            if not run.until:
                run.until = None
            if run.spec is not None:
                _combine(run.spec, 0, len(run.spec), and_, keep)  # (equal bits stay equal: spec_flat holds)
                if not any(run.spec):
                    run.spec = None
            trim(run, self._roots, self._lru)

    def _set_bits(self, h: int, keep: int, bits: int) -> None:
        """Block ``h``'s mask becomes ``(mask & keep) | bits``, on its page or, without one,
        in the hash-keyed blocks."""
        place = self._where.get(h)
        if place is not None:
            run, i = place
            _set_mask(run, i, (run.masks[i] & keep) | bits)
            return
        m = (self._hashed.get(h, 0) & keep) | bits
        if m:
            self._hashed[h] = m
        else:
            self._hashed.pop(h, None)

    def worker_size(self, url: str) -> int:
        s = self._slots.get(url)
        return len(self._owned[s]) if s is not None else 0

    # -- placing blocks -----------------------------------------------------------------
    def _chain_salt(self, block_hash: int, first_page: list[int], cache_salt: str | None) -> tuple[bool, str | None]:
        """Which salt the engine hashed a chain's first page with (checked against its hash):
        (True, salt or None), or (False, None) when neither fits."""
        try:
            for salt in ((cache_salt, None) if cache_salt else (None,)):
                if page_hashes(first_page, len(first_page), salt)[0] == block_hash:
                    return True, salt
        except (OverflowError, TypeError):  # ids SGLang could not have hashed: keep it by hash
            pass
        return False, None

    def _root(self, page_size: int, salt: str | None) -> Run:
        root = self._roots.get((page_size, salt))
        if root is None:
            root = self._roots[(page_size, salt)] = Run(None, (page_size, salt), 4 * page_size)
        return root

    def _place(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int] | None,
               page_size: int, cache_salt: str | None) -> tuple[list[Place | None], int]:
        """The trie place of each block of one ``BlockStored`` (None: kept by hash), and
        from which block on the chain was new and appended whole (``len(hashes)`` if not):
        those blocks are known to nobody yet, which ``store`` uses to update them in bulk."""
        where = self._where
        packed = None
        n = len(hashes)
        if n and token_ids and len(token_ids) >= n * page_size:
            try:
                packed = uint32_le(token_ids if len(token_ids) == n * page_size else token_ids[: n * page_size])
            except (OverflowError, TypeError):
                packed = None
        prev: Place | None = where.get(parent) if parent is not None else None
        if packed is not None and parent is None and hashes[0] not in where:
            known, salt = self._chain_salt(hashes[0], list(token_ids[:page_size]), cache_salt)
            if known:
                prev = (self._root(page_size, salt), -1)
        width = 4 * page_size
        out: list[Place | None] = []
        for i, h in enumerate(hashes):
            place = where.get(h)
            if place is None:
                if packed is not None and prev is not None and prev[0].width == width:
                    run, at = prev[0], prev[1] + 1
                    if n - i > 1 and at == len(run.masks) and at not in run.children:
                        rest = hashes[i:]
                        if self._new_chain(rest):  # a new chain at the end of a run: append it whole
                            grow(run, at, packed[i * width:])
                            run.names[at:] = rest
                            out += zip(repeat(run), range(at, at + n - i))
                            where.update(zip(rest, out[i:]))
                            self._touch(run)
                            return out, i
                    place = step(run, at, packed if n == 1 else packed[i * width:(i + 1) * width])
                    where[h] = place
                    _name(place[0], place[1], h)
                    if h in self._by_hash:  # first reported without tokens: move it here
                        self._by_hash.discard(h)
                        m = self._hashed.pop(h, 0)
                        if m:
                            _set_mask(place[0], place[1], place[0].masks[place[1]] | m)
                        if h in self.pool:
                            place[0].mark_pooled(place[1], True)
                else:
                    self._by_hash.add(h)
            out.append(place)
            prev = place
        if self._lru is not None:  # the deepest page placed
            self._touch(next((p[0] for p in reversed(out) if p is not None), None))
        return out, n

    def _new_chain(self, hashes: Sequence[int]) -> bool:
        """No block of ``hashes`` is known (placed, or kept by hash: the pool's blocks are one
        or the other) and none repeats."""
        where, by_hash = self._where, self._by_hash
        return (not any(map(where.__contains__, hashes)) and not (by_hash and any(map(by_hash.__contains__, hashes)))
                and len(set(hashes)) == len(hashes))

    def _unhold(self, h: int) -> None:
        """One worker less holds ``h``; forget it when none does and the pool does not."""
        left = self._holders.get(h, 0) - 1
        if left > 0:
            self._holders[h] = left
            return
        self._holders.pop(h, None)
        if h not in self.pool:
            self._release(h)

    def _release(self, h: int) -> None:
        place = self._where.pop(h, None)
        if place is None:
            self._by_hash.discard(h)
            self._hashed.pop(h, None)
            return
        run, i = place
        names = run.names[i]
        if type(names) is list:
            names.remove(h)
            if len(names) == 1:
                run.names[i] = names[0]
        else:
            run.names[i] = None
            self._dirty.add(run)  # trimmed once the whole event is applied

    def _trim_dirty(self) -> None:
        """Trim the runs that lost pages: once per run and event, however many it lost
        (an eviction removes a chain leaf first, one page per event)."""
        for run in self._dirty:
            trim(run, self._roots, self._lru)
        self._dirty.clear()

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
            self.set_page_size(url, block_size)
        self._epoch += 1
        if parent is not None and self.evicted and self._drop_orphan(parent, hashes, token_ids):
            return
        places, new = self._place(hashes, parent, token_ids,
                                  block_size or self._page_size.get(url, self.default_page_size), cache_salt)
        s = self.slot(url)
        if tier == 2 and self.shared_pool:
            self.pool.update(hashes)
            for place in places:
                if place is not None:
                    place[0].mark_pooled(place[1], True)
            self._fit()
            return
        keep, cumulative = self._keep[s], self._cumulative[s]
        owned, holders = self._owned[s], self._holders
        if parent is not None and parent not in owned:
            self.orphans += 1
        bit = 1 << tier
        for h, place in zip(hashes[:new], places):
            raw = owned.get(h)
            if raw is None:
                holders[h] = holders.get(h, 0) + 1
                raw = 0
            raw |= bit
            owned[h] = raw
            self._set_bits(h, keep, cumulative[raw])
        if new < len(hashes):  # blocks nobody knew, appended whole to one run: all at once, in C
            rest = hashes[new:]
            run, at = places[new]  # type: ignore[misc]
            owned.update(zip(rest, repeat(bit)))
            holders.update(zip(rest, repeat(1)))
            run.masks[at:at + len(rest)] = repeat(cumulative[bit], len(rest))
        self._fit()

    # -- the memory budget --------------------------------------------------------------
    def known_blocks(self) -> int:
        """What ``max_blocks`` bounds: blocks placed in the trie or kept by hash."""
        return len(self._where) + len(self._by_hash)

    def _touch(self, run: Run | None) -> None:
        """``run`` becomes the most recently used: the run a prompt's path ends in, or a
        store's deepest page. Runs it passed through are not: their pages past the branch
        it took were not used (``_evict_run`` takes those, and a run's pages before a branch
        only go with the branches)."""
        lru = self._lru
        if lru is None or run is None:
            return
        if run in lru:
            lru.move_to_end(run)
        else:
            lru[run] = None

    def _drop_orphan(self, parent: int, hashes: Sequence[int], token_ids: Sequence[int] | None) -> bool:
        """Once the budget has evicted, a chain with tokens under a parent the index does not
        know is dropped instead of kept by hash. Its parent was most likely evicted (the
        engine still extends a chain the index forgot), so its pages cannot be placed; and
        no prompt's match could reach them anyway, as every path breaks at the missing
        parent. Kept by hash they would turn on the SHA fallback for every match (4x a
        decision's cost, measured: ``bench/index_budget.py``). Chains without tokens are
        kept by hash as ever: that is the only way they can be matched."""
        if token_ids is None or parent in self._where or parent in self._by_hash or not self._new_chain(hashes):
            return False
        self.dropped += len(hashes)
        return True

    def _fit(self) -> None:
        """Evict until the blocks known (placed or by hash) fit ``max_blocks``: the blocks
        kept by hash first (each costs the SHA fallback on every match), then the pages of
        the least recently used runs past their last branch, deepest first."""
        if self._lru is None:
            return
        over = self.known_blocks() - self.max_blocks
        if over <= 0:
            return
        if not self.evicted:
            log.warning("precise index: %d blocks reached its budget (max_index_blocks=%d); evicting the least "
                        "recently used, counted in index_evicted_blocks", self.max_blocks + over, self.max_blocks)
        self._epoch += 1
        while over > 0 and self._by_hash:
            h = self._by_hash.pop()
            self._forget(h, self._hashed.pop(h, 0))
            self.evicted += 1
            over -= 1
        lru = self._lru
        tries = 4 * len(lru) + 16  # each try evicts, or leaves a run out of the order
        while over > 0 and lru and tries:
            tries -= 1
            over -= self._evict_run(next(iter(lru)), over)

    def _evict_run(self, run: Run, want: int) -> int:
        """Forget ``run``'s last pages, deepest first, until ``want`` blocks are gone or the
        run's last branch is reached; returns how many went. So the work per store is what
        the store added (a whole 100k-token run at page size 1 would stall the loop), and
        the run stays first in the order while it has pages past its last branch. A run
        left all branch point leaves the order until its last branch goes
        (``page_trie.detach``), as an inner radix node is evicted only after its children;
        a run left empty leaves the trie."""
        start = max(run.children) if run.children else 0
        names_at, masks = run.names, run.masks
        i, gone = len(names_at), 0
        while i > start and gone < want:
            i -= 1
            names = names_at[i]
            if names is None:
                continue
            for h in names if type(names) is list else (names,):
                self._forget(h, masks[i])
                gone += 1
        self.evicted += gone
        run.truncate(i)
        for s, times in list((run.until or {}).items()):  # queued expiries find nothing left
            if not any(times):
                self._spec_done(run, s)
        if i > start:
            return gone
        if run.children:
            self._lru.pop(run, None)  # type: ignore[union-attr]
        else:
            parent = detach(run, self._roots, self._lru)
            if parent is not None:
                trim(parent, self._roots, self._lru)
        return gone

    def _spec_done(self, run: Run, s: int) -> None:
        """Slot ``s`` has no speculative page left on ``run``."""
        del run.until[s]  # type: ignore[index]
        self._spec_runs.get(s, set()).discard(run)
        if not run.until:
            run.until = None

    def _forget(self, h: int, mask: int) -> None:
        """Block ``h`` leaves the index for every worker (``mask``: who holds it)."""
        self._where.pop(h, None)
        self._holders.pop(h, None)
        self.pool.discard(h)
        owned = self._owned
        for b in _bit_indexes(mask):
            if b % 3 == 2:
                owned[b // 3].pop(h, None)

    def remove(self, url: str, hashes: Sequence[int], tier: int = 0) -> None:
        self._epoch += 1
        where = self._where
        if tier == 2 and self.shared_pool:  # the store evicted it: gone for everyone
            for h in hashes:
                if h not in self.pool:
                    continue
                self.pool.discard(h)
                place = where.get(h)
                if place is not None:
                    place[0].mark_pooled(place[1], False)
                if h not in self._holders:
                    self._release(h)
            self._trim_dirty()
            return
        s = self._slots.get(url)
        if s is None:
            return
        keep, cumulative, owned = self._keep[s], self._cumulative[s], self._owned[s]
        for h in hashes:
            raw = owned.get(h)
            if raw is None:
                continue
            raw &= ~(1 << tier)
            self._set_bits(h, keep, cumulative[raw])
            if raw:
                owned[h] = raw
            else:
                del owned[h]
                self._unhold(h)
        self._trim_dirty()

    # -- requests -----------------------------------------------------------------------
    def usable(self, request: RequestView) -> bool:
        return request.token_ids is not None

    def _prompt(self, request: RequestView) -> list:
        """[tokens, packed ids (None if some id is no uint32), SHA chains by page size] of the
        last request seen: select and record both need them, one right after the other."""
        tokens = request.token_ids or []
        got = self._last_prompt
        # The cache holds the token list itself, so identity cannot be a recycled id().
        if got[0] is not tokens or got[3] != request.cache_salt:
            got = self._last_prompt = [tokens, request.packed(), {}, request.cache_salt]
        return got

    def hashes_for(self, request: RequestView, page_size: int) -> list[int]:
        """The request's SHA page chain, needed only while blocks are keyed by hash."""
        got = self._prompt(request)
        chains = got[2]
        if page_size not in chains:
            try:
                chains[page_size] = self.chains.hashes(got[0], page_size, request.cache_salt)
            except (OverflowError, TypeError):
                chains[page_size] = []
        return chains[page_size]

    def _walk(self, request: RequestView, page_size: int) -> tuple[bytes, Path, Run | None, int]:
        """The request's packed ids and its path in the trie (cached until the index changes)."""
        packed = self._prompt(request)[1]
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
                self._touch(got[1][-1][0])
        self._last_walk = (request.request_id, page_size, self._epoch, got)
        return got

    def _candidates(self, workers: Sequence[WorkerView]) -> list[tuple[int, int, list[str], frozenset[str], bool]]:
        """(page size, mask of the candidates' bits, their urls as a list and a set, whether
        the index knows all of them) groups, cached per worker set."""
        last = self._last_candidates
        # Usually the same worker objects as last time: the list compares them by identity, in C.
        if last[0] == self._version and workers == last[1]:
            return last[2]
        key = tuple(map(_url, workers))
        got = self._groups.get(key)
        if got is not None and got[0] == self._version:
            self._last_candidates = (self._version, list(workers), got[1])
            return got[1]
        groups: dict[int, tuple[int, list[str], bool]] = {}
        for w in workers:  # a worker the index has not heard of yet holds nothing, but can load the pool
            s = self._slots.get(w.url)
            ps = self.page_size_of(w)
            mask, urls, known = groups.get(ps, (0, [], True))
            groups[ps] = (mask if s is None else mask | (7 << (3 * s)), urls + [w.url], known and s is not None)
        if len(self._groups) > 256:
            self._groups.clear()
        self._groups[key] = (self._version, [(ps, m, u, frozenset(u), k) for ps, (m, u, k) in groups.items()])
        self._last_candidates = (self._version, list(workers), self._groups[key][1])
        return self._groups[key][1]

    def match(self, request: RequestView, workers: Sequence[WorkerView]) -> IndexMatch:
        result = IndexMatch(len(request.token_ids or ()), "tokens")
        if request.token_ids is None:
            return result
        if self._spec_queue and self._spec_queue[0][0] <= time.monotonic():
            self.expire(limit=4)  # a few per decision keeps pace with record() and bounds latency
        for ps, wanted, urls, members, known in self._candidates(workers):
            _, path, _, _ = self._walk(request, ps)
            floor = 0
            if self._by_hash:  # some blocks are known by hash only: page by page, with their SHA chain
                hashes = self.hashes_for(request, ps)
                on_path = chained(chained.from_iterable(_path_masks(r, n) for r, n in path), repeat(0))
                pages = _held_pages(map(or_, on_path, map(self._hashed.get, hashes, repeat(0))), wanted)
                flags = chained(chained.from_iterable(r.pooled[:n] if r.pooled else bytes(n) for r, n in path),
                                repeat(0))
                pooled = len(list(takewhile(bool, map(or_, flags, map(self.pool.__contains__, hashes)))))
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

    def record(self, request: RequestView, worker: WorkerView) -> None:
        if request.token_ids is None or self.speculative_ttl_s <= 0:
            return
        s = self.slot(worker.url)
        ps = self.page_size_of(worker)
        packed, path, end, at = self._walk(request, ps)
        width = 4 * ps
        pages = len(packed) // width
        if not pages:
            return
        last = self._last_match
        skip = 0
        if last is not None and last[0] == request.request_id:
            # Pages the worker already holds on GPU (reported, or speculative) need no entry.
            skip = last[1].get(worker.url).gpu // ps
        if skip >= pages:
            return
        ranges: list[tuple[Run, int, int]] = []
        done = 0
        for run, n in path:
            if skip < done + n:
                ranges.append((run, max(0, skip - done), n))
            done += n
        if done < pages:
            if end is None:
                end, at = self._root(ps, request.cache_salt or None), 0
            # (not put in the eviction order: pages no block names yet do not count against the
            # budget, and expire on their own; a store that names them puts their run in it)
            run, first = grow(end, at, packed[done * width: pages * width])
            ranges.append((run, first + max(0, skip - done), first + pages - done))
        self._epoch += 1
        until = time.monotonic() + self.speculative_ttl_s
        bits = 7 << (3 * s)
        runs = self._spec_runs.setdefault(s, set())
        for run, a, b in ranges:
            if a >= b:
                continue
            if run.spec is None and run.until is None and not a and b == len(run.masks):  # new pages, grown above
                run.spec, run.until, run.spec_flat = [bits] * b, {s: [until] * b}, b
                runs.add(run)
                continue
            _combine(run.spec_list(), a, b, or_, bits)
            run.spec_changed(a, b)
            if run.until is None:
                run.until = {}
            times = run.until.get(s)
            if times is None:
                times = run.until[s] = [0.0] * b
            elif len(times) < b:
                times.extend(repeat(0.0, b - len(times)))
            times[a:b] = repeat(until, b - a)
            runs.add(run)
        self._spec_queue.append((until, s, ranges))

    def expire(self, now: float | None = None, limit: int | None = None) -> None:
        now = time.monotonic() if now is None else now
        q = self._spec_queue
        while q and q[0][0] <= now and limit != 0:
            limit = None if limit is None else limit - 1
            until, s, ranges = q.popleft()
            self._epoch += 1
            clear = ~(7 << (3 * s))
            for run, a, b in ranges:
                times = run.until.get(s) if run.until else None
                spec = run.spec
                if times is None or spec is None:
                    continue  # the worker was cleared since
                b = min(b, len(times), len(spec))
                if a >= b:
                    continue
                if times[a:b].count(until) == b - a:  # not refreshed by a later request: all at once
                    _combine(spec, a, b, and_, clear)
                    times[a:b] = repeat(0.0, b - a)
                    run.spec_changed(a, b)
                else:
                    for i in range(a, b):
                        if times[i] == until:
                            times[i] = 0.0
                            spec[i] &= clear
                    run.spec_changed(a)
                if not any(times):
                    self._spec_done(run, s)
                if not any(spec):
                    run.spec = None
                trim(run, self._roots, self._lru)

    def maintain(self, now: float | None = None) -> None:
        self.expire(now)

    def speculative_pages(self) -> int:
        """Pages carrying some worker's speculative bits (counted, for stats and tests)."""
        runs = set().union(*self._spec_runs.values()) if self._spec_runs else set()
        return sum(len(r.spec) - r.spec.count(0) for r in runs if r.spec is not None)

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
