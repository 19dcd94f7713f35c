"""The precise index's memory budget: forget the least recently used pages past ``max_blocks``.

Runs are kept in least recently used order (the run a prompt's path ends in, and a store's
deepest page, become the newest). Past the budget the blocks kept by hash go first (each
costs the SHA fallback on every match), then the oldest run's pages past its last branch,
deepest first and only as many as must go: a prefix shared by several conversations stays as
long as any branch under it is used. Forgetting is for every worker at once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from index.block_masks import _bit_indexes
from index.page_trie import Run, detach, trim

if TYPE_CHECKING:
    from index.block_places import BlockPlaces
    from index.hash_keyed import HashKeyed
    from index.speculative import Speculative
    from index.worker_slots import WorkerSlots

log = logging.getLogger("kvgate.policies.kv_events")


def touch(lru: OrderedDict[Run, None] | None, run: Run | None) -> None:
    """``run`` becomes the most recently used: the run a prompt's path ends in, or a
    store's deepest page. Runs it passed through are not: their pages past the branch
    it took were not used (``_evict_run`` takes those, and a run's pages before a branch
    only go with the branches)."""
    if lru is None or run is None:
        return
    if run in lru:
        lru.move_to_end(run)
    else:
        lru[run] = None


class BlockBudget:
    """LRU order of the trie's runs and eviction down to ``max_blocks`` (0: no budget)."""

    def __init__(self, max_blocks: int, lru: OrderedDict[Run, None] | None, places: BlockPlaces,
                 slots: WorkerSlots, keyed: HashKeyed, speculative: Speculative) -> None:
        self.max_blocks = max_blocks
        self.lru = lru  # runs least recently matched or stored first (None: no budget)
        self.evicted = 0
        self.dropped = 0
        self._places, self._spec = places, speculative
        self._roots, self._where, self._holders, self.pool = places.roots, places.where, places.holders, places.pool
        self._owned, self._by_hash, self._hashed = slots.owned, keyed.by_hash, keyed.hashed

    def known_blocks(self) -> int:
        """What ``max_blocks`` bounds: blocks placed in the trie or kept by hash."""
        return len(self._where) + len(self._by_hash)

    def touch(self, run: Run | None) -> None:
        touch(self.lru, run)

    def drop_orphan(self, parent: int, hashes: Sequence[int], token_ids: Sequence[int] | None) -> bool:
        """Once the budget has evicted, a chain with tokens under a parent the index does not
        know is dropped instead of kept by hash. Its parent was most likely evicted (the
        engine still extends a chain the index forgot), so its pages cannot be placed; and
        no prompt's match could reach them anyway, as every path breaks at the missing
        parent. Kept by hash they would turn on the SHA fallback for every match (4x a
        decision's cost, measured: ``bench/index_budget.py``). Chains without tokens are
        kept by hash as ever: that is the only way they can be matched."""
        if (token_ids is None or parent in self._where or parent in self._by_hash
                or not self._places.new_chain(hashes)):
            return False
        self.dropped += len(hashes)
        return True

    def fit(self) -> bool:
        """Evict until the blocks known (placed or by hash) fit ``max_blocks``: the blocks
        kept by hash first (each costs the SHA fallback on every match), then the pages of
        the least recently used runs past their last branch, deepest first. Returns whether
        it was over (the index changed)."""
        if self.lru is None:
            return False
        over = self.known_blocks() - self.max_blocks
        if over <= 0:
            return False
        if not self.evicted:
            log.warning("precise index: %d blocks reached its budget (max_index_blocks=%d); evicting the least "
                        "recently used, counted in index_evicted_blocks", self.max_blocks + over, self.max_blocks)
        while over > 0 and self._by_hash:
            h = self._by_hash.pop()
            self._forget(h, self._hashed.pop(h, 0))
            self.evicted += 1
            over -= 1
        lru = self.lru
        tries = 4 * len(lru) + 16  # each try evicts, or leaves a run out of the order
        while over > 0 and lru and tries:
            tries -= 1
            over -= self._evict_run(next(iter(lru)), over)
        return True

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
                self._spec.done(run, s)
        if i > start:
            return gone
        if run.children:
            self.lru.pop(run, None)  # type: ignore[union-attr]
        else:
            parent = detach(run, self._roots, self.lru)
            if parent is not None:
                trim(parent, self._roots, self.lru)
        return gone

    def _forget(self, h: int, mask: int) -> None:
        """Block ``h`` leaves the index for every worker (``mask``: who holds it)."""
        self._where.pop(h, None)
        self._holders.pop(h, None)
        self.pool.discard(h)
        owned = self._owned
        for b in _bit_indexes(mask):
            if b % 3 == 2:
                owned[b // 3].pop(h, None)
