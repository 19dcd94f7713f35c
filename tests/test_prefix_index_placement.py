"""The precise index, with blocks placed in its page trie by the events' tokens, against
SGLang's SHA chains.

Events may or may not carry token ids, chains arrive split over several events, salts
separate chains: whatever the mix, matches must be those of an index keyed by SHA hashes.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import index.block_places as block_places
from policies.base import RequestView, WorkerView
from index.block_index import BlockIndex
from index.page_hash_cache import PageHashCache
from tests.test_prefix_index_blocks import PS as BLOCKS_PS
from tests.test_prefix_index_blocks import held_by
from tests.test_prefix_index_blocks import naive as naive_held
from wire.hashing import page_hashes, uint32_le
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

PS = BLOCKS_PS  # the models share the page size
URLS = [f"http://127.0.0.1:{9100 + i}" for i in range(4)]
WORKERS = [WorkerView(u, server_info={"page_size": PS}) for u in URLS]
MEDIUMS = ["GPU", "CPU_PINNED", "EXTERNAL"]
SALTS = [None, "tenant"]


def req(tokens, salt=None, rid="r"):
    return RequestView(rid, "/generate", token_ids=list(tokens), cache_salt=salt)


def naive(held: dict[str, set[tuple[int, int]]], pool: set[int], chain: list[int]) -> dict[str, tuple]:
    """The block index tests' per-worker model (by SHA hash), plus the shared pool: every
    worker, whether it reported anything or not, reaches as far as the pool's leading pages
    when its own pages stop short."""
    pooled = 0
    while pooled < len(chain) and chain[pooled] in pool:
        pooled += 1
    out = naive_held(held, chain)
    for url in URLS:
        gpu, host, anywhere = out.get(url, (0, 0, 0))
        if pooled * PS > gpu + host + anywhere:
            out[url] = (gpu, host, pooled * PS - gpu - host)
    return out


def store_in_two_parts(index: BlockIndex, url: str, tokens: list[int], hashes: list[int], cut: int,
                       with_tokens: bool, medium: str, salt: str | None = None) -> None:
    """One chain as two BlockStored events, the second continuing from the first's last block
    (``cut`` pages in the first), with or without token ids."""
    cut = min(cut, len(hashes))
    for part, parent in ((slice(0, cut), None), (slice(cut, None), hashes[cut - 1] if cut else None)):
        if hashes[part]:
            part_tokens = tokens[part.start * PS: (part.start + len(hashes[part])) * PS] if with_tokens else []
            index.apply(url, BlockStored(hashes[part], parent, part_tokens, PS, None, medium, cache_salt=salt))


seqs = st.lists(st.integers(0, 2), min_size=0, max_size=10)
ops = st.lists(
    st.tuples(st.sampled_from(["store", "store", "remove", "clear"]), st.sampled_from(URLS), seqs,
              st.integers(0, 2), st.sampled_from(SALTS), st.booleans(), st.integers(0, 5)),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(st.tuples(seqs, st.sampled_from(SALTS)), min_size=1, max_size=5), st.booleans())
def test_page_keyed_index_matches_like_sha_chains(operations, queries, shared_pool):
    """Stores arrive as two events (the second continues from the first's last block), with
    or without token ids; salted and unsalted chains mix; removals hit any suffix."""
    index = BlockIndex(speculative_ttl_s=0, shared_pool=shared_pool)
    held: dict[str, set[tuple[int, int]]] = {}
    pool: set[int] = set()
    for op, url, tokens, tier, salt, with_tokens, cut in operations:
        hashes = page_hashes(tokens, PS, salt)
        pooled = tier == 2 and shared_pool
        if op == "store" and hashes:
            held.setdefault(url, set())
            store_in_two_parts(index, url, tokens, hashes, cut, with_tokens, MEDIUMS[tier], salt)
            if pooled:
                pool |= set(hashes)
            else:
                held[url] |= {(h, tier) for h in hashes}
        elif op == "remove":
            gone = hashes[cut % (len(hashes) + 1):]
            index.apply(url, BlockRemoved(gone, MEDIUMS[tier]))
            if pooled:
                pool -= set(gone)
            elif url in held:
                held[url] -= {(h, tier) for h in gone}
        else:
            index.apply(url, AllBlocksCleared())
            if url in held:
                held[url] = set()
    stored = [(tokens + [0], salt) for _, _, tokens, _, salt, _, _ in operations]  # what was reported
    for tokens, salt in queries + stored:
        got = held_by(index.match(req(tokens, salt), WORKERS), WORKERS)
        assert got == naive(held, pool, page_hashes(tokens, PS, salt))
    owned = {h for blocks in held.values() for h, _ in blocks}
    assert set(index._holders) == owned
    assert index.pool == pool
    assert set(index._where) | index._by_hash == owned | pool


def test_salts_separate_chains_whatever_the_engine_hashed_with():
    tokens = list(range(8))
    index = BlockIndex(default_page_size=PS)
    # Engine 0 hashes with the salt and says so; engine 1 hashes without it although the
    # request had one (its hashes then match unsalted prompts only, like the SHA chain).
    index.apply(URLS[0], BlockStored(page_hashes(tokens, PS, "a"), None, tokens, PS, cache_salt="a"))
    index.apply(URLS[1], BlockStored(page_hashes(tokens, PS), None, tokens, PS, cache_salt="a"))
    assert set(index.match(req(tokens, "a"), WORKERS).hits) == {URLS[0]}
    assert set(index.match(req(tokens), WORKERS).hits) == {URLS[1]}
    assert not index.match(req(tokens, "b"), WORKERS).hits
    # Engine 2 hashes with a salt it does not report: no key can be derived, the block stays
    # keyed by hash and still matches the salted prompt through the SHA chain.
    index.apply(URLS[2], BlockStored(page_hashes(tokens, PS, "c"), None, tokens, PS))
    assert index.stats()["index_hash_keyed_blocks"] == 4
    assert set(index.match(req(tokens, "c"), WORKERS).hits) == {URLS[2]}
    assert set(index.match(req(tokens, "a"), WORKERS).hits) == {URLS[0]}


def test_no_sha_at_decision_time_when_events_carry_tokens(monkeypatch):
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=30)
    tokens = list(range(40))
    index.apply(URLS[0], BlockStored(page_hashes(tokens, PS), None, tokens, PS))
    follow_up = tokens + [7] * 6

    def no_sha(*_a, **_k):
        raise AssertionError("SHA-256 computed at decision time")

    monkeypatch.setattr(block_places, "page_hashes", no_sha)
    monkeypatch.setattr(PageHashCache, "hashes", no_sha)
    request = req(follow_up, rid="f")
    assert index.match(request, WORKERS).hits[URLS[0]].gpu == 40
    index.record(request, WORKERS[1])
    assert index.match(req(follow_up, rid="g"), WORKERS).hits[URLS[1]].gpu == 46


def test_blocks_reported_by_hash_first_move_to_their_keys():
    tokens = list(range(12))
    hashes = page_hashes(tokens, PS)
    index = BlockIndex(default_page_size=PS)
    index.apply(URLS[0], BlockStored(hashes, None, [], PS, medium="CPU_PINNED"))  # no tokens
    index.apply(URLS[1], BlockStored(hashes[:3], None, [], PS, medium="EXTERNAL"))
    assert index.stats()["index_hash_keyed_blocks"] == 6
    assert tuple(index.match(req(tokens), WORKERS).hits[URLS[0]]) == (0, 12, 0)
    index.apply(URLS[2], BlockStored(hashes, None, tokens, PS))  # the same blocks, with tokens
    assert index.stats()["index_hash_keyed_blocks"] == 0
    match = index.match(req(tokens), WORKERS)
    assert tuple(match.get(URLS[0])) == (0, 12, 0) and tuple(match.get(URLS[2])) == (12, 0, 0)
    assert tuple(match.get(URLS[1])) == (0, 0, 6)  # the shared pool it announced
    index.apply(URLS[0], BlockRemoved(hashes, "CPU_PINNED"))  # removals name hashes only
    index.apply(URLS[1], BlockRemoved(hashes[:3], "EXTERNAL"))
    assert set(index.match(req(tokens), WORKERS).hits) == {URLS[2]}
    index.clear_worker(URLS[2])
    assert not index._holders and not index.pool and not index._where and not index._roots
    assert not index._roots  # the trie let go of every page


def test_a_child_of_an_unknown_parent_is_keyed_by_hash_until_it_goes():
    tokens = list(range(8))
    hashes = page_hashes(tokens, PS)
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=30)
    index.apply(URLS[0], BlockStored(hashes[2:], hashes[1], tokens[4:], PS))  # joined late
    assert index.stats()["index_hash_keyed_blocks"] == 2 and index.orphans == 1
    request = req(tokens, rid="x")
    assert not index.match(request, WORKERS).hits
    index.record(request, WORKERS[0])  # routed there: its first pages become speculative
    assert index.match(req(tokens, rid="y"), WORKERS).hits[URLS[0]].gpu == 8
    index.apply(URLS[0], BlockRemoved(hashes[2:]))
    assert index.stats()["index_hash_keyed_blocks"] == 0


@settings(max_examples=100, deadline=None)
@given(ops)
def test_hashes_that_disagree_with_their_tokens_only_mispredict(operations):
    """Hashes forced to collide (5 possible values, so one hash names pages of different
    tokens and chains cross): updates, walks and records must not fail, and once every
    worker is gone and every speculative entry expired only the pool's blocks remain."""
    index = BlockIndex(speculative_ttl_s=30)
    for op, url, tokens, tier, salt, with_tokens, cut in operations:
        hashes = page_hashes(tokens, PS, salt)
        hashes = hashes[:1] + [h % 5 for h in hashes[1:]]  # a real chain start, so pages get placed
        if op == "store":
            index.apply(url, BlockStored(hashes, None, tokens if with_tokens else [], PS, None,
                                         MEDIUMS[tier], cache_salt=salt))
        elif op == "remove":
            index.apply(url, BlockRemoved(hashes[cut % (len(hashes) + 1):], MEDIUMS[tier]))
        else:
            index.apply(url, AllBlocksCleared())
        request = req(tokens, salt, rid=f"{op}{cut}")
        index.match(request, WORKERS)
        index.record(request, WORKERS[cut % len(WORKERS)])
    index.expire(now=10**12)
    for url in URLS:
        index.remove_worker(url)
    assert not index._holders and index.speculative_pages() == 0
    assert set(index._where) | index._by_hash <= index.pool
    index.remove(URLS[0], list(index.pool), tier=2)
    assert not index._where and not index._by_hash and not index._roots  # every page let go


def _walked_page_by_page(index: BlockIndex, tokens: list[int]) -> dict[str, tuple]:
    """Every page's reported and speculative bits, found in the trie one page at a time
    (no run compared whole, no shortcut for runs of one mask)."""
    masks = []
    run, at, width = index._roots.get((PS, None)), 0, 4 * PS
    for start in range(0, len(tokens) - len(tokens) % PS, PS):
        if run is None:
            break
        page = uint32_le(tokens[start:start + PS])
        if not (at < len(run.masks) and bytes(run.key[at * width:(at + 1) * width]) == page):
            run, at = run.children.get(at, {}).get(page), 0
            if run is None:
                break
        masks.append(run.masks[at] | (run.spec[at] if run.spec else 0))
        at += 1
    out = {}
    for url in URLS:
        s = index._slots.get(url)
        if s is None:
            continue
        lens = []
        for t in range(3):
            n = 0
            while n < len(masks) and masks[n] >> (3 * s + t) & 1:
                n += 1
            lens.append(n)
        if lens[2]:
            out[url] = (lens[0] * PS, (lens[1] - lens[0]) * PS, (lens[2] - lens[1]) * PS)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["record", "record", "store", "expire", "clear"]),
                          st.integers(0, 3), seqs, st.integers(0, 3)), max_size=25),
       st.lists(seqs, min_size=1, max_size=4))
def test_runs_match_as_a_page_by_page_read(operations, queries):
    """Speculative pages grow runs and add children, stores confirm some, expiry and clears
    trim them: matches (whole-run comparisons, one AND per uniform run) must equal a
    page-by-page read of every page's bits."""
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=60)
    for i, (op, w, tokens, n) in enumerate(operations):
        if op == "record":
            request = req(tokens, rid=f"r{i}")
            index.match(request, WORKERS)  # as a policy does: the match decides what is new
            index.record(request, WORKERS[w])
        elif op == "store":
            index.apply(URLS[w], BlockStored(page_hashes(tokens, PS), None, tokens, PS))
        elif op == "expire":
            index.expire(now=10**12, limit=n)  # the n oldest records
        else:
            index.clear_worker(URLS[w])
    for tokens in queries:
        got = held_by(index.match(req(tokens, rid="q"), WORKERS), WORKERS)
        assert got == _walked_page_by_page(index, tokens)
    index.expire(now=10**12)
    assert index.speculative_pages() == 0 and not any(index._spec_runs.values())
    for url in URLS:
        index.clear_worker(url)
    assert not index._roots


def test_a_chain_start_with_ids_no_engine_hashes_stays_keyed_by_hash():
    index = BlockIndex(default_page_size=PS)
    index.apply(URLS[0], BlockStored([42], None, [2**40, -1], PS))  # must not raise
    assert index.stats()["index_hash_keyed_blocks"] == 1


CONVERSATIONS = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 2, 2, 1, 1, 0, 0, 2, 1],
                 [0, 1, 1, 1, 2, 0, 0, 2, 1, 2, 2, 2]]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "store", "store", "remove", "remove_one", "clear"]),
                          st.sampled_from(URLS), st.integers(0, 2), st.integers(0, 12), st.integers(0, 2),
                          st.integers(0, 6), st.booleans(), st.booleans()), max_size=40),
       st.booleans())
def test_workers_sharing_conversations_match_like_sha_chains(operations, shared_pool):
    """Few conversations, so workers hold overlapping prefixes: runs carry different masks
    page by page, chains diverge inside runs, single removals leave holes (a lost event)
    and whole runs empty out. Stores arrive in two parts, or as SGLang sends them (one
    batch, one page per event, which the index applies as one chain); matches must equal
    the model's."""
    index = BlockIndex(speculative_ttl_s=0, shared_pool=shared_pool)
    held: dict[str, set[tuple[int, int]]] = {}
    pool: set[int] = set()
    for op, url, conv, length, tier, cut, with_tokens, as_pages in operations:
        tokens = CONVERSATIONS[conv][:length]
        hashes = page_hashes(tokens, PS)
        pooled = tier == 2 and shared_pool
        if op == "store" and hashes:
            if as_pages:
                index.apply_batch(url, [BlockStored([h], hashes[j - 1] if j else None,
                                                    tokens[j * PS:(j + 1) * PS] if with_tokens else [], PS, None,
                                                    MEDIUMS[tier]) for j, h in enumerate(hashes)])
            else:
                store_in_two_parts(index, url, tokens, hashes, cut, with_tokens, MEDIUMS[tier])
            held.setdefault(url, set())
            if pooled:
                pool |= set(hashes)
            else:
                held[url] |= {(h, tier) for h in hashes}
        elif op in ("remove", "remove_one"):
            gone = hashes[cut:] if op == "remove" else hashes[cut:cut + 1]
            if as_pages:  # an eviction as SGLang reports it: leaf first, one page per event
                index.apply_batch(url, [BlockRemoved([h], MEDIUMS[tier]) for h in reversed(gone)])
            else:
                index.apply(url, BlockRemoved(gone, MEDIUMS[tier]))
            if pooled:
                pool -= set(gone)
            elif url in held:
                held[url] -= {(h, tier) for h in gone}
        elif op == "clear":
            index.apply(url, AllBlocksCleared())
            if url in held:
                held[url] = set()
        for conv_tokens in CONVERSATIONS:
            for n in (4, 12):
                got = held_by(index.match(req(conv_tokens[:n]), WORKERS), WORKERS)
                assert got == naive(held, pool, page_hashes(conv_tokens[:n], PS))
    for url in URLS:
        index.apply(url, AllBlocksCleared())
    index.apply(URLS[0], BlockRemoved(list(pool), "EXTERNAL"))
    assert not index._where and not index._by_hash and not index._roots  # nothing left behind


def test_a_dead_page_with_branches_after_it_stays_in_its_run():
    """A hole (a lost removal) under a branch: the dead page must keep its place, or a page
    of another chain appended there would inherit the branch."""
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=0)
    p0, p1, p2, q2, r1 = [0, 0], [1, 1], [2, 2], [3, 3], [4, 4]
    a, b, c = p0 + p1 + p2, p0 + p1 + q2, p0 + r1 + q2
    for url, tokens in ((URLS[0], a), (URLS[1], b)):
        index.apply(url, BlockStored(page_hashes(tokens, PS), None, tokens, PS))
    index.apply(URLS[0], BlockRemoved(page_hashes(a, PS)[1:]))
    index.apply(URLS[1], BlockRemoved(page_hashes(b, PS)[1:2]))  # p1 only: q2 stays, behind a hole
    index.apply(URLS[1], BlockStored(page_hashes(c, PS)[:2], None, c[:4], PS))
    hits = index.match(req(c), WORKERS).hits
    assert tuple(hits[URLS[1]]) == (4, 0, 0)  # p0 r1: its q2 follows p1, not r1
    assert tuple(hits[URLS[0]]) == (2, 0, 0)


def test_speculative_pages_refreshed_by_a_later_request_outlive_the_first():
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=5)
    tokens = list(range(8))
    index.record(req(tokens, rid="a"), WORKERS[0])
    first = index._spec_queue[0][0]
    index.speculative_ttl_s = 50
    index.record(req(tokens + [9, 9], rid="b"), WORKERS[0])
    index.expire(now=first + 1)  # the first record's time is up, not the second's
    assert index.match(req(tokens + [9, 9], rid="c"), WORKERS).hits[URLS[0]].gpu == 10
    index.expire(now=first + 100)
    assert not index.match(req(tokens, rid="d"), WORKERS).hits and not index._roots


def test_a_retracted_record_leaves_only_what_others_refreshed():
    """A choice withdrawn (the request went elsewhere) takes back its pages at once, but not
    those a later request recorded too, and its own expiry later clears nothing."""
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=30)
    tokens = list(range(8))
    index.record(req(tokens + [9, 9], rid="a"), WORKERS[0])
    index.record(req(tokens, rid="b"), WORKERS[0])
    index.retract(req(tokens + [9, 9], rid="a"), WORKERS[1])  # not where it was recorded: nothing
    assert index.match(req(tokens + [9, 9], rid="c"), WORKERS).hits[URLS[0]].gpu == 10
    index.retract(req(tokens + [9, 9], rid="a"), WORKERS[0])
    assert index.match(req(tokens + [9, 9], rid="c"), WORKERS).hits[URLS[0]].gpu == 8  # b's pages stay
    index.retract(req(tokens, rid="b"), WORKERS[0])
    assert not index.match(req(tokens, rid="d"), WORKERS).hits and not index._roots
    index.expire(now=index._spec_queue[-1][0] + 1)
    assert not index._spec_queue and not index._spec_runs.get(0)


def test_a_batch_joins_only_events_of_whole_pages():
    """One page per event is joined into one chain; an event whose token list is not whole
    pages is applied on its own, as it would be alone."""
    tokens = [5, 6, 7, 8, 9, 10]
    hashes = page_hashes(tokens, PS)
    odd = [BlockStored(hashes[:1], None, tokens[:3], PS), BlockStored(hashes[1:2], hashes[0], tokens[3:4], PS),
           BlockStored(hashes[2:], hashes[1], tokens[4:], PS)]
    alone, batched = BlockIndex(speculative_ttl_s=0), BlockIndex(speculative_ttl_s=0)
    for event in odd:
        alone.apply(URLS[0], event)
    batched.apply_batch(URLS[0], odd)
    for index in (alone, batched):
        assert index.match(req(tokens), WORKERS).hits[URLS[0]].gpu == 6  # the third page through its hash
        assert index.stats()["index_hash_keyed_blocks"] == 2


def test_a_speculative_entry_counts_only_while_its_worker_holds_the_pages_before_it():
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=30)
    tokens = list(range(4 * PS))
    hashes = page_hashes(tokens, PS)
    for url in URLS[:2]:
        index.apply(url, BlockStored(hashes, None, tokens, PS))
    follow = tokens + [7] * (2 * PS)
    request = req(follow, rid="f")
    index.match(request, WORKERS)
    index.record(request, WORKERS[0])  # anchored after the 4 pages it reported
    assert held_by(index.match(req(follow, rid="g"), WORKERS), WORKERS)[URLS[0]] == (6 * PS, 0, 0)
    index.apply(URLS[0], BlockRemoved(hashes[2:]))  # its engine evicted two (URLS[1] keeps them in the trie)
    assert held_by(index.match(req(follow, rid="h"), WORKERS), WORKERS) == {URLS[0]: (2 * PS, 0, 0),
                                                                          URLS[1]: (4 * PS, 0, 0)}


def test_speculative_entries_on_one_run_count_in_offset_order():
    """An entry recorded later but anchored earlier can make an older one reachable again."""
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=30)
    tokens = list(range(6 * PS))
    hashes = page_hashes(tokens, PS)
    index.apply(URLS[1], BlockStored(hashes, None, tokens, PS))  # keeps all six pages in the trie
    index.apply(URLS[0], BlockStored(hashes[:4], None, tokens[:4 * PS], PS))
    index.match(req(tokens, rid="a"), WORKERS)
    index.record(req(tokens, rid="a"), WORKERS[0])  # pages 4-5, anchored at 4
    index.apply(URLS[0], BlockRemoved(hashes[2:4]))  # now it holds 2: the entry is out of reach
    assert index.match(req(tokens, rid="b"), WORKERS).hits[URLS[0]].gpu == 2 * PS
    index.match(req(tokens[:4 * PS], rid="c"), WORKERS)
    index.record(req(tokens[:4 * PS], rid="c"), WORKERS[0])  # pages 2-3, anchored at 2
    assert index.match(req(tokens, rid="d"), WORKERS).hits[URLS[0]].gpu == 6 * PS


def test_a_worker_cleared_or_removed_loses_its_speculative_entries():
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=30)
    tokens = list(range(4 * PS))
    index.record(req(tokens, rid="a"), WORKERS[0])
    index.record(req(tokens, rid="b"), WORKERS[1])
    index.clear_worker(URLS[0])  # AllBlocksCleared, or a reconnect
    assert held_by(index.match(req(tokens, rid="c"), WORKERS), WORKERS) == {URLS[1]: (4 * PS, 0, 0)}
    index.remove_worker(URLS[1])
    newcomer = WorkerView("http://127.0.0.1:9999", server_info={"page_size": PS})
    assert index.slot(newcomer.url) in (0, 1)  # a freed slot, reused
    assert not index.match(req(tokens, rid="d"), [*WORKERS, newcomer]).hits
    assert index.speculative_pages() == 0 and not index._roots


def test_recording_pages_the_worker_holds_adds_nothing_to_the_trie():
    tokens = [1, 1, 2, 2]
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=30)
    index.apply(URLS[1], BlockStored(page_hashes(tokens, PS, "t"), None, [], PS, cache_salt="t"))  # by hash only
    request = req(tokens, "t", rid="a")
    assert index.match(request, WORKERS).hits[URLS[1]].gpu == 4
    index.record(request, WORKERS[1])
    assert not index._roots and index.speculative_pages() == 0


def test_a_batch_of_removals_keeps_each_events_medium():
    tokens = [5, 6, 7, 8]
    hashes = page_hashes(tokens, PS)
    index = BlockIndex(speculative_ttl_s=0)
    index.apply_batch(URLS[0], [BlockStored(hashes, None, tokens, PS, medium="GPU"),
                                BlockStored(hashes, None, tokens, PS, medium="CPU_PINNED")])
    assert tuple(index.match(req(tokens), WORKERS).hits[URLS[0]]) == (4, 0, 0)
    index.apply_batch(URLS[0], [BlockRemoved(hashes[1:], "GPU"), BlockRemoved(hashes[:1], "GPU"),
                                BlockRemoved(hashes[1:], "CPU_PINNED")])
    assert tuple(index.match(req(tokens), WORKERS).hits[URLS[0]]) == (0, 2, 0)


LONG = list(range(1000, 1000 + 400 * PS))  # one conversation of 400 pages: one run
spans = st.tuples(st.integers(0, 400), st.integers(0, 400), st.sampled_from([1, 1, 2, 3, 37]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "store", "remove", "record", "expire"]),
                          st.integers(0, 3), spans, st.integers(0, 2)), max_size=20),
       st.lists(st.integers(1, 400), min_size=1, max_size=4))
def test_a_long_run_cut_into_stretches_matches_page_by_page(operations, lengths):
    """Workers hold a 400-page conversation to different depths, with holes every page or
    every few (lost removals) and speculative tails: the run's masks come in stretches
    from one page to hundreds, read a stretch at a time or, past a few short ones, page by
    page. Matches must equal a page-by-page read."""
    index = BlockIndex(default_page_size=PS, speculative_ttl_s=60, shared_pool=False)  # (the read has no pool)
    hashes = page_hashes(LONG, PS)
    for i, (op, w, (a, b, stride), tier) in enumerate(operations):
        if op == "store" and b:
            index.apply(URLS[w], BlockStored(hashes[:b], None, LONG[:b * PS], PS, medium=MEDIUMS[tier]))
        elif op == "remove":
            index.apply(URLS[w], BlockRemoved(hashes[a:b:stride], MEDIUMS[tier]))
        elif op == "record" and b:
            request = req(LONG[:b * PS], rid=f"r{i}")
            index.match(request, WORKERS)
            index.record(request, WORKERS[w])
        elif op == "expire":
            index.expire(now=10**12, limit=1)
        index.match(req(LONG[:max(a, 1) * PS], rid=f"m{i}"), WORKERS)  # (learns how far runs are flat)
        _assert_flat_bounds(index)
    for n in lengths:
        got = held_by(index.match(req(LONG[:n * PS], rid="q"), WORKERS), WORKERS)
        assert got == _walked_page_by_page(index, LONG[:n * PS])


def _assert_flat_bounds(index: BlockIndex) -> None:
    """Every run's ``flat`` (``spec_flat``) leading pages do carry its first page's mask
    (speculative bits): a bound a write failed to lower would let a match skip a change."""
    runs = list(index._roots.values())
    while runs:
        run = runs.pop()
        runs += [child for kids in run.children.values() for child in kids.values()]
        assert run.flat <= len(run.masks) and run.masks[:run.flat].count(run.masks[0] if run.masks else 0) == run.flat
        if run.spec is not None:
            assert run.spec_flat <= len(run.spec) and run.spec[:run.spec_flat].count(run.spec[0]) == run.spec_flat
