"""The precise index's memory budget (``max_blocks``): least recently used runs go first,
never more blocks than the budget, and what it forgets only ever shortens a match."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from index.block_index import BlockIndex
from tests.test_prefix_index_blocks import PS, URLS, WORKERS, held_by, req
from wire.hashing import page_hashes
from wire.kv_events import BlockRemoved, BlockStored

MEDIUMS = ["GPU", "CPU_PINNED", "EXTERNAL"]


def blocks(index: BlockIndex) -> int:
    return len(index._where) + len(index._by_hash)


def store(index: BlockIndex, url: str, tokens: list[int], cut: int = 0, medium: str = "GPU") -> list[int]:
    """``tokens`` stored as SGLang sends a turn: the pages up to ``cut`` (a chain start), then
    the rest as their child."""
    hashes = page_hashes(tokens, PS)
    cut = min(cut, len(hashes))
    if cut:
        index.apply(url, BlockStored(hashes[:cut], None, tokens[: cut * PS], PS, None, medium))
    if hashes[cut:]:
        index.apply(url, BlockStored(hashes[cut:], hashes[cut - 1] if cut else None, tokens[cut * PS: len(hashes) * PS],
                                     PS, None, medium))
    return hashes


def prefix(index: BlockIndex, tokens: list[int]) -> dict[str, tuple[int, int, int]]:
    return held_by(index.match(req(tokens), WORKERS), WORKERS)


def at_most(small: tuple[int, int, int], big: tuple[int, int, int]) -> bool:
    """Per tier, cumulatively: on GPU, on GPU or host, anywhere."""
    return small[0] <= big[0] and small[0] + small[1] <= big[0] + big[1] and sum(small) <= sum(big)


def reachable(index: BlockIndex) -> set:
    runs, stack = set(), list(index._roots.values())
    while stack:
        run = stack.pop()
        runs.add(run)
        stack.extend(child for kids in run.children.values() for child in kids.values())
    return runs


def branches_hang_on_pages(index: BlockIndex) -> bool:
    """No run has lost the pages a branch of it diverges after (the branch would be cut off
    from every prompt's path while its blocks still counted)."""
    return all(max(run.children, default=0) <= len(run.masks) for run in reachable(index))


seqs = st.lists(st.integers(0, 3), min_size=2, max_size=16)
ops = st.lists(st.tuples(st.sampled_from(["store", "store", "match", "remove"]), st.sampled_from(URLS), seqs,
                         st.integers(0, 8), st.integers(0, 2)), max_size=40)


@settings(max_examples=250, deadline=None)
@given(ops, st.integers(3, 12), st.booleans())
# A run whose last branch is evicted has pages past its remaining branches again: it must
# come back into the eviction order, or the chain just stored is what goes.
@example([("store", URLS[0], [0] * 8, 0, 0), ("store", URLS[0], [0] * 7 + [1], 0, 0),
          ("store", URLS[0], [0, 1, 0, 0], 0, 0)], 4, False)
def test_budget_holds_and_only_shortens_matches(operations, budget, shared_pool):
    full = BlockIndex(speculative_ttl_s=0, shared_pool=shared_pool)
    small = BlockIndex(speculative_ttl_s=0, shared_pool=shared_pool, max_blocks=budget)
    for op, url, tokens, cut, tier in operations:
        if op == "store":
            for index in (full, small):
                hashes = store(index, url, tokens, cut, MEDIUMS[tier])
            if len(hashes) <= budget:  # the chain just stored is the most recent: kept whole
                assert sum(prefix(small, tokens)[url]) == len(hashes) * PS
        elif op == "match":
            small.match(req(tokens), WORKERS)  # a match makes its runs recent too
        else:
            hashes = page_hashes(tokens, PS)
            for index in (full, small):
                index.apply(url, BlockRemoved(hashes[cut // 2:], MEDIUMS[tier]))
        assert blocks(small) <= budget
        assert branches_hang_on_pages(small)
        assert not small.stats()["index_hash_keyed_blocks"]  # children of evicted blocks are dropped
        for _, _, query, _, _ in operations[:8]:
            got, bound = prefix(small, query), prefix(full, query)
            assert all(at_most(t, bound.get(u, (0, 0, 0))) for u, t in got.items()), (got, bound)
    assert set(small._holders) <= set(full._holders)
    assert small.stats()["index_evicted_blocks"] >= blocks(full) - blocks(small) - small.dropped


def test_least_recently_used_conversation_goes_first_and_its_next_turn_is_dropped():
    index = BlockIndex(speculative_ttl_s=0, max_blocks=12)
    a, b, c, d = ([k] * 8 for k in (10, 20, 30, 40))  # four conversations of 4 pages each
    hashes = {}
    for tokens, url in ((a, URLS[0]), (b, URLS[1]), (c, URLS[2])):
        hashes[tokens[0]] = store(index, url, tokens)
    assert blocks(index) == 12 and not index.evicted
    index.match(req(a), WORKERS)  # a is used again: b is now the oldest
    store(index, URLS[3], d)
    assert blocks(index) == 12 and index.stats()["index_evicted_blocks"] == 4
    assert prefix(index, a) == {URLS[0]: (8, 0, 0)}
    assert prefix(index, b) == {}
    assert prefix(index, c) == {URLS[2]: (8, 0, 0)}
    # b's worker goes on with b: its new pages' parent is gone, so they are dropped, not
    # kept by hash (which would make every match hash its prompt)
    nxt = b + [21, 21, 21, 21]
    tail = page_hashes(nxt, PS)[4:]
    index.apply(URLS[1], BlockStored(tail, hashes[20][-1], [21] * 4, PS, None, "GPU"))
    assert index.stats()["index_dropped_blocks"] == 2 and not index.stats()["index_hash_keyed_blocks"]
    assert blocks(index) == 12
    # a's worker goes on with a: placed, and d makes room (the oldest now: the checks
    # above matched a and c, and matching is using), one page for the one that came, its
    # deepest
    nxt = a + [11, 11]
    index.apply(URLS[0], BlockStored(page_hashes(nxt, PS)[4:], hashes[10][-1], [11, 11], PS, None, "GPU"))
    assert blocks(index) == 12 and index.evicted == 5
    assert prefix(index, d) == {URLS[3]: (6, 0, 0)} and prefix(index, c) == {URLS[2]: (8, 0, 0)}
    assert prefix(index, nxt) == {URLS[0]: (10, 0, 0)}
    # what was forgotten comes back when an engine stores it again; c's deepest page makes
    # room (d, c, then a were matched last, and the store made d the newest)
    store(index, URLS[3], d)
    assert prefix(index, d) == {URLS[3]: (8, 0, 0)} and prefix(index, c) == {URLS[2]: (6, 0, 0)}
    assert blocks(index) == 12


def test_a_shared_prefix_stays_while_any_conversation_under_it_is_used():
    index = BlockIndex(speculative_ttl_s=0, max_blocks=10)
    system = [7] * 8  # 4 pages every conversation starts with
    first, second, third = (system + [k] * 4 for k in (1, 2, 3))
    store(index, URLS[0], first, cut=4)
    store(index, URLS[1], second, cut=4)
    assert blocks(index) == 8
    index.match(req(first), WORKERS)
    store(index, URLS[2], third, cut=4)  # 10 blocks: fits
    store(index, URLS[2], system + [4] * 4, cut=4)  # over: the oldest leaf (second's tail) goes
    assert prefix(index, second) == {URLS[0]: (8, 0, 0), URLS[1]: (8, 0, 0), URLS[2]: (8, 0, 0)}
    assert prefix(index, first)[URLS[0]] == (12, 0, 0)
    assert index.evicted == 2


def test_blocks_kept_by_hash_are_evicted_before_placed_ones():
    index = BlockIndex(speculative_ttl_s=0, max_blocks=6)
    placed = store(index, URLS[0], [5] * 8)
    orphan = page_hashes([6] * 8, PS)
    index.apply(URLS[1], BlockStored(orphan, 12345, None, PS, None, "GPU"))  # no tokens, unknown parent
    assert blocks(index) == 6 and index.stats()["index_hash_keyed_blocks"] == 2
    assert index.stats()["index_evicted_blocks"] == 2
    assert prefix(index, [5] * 8) == {URLS[0]: (8, 0, 0)} and set(index._where) == set(placed)


def test_speculative_entries_on_an_evicted_run_expire_quietly():
    index = BlockIndex(speculative_ttl_s=5.0, max_blocks=4)
    tokens = [9] * 8
    index.match(req(tokens, rid="x"), WORKERS)
    index.record(req(tokens, rid="x"), WORKERS[0])  # pages known only speculatively
    assert index.speculative_pages() == 4
    store(index, URLS[1], tokens)  # the same pages, reported: the run now has names
    store(index, URLS[2], [8] * 8)  # over the budget: the older run goes, speculative bits too
    assert prefix(index, tokens) == {} and index.speculative_pages() == 0
    index.expire(now=float("inf"))
    assert prefix(index, [8] * 8) == {URLS[2]: (8, 0, 0)}


def test_no_budget_keeps_everything():
    index = BlockIndex(speculative_ttl_s=0)
    for k in range(20):
        store(index, URLS[k % 5], [k] * 8)
    assert blocks(index) == 80 and index.stats()["index_evicted_blocks"] == 0 and index._lru is None


spec_ops = st.lists(st.tuples(st.sampled_from(["store", "record", "expire", "remove", "clear"]), st.integers(0, 4), seqs,
                              st.integers(0, 8)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(spec_ops, st.integers(3, 12))
def test_eviction_order_holds_only_live_runs_with_speculative_entries(operations, budget):
    """Stores, speculative records, expiries, removals and clears interleaved under a budget: the
    eviction order never holds a run that left the trie, and once every worker is cleared and
    every speculative entry expired, nothing is left (no run, no order entry)."""
    index = BlockIndex(speculative_ttl_s=1.0, max_blocks=budget)
    for n, (op, w, tokens, cut) in enumerate(operations):
        url = URLS[w]
        if op == "store":
            store(index, url, tokens, cut)
        elif op == "record":
            request = req(tokens, rid=f"r{n}")
            index.match(request, WORKERS)
            index.record(request, WORKERS[w])
        elif op == "expire" and index._spec_queue:  # the oldest record's entries
            index.expire(now=index._spec_queue[0][0])
        elif op == "clear":  # AllBlocksCleared, a reconnect or a lost gap
            index.clear_worker(url)
        elif op == "remove":
            index.apply(url, BlockRemoved(page_hashes(tokens, PS)[cut // 2:], "GPU"))
        assert blocks(index) <= budget
        assert set(index._lru) <= reachable(index) and branches_hang_on_pages(index)
    for url in URLS:
        index.clear_worker(url)
    index.expire(now=float("inf"))
    assert not index._roots and not index._lru and not index._where


def test_eviction_takes_only_what_a_store_pushed_over_deepest_first():
    """A long conversation at the front of the order loses one page per page stored, from its
    end: the work per event stays the event's size, not the run's."""
    index = BlockIndex(speculative_ttl_s=0, max_blocks=200)
    long = [3] * 400  # 200 pages
    store(index, URLS[0], long)
    for k in range(1, 6):
        store(index, URLS[1], [100 + k] * 2)  # one new page each (no match in between: that is use)
        assert index.evicted == k and blocks(index) == 200
    assert prefix(index, long) == {URLS[0]: (390, 0, 0)}
    assert all(prefix(index, [100 + k] * 2) == {URLS[1]: (2, 0, 0)} for k in range(1, 6))
