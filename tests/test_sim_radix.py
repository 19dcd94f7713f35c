"""The radix cache against brute-force models (hypothesis drives random operation mixes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.radix_cache import RadixCache, Tier, build_tiers
from wire.hashing import page_hashes
from wire.kv_events import BlockRemoved, BlockStored

PS = 2
seqs = st.lists(st.integers(0, 2), min_size=0, max_size=10)


def _cache(device: int, host: int = 0, write_through: bool = True) -> RadixCache:
    t = [0.0]

    def clock() -> float:
        t[0] += 1.0
        return t[0]

    return RadixCache(PS, build_tiers(device, host), write_through=write_through, clock=clock)


def _full(seq: list[int]) -> list[int]:
    return seq[: len(seq) - len(seq) % PS]


def _common_pages(a: list[int], b: list[int]) -> int:
    n = 0
    for i in range(0, min(len(a), len(b)) - PS + 1, PS):
        if a[i:i + PS] != b[i:i + PS]:
            break
        n += 1
    return n


@settings(max_examples=150, deadline=None)
@given(st.lists(seqs, min_size=1, max_size=12), seqs)
def test_match_is_longest_inserted_prefix_without_eviction(inserted, probe):
    cache = _cache(10_000)
    for s in inserted:
        cache.insert(page_hashes(s, PS), s)
    m = cache.match(page_hashes(probe, PS))
    assert m.pages == max(_common_pages(_full(s), _full(probe)) for s in inserted)
    assert m.per_tier[0] == m.pages


def _check_invariants(cache: RadixCache) -> None:
    counts = [0] * len(cache.tiers)
    for n in cache.iter_nodes():
        assert n.present, "a node in no tier must leave the trie"
        for t in range(len(cache.tiers)):
            if n.present >> t & 1:
                counts[t] += PS
        if n.present & 1 and n.parent is not cache.root:
            assert n.parent.present & 1, "device tier must be prefix-closed"
        if n.lock_ref:
            assert n.present & 1, "locked pages stay on the device"
    for n in [cache.root, *cache.iter_nodes()]:
        for t in range(len(cache.tiers)):
            mask = (1 << (t + 1)) - 1
            assert n.kids[t] == sum(1 for c in n.children.values() if c.present & mask), "child counts"
    for t, tier in enumerate(cache.tiers):
        assert tier.used_tokens == counts[t]
        assert tier.used_tokens <= tier.capacity_tokens


ops = st.lists(st.tuples(st.sampled_from(["insert", "evict", "lock", "unlock", "relock", "match"]), seqs,
                         st.integers(1, 6)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops, st.booleans(), st.booleans())
def test_random_ops_keep_invariants_lru_and_events(operations, with_host, write_through):
    cap = 8 * PS
    cache = _cache(cap, 6 * PS if with_host else 0, write_through)
    locked: list = []
    # the KV-event stream, replayed into sets, must equal the tiers' contents
    gpu: set[int] = set()
    cpu: set[int] = set()

    def replay() -> None:
        for e in cache.drain_events():
            target = gpu if e.medium == "GPU" else cpu
            if isinstance(e, BlockStored):
                assert e.block_hashes[0] not in target
                target.add(e.block_hashes[0])
            elif isinstance(e, BlockRemoved):
                assert e.block_hashes[0] in target
                target.discard(e.block_hashes[0])

    for op, seq, k in operations:
        hashes = page_hashes(seq, PS)
        if op == "insert":
            m = cache.match(hashes, touch=False)
            need = (len(hashes) - m.per_tier[0]) * PS
            free = cache.tiers[0].free_tokens
            if m.per_tier[0] == m.pages:
                cache.lock(m.last)  # as the scheduler does: never evict the prefix being extended
            if need > free:
                cache.evict(0, need - free)
            # eviction may have moved pages of this very path to the host: price it again
            need = (len(hashes) - cache.match(hashes, touch=False).per_tier[0]) * PS
            if cache.tiers[0].free_tokens >= need:
                cache.insert(hashes, seq)
            if m.per_tier[0] == m.pages:
                cache.unlock(m.last)
        elif op == "evict" and k > 1:
            # asked for k pages, it frees k pages whenever that many are unlocked (chains
            # evict leaf after leaf)
            possible = cache.evictable_tokens()
            assert cache.evict(0, k * PS) >= min(k * PS, possible)
        elif op == "evict":
            # brute-force LRU: the evictable device leaf with the oldest access goes first
            leaves = [n for n in cache.iter_nodes() if n.present & 1 and not n.lock_ref
                      and not any(c.present & 1 for c in n.children.values())]
            oldest = min(leaves, key=lambda n: n.last_access) if leaves else None
            before = {id(n) for n in cache.iter_nodes() if n.present & 1}
            freed = cache.evict(0, PS)
            after = {id(n) for n in cache.iter_nodes() if n.present & 1}
            if oldest is None:
                assert freed == 0
            else:
                assert freed == PS and before - after == {id(oldest)}
        elif op == "lock":
            m = cache.match(hashes)
            if m.last is not None and m.per_tier[0] == m.pages:
                cache.lock(m.last)
                locked.append(m.last)
        elif op == "unlock" and locked:
            cache.unlock(locked.pop(k % len(locked)))
        elif op == "relock" and locked:
            # a locked prefix grows: move its lock to a deeper page on the same path
            i = k % len(locked)
            deeper = locked[i]
            while deeper.children:
                nxt = next(iter(deeper.children.values()))
                if not nxt.present & 1:
                    break
                deeper = nxt
            cache.relock(locked[i], deeper)
            locked[i] = deeper
        elif op == "match":
            m = cache.match(hashes)
            assert m.pages <= len(hashes)
        replay()
        _check_invariants(cache)
        assert gpu == {n.key for n in cache.iter_nodes() if n.present & 1}
        if with_host:
            assert cpu == {n.key for n in cache.iter_nodes() if n.present & 2}
    for n in locked:
        cache.unlock(n)
    assert cache.locked_tokens == 0


def test_host_tier_serves_evicted_device_pages():
    cache = _cache(4 * PS, 8 * PS, write_through=False)
    a = [1, 1, 2, 2, 3, 3, 4, 4]
    cache.insert(page_hashes(a, PS), a)
    assert cache.evict(0, 4 * PS) == 4 * PS
    m = cache.match(page_hashes(a, PS))
    assert (m.pages, m.per_tier) == (4, [0, 4])
    assert cache.promote(m.nodes) == 4 * PS
    assert cache.match(page_hashes(a, PS)).per_tier == [4, 0]


def test_tiers_are_a_list_a_third_slots_in():
    tiers = build_tiers(4 * PS, 4 * PS) + [Tier("storage", 100 * PS, None)]
    cache = RadixCache(PS, tiers, write_through=False)
    a = list(range(8))
    cache.insert(page_hashes(a, PS), a)
    cache.evict(0, 4 * PS)
    cache.evict(1, 4 * PS)
    m = cache.match(page_hashes(a, PS))
    assert m.per_tier == [0, 0, 4]
