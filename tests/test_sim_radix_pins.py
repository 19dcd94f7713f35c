"""Pinning a prefix that waits in host (or pool) memory must not shrink what the device
can evict: before the fix such a request could never be admitted on a full GPU."""

from __future__ import annotations

from simulator.radix_cache import RadixCache, build_tiers
from wire.hashing import page_hashes


def test_pinned_lower_tier_pages_do_not_count_as_locked_device_tokens():
    cache = RadixCache(4, build_tiers(16, 64, 1 << 20))
    a, b = list(range(16)), list(range(100, 116))
    cache.insert(page_hashes(a, 4), a)
    assert cache.evict(0, 16) == 16  # a now lives in host (write-back) only
    cache.insert(page_hashes(b, 4), b)  # the device is full of b
    m = cache.match(page_hashes(a, 4))
    assert m.pages == 4 and m.per_tier[0] == 0
    cache.lock(m.last)
    assert cache.evictable_tokens() == 16  # all of b can still make room for a
    assert cache.evict(0, 16) == 16
    assert cache.promote(m.nodes) == 16
    assert cache.locked_tokens == 16  # a is on the device now, and pinned
    cache.unlock(m.last)
    assert cache.locked_tokens == 0


def test_flush_leaves_no_node_a_late_backup_could_revive():
    cache = RadixCache(4, build_tiers(16, 64, 1 << 20))
    a = list(range(16))
    path = cache.insert(page_hashes(a, 4), a)
    cache.reset()
    assert not cache.add_tier(path[-1], 2)  # the pool backup of a flushed page lands nowhere
    assert cache.tiers[2].used_tokens == 0
