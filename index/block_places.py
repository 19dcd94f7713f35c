"""Where each reported block sits in the precise index, and the worker bits it carries.

``BlockStored`` events carry each block's tokens and parent, so a block gets its page in the
trie (``index.page_trie``) when its event arrives, and ``where`` (block hash -> (run, offset))
serves the events that name blocks by hash only (``BlockRemoved``, tiers reporting a block
again). A chain start's first page is hashed once to learn the engine's salt: each (page
size, salt) has its own root. Blocks that cannot be placed are kept by hash
(``index.hash_keyed``) and move to their page when an event brings their tokens. Store and
remove set the slot's tier bits on the block's page; ``holders`` counts the workers holding
each hash, and a block none holds (and the shared pool does not) leaves the index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat

from index.block_budget import touch
from index.block_masks import _name, _set_mask
from index.hash_keyed import HashKeyed
from index.page_trie import Run, grow, step, trim
from index.worker_slots import WorkerSlots
from wire.hashing import page_hashes, uint32_le

Place = tuple[Run, int]


class BlockPlaces:
    """Trie places, holders and shared-pool flags of the blocks the workers reported."""

    def __init__(self, slots: WorkerSlots, keyed: HashKeyed, lru: OrderedDict[Run, None] | None,
                 shared_pool: bool = True) -> None:
        self.roots: dict[tuple[int, str | None], Run] = {}  # (page size, salt) -> trie root
        self.where: dict[int, Place] = {}  # block hash -> its page in the trie
        self.holders: dict[int, int] = {}  # block hash -> how many workers hold it
        self.shared_pool = bool(shared_pool)
        self.pool: set[int] = set()  # block hashes in the shared store (when shared_pool)
        self.orphans = 0
        self._dirty: set[Run] = set()  # runs with pages no hash names any more, to trim
        self._slots = slots
        self._owned, self._keep, self._cumulative = slots.owned, slots.keep, slots.cumulative
        self._hashed, self._by_hash = keyed.hashed, keyed.by_hash
        self._lru = lru

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

    def root(self, page_size: int, salt: str | None) -> Run:
        root = self.roots.get((page_size, salt))
        if root is None:
            root = self.roots[(page_size, salt)] = Run(None, (page_size, salt), 4 * page_size)
        return root

    def _place(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int] | None,
               page_size: int, cache_salt: str | None) -> tuple[list[Place | None], int]:
        """The trie place of each block of one ``BlockStored`` (None: kept by hash), and
        from which block on the chain was new and appended whole (``len(hashes)`` if not):
        those blocks are known to nobody yet, which ``store`` uses to update them in bulk."""
        where = self.where
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
                prev = (self.root(page_size, salt), -1)
        width = 4 * page_size
        out: list[Place | None] = []
        for i, h in enumerate(hashes):
            place = where.get(h)
            if place is None:
                if packed is not None and prev is not None and prev[0].width == width:
                    run, at = prev[0], prev[1] + 1
                    if n - i > 1 and at == len(run.masks) and at not in run.children:
                        rest = hashes[i:]
                        if self.new_chain(rest):  # a new chain at the end of a run: append it whole
                            grow(run, at, packed[i * width:])
                            run.names[at:] = rest
                            out += zip(repeat(run), range(at, at + n - i))
                            where.update(zip(rest, out[i:]))
                            touch(self._lru, run)
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
            touch(self._lru, next((p[0] for p in reversed(out) if p is not None), None))
        return out, n

    def new_chain(self, hashes: Sequence[int]) -> bool:
        """No block of ``hashes`` is known (placed, or kept by hash: the pool's blocks are one
        or the other) and none repeats."""
        where, by_hash = self.where, self._by_hash
        return (not any(map(where.__contains__, hashes)) and not (by_hash and any(map(by_hash.__contains__, hashes)))
                and len(set(hashes)) == len(hashes))

    # -- worker bits ----------------------------------------------------------------------
    def store(self, url: str, hashes: Sequence[int], parent: int | None, tier: int, page_size: int,
              token_ids: Sequence[int] | None, cache_salt: str | None) -> None:
        """Place one stored chain and set ``url``'s bit for ``tier`` on its blocks (tier 2 in
        a shared pool: the pool's flag instead, for every worker)."""
        places, new = self._place(hashes, parent, token_ids, page_size, cache_salt)
        s = self._slots.slot(url)
        if tier == 2 and self.shared_pool:
            self.pool.update(hashes)
            for place in places:
                if place is not None:
                    place[0].mark_pooled(place[1], True)
            return
        keep, cumulative = self._keep[s], self._cumulative[s]
        owned, holders = self._owned[s], self.holders
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

    def remove(self, url: str, hashes: Sequence[int], tier: int) -> None:
        where = self.where
        if tier == 2 and self.shared_pool:  # the store evicted it: gone for everyone
            for h in hashes:
                if h not in self.pool:
                    continue
                self.pool.discard(h)
                place = where.get(h)
                if place is not None:
                    place[0].mark_pooled(place[1], False)
                if h not in self.holders:
                    self._release(h)
            self._trim_dirty()
            return
        s = self._slots.by_url.get(url)
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

    def clear_slot(self, s: int) -> None:
        """Slot ``s`` holds nothing any more."""
        keep = self._keep[s]
        owned, self._owned[s] = self._owned[s], {}
        for h in owned:
            self._set_bits(h, keep, 0)
            self._unhold(h)
        self._trim_dirty()

    def _set_bits(self, h: int, keep: int, bits: int) -> None:
        """Block ``h``'s mask becomes ``(mask & keep) | bits``, on its page or, without one,
        in the hash-keyed blocks."""
        place = self.where.get(h)
        if place is not None:
            run, i = place
            _set_mask(run, i, (run.masks[i] & keep) | bits)
            return
        m = (self._hashed.get(h, 0) & keep) | bits
        if m:
            self._hashed[h] = m
        else:
            self._hashed.pop(h, None)

    # -- letting go ---------------------------------------------------------------------
    def _unhold(self, h: int) -> None:
        """One worker less holds ``h``; forget it when none does and the pool does not."""
        left = self.holders.get(h, 0) - 1
        if left > 0:
            self.holders[h] = left
            return
        self.holders.pop(h, None)
        if h not in self.pool:
            self._release(h)

    def _release(self, h: int) -> None:
        place = self.where.pop(h, None)
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
            trim(run, self.roots, self._lru)
        self._dirty.clear()
