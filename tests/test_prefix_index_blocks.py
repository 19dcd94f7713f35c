"""The precise block index against a naive per-worker set of chains."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import RequestView, WorkerView
from index.block_index import BlockIndex
from wire.hashing import page_hashes
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

PS = 2
URLS = [f"http://127.0.0.1:{9000 + i}" for i in range(5)]
WORKERS = [WorkerView(u, server_info={"page_size": PS}) for u in URLS]
MEDIUMS = ["GPU", "CPU_PINNED", "EXTERNAL"]


def req(tokens, salt=None, rid="r"):
    return RequestView(rid, "/generate", token_ids=list(tokens), cache_salt=salt)


def naive(held: dict[str, set[tuple[int, int]]], chain: list[int]) -> dict[str, tuple[int, int, int]]:
    """For each worker: longest prefix with every page on GPU / on GPU or host / anywhere."""
    out = {}
    for url, blocks in held.items():
        lens = []
        for tiers in ({0}, {0, 1}, {0, 1, 2}):
            n = 0
            while n < len(chain) and any((chain[n], t) in blocks for t in tiers):
                n += 1
            lens.append(n)
        if lens[2]:
            out[url] = (lens[0] * PS, (lens[1] - lens[0]) * PS, (lens[2] - lens[1]) * PS)
    return out


def held_by(match, workers) -> dict[str, tuple[int, int, int]]:
    """Each worker's prefix from a match, listed or through ``everyone`` (the shared pool)."""
    return {w.url: tuple(match.get(w.url)) for w in workers if match.get(w.url).total}


seqs = st.lists(st.integers(0, 2), min_size=0, max_size=10)
ops = st.lists(
    st.tuples(st.sampled_from(["store", "remove", "clear"]), st.sampled_from(URLS), seqs, st.integers(0, 2)),
    max_size=30,
)


@settings(max_examples=250, deadline=None)
@given(ops, st.lists(seqs, min_size=1, max_size=5))
def test_match_equals_naive_chains(operations, queries):
    index = BlockIndex(speculative_ttl_s=0, shared_pool=False)  # the naive model keeps pools per worker
    held: dict[str, set[tuple[int, int]]] = {u: set() for u in URLS}
    for op, url, tokens, tier in operations:
        hashes = page_hashes(tokens, PS)
        if op == "store":
            index.apply(url, BlockStored(hashes, None, tokens, PS, None, MEDIUMS[tier]))
            held[url] |= {(h, tier) for h in hashes}
        elif op == "remove":
            index.apply(url, BlockRemoved(hashes[len(hashes) // 2:], MEDIUMS[tier]))
            held[url] -= {(h, tier) for h in hashes[len(hashes) // 2:]}
        else:
            index.apply(url, AllBlocksCleared())
            held[url] = set()
    for tokens in queries:
        got = held_by(index.match(req(tokens), WORKERS), WORKERS)
        assert got == naive(held, page_hashes(tokens, PS))
    owned = {h for blocks in held.values() for h, _ in blocks}
    assert set(index._holders) == owned and set(index._where) == owned
    assert not index.stats()["index_hash_keyed_blocks"]  # every store carried its tokens
    for url in URLS:  # what nobody holds leaves the trie
        index.apply(url, AllBlocksCleared())
    assert not index._roots and not index._where and not index._holders


def test_sglang_test_vector_and_salt():
    index = BlockIndex()
    hashes = page_hashes([1, 2, 3, 4], 2)
    assert hashes == [3817746824117602890, -4216701448867210342]
    index.apply(URLS[0], BlockStored(hashes, None, [1, 2, 3, 4], 2))
    match = index.match(req([1, 2, 3, 4, 5]), WORKERS)
    assert match.hits[URLS[0]].gpu == 4 and match.query_len == 5
    assert not index.match(req([1, 2, 3, 4, 5], salt="tenant-a"), WORKERS).hits


def test_speculative_entries_expire_unless_confirmed():
    index = BlockIndex(speculative_ttl_s=5.0)
    tokens = [7, 8, 9, 10, 11, 12]
    index.record(req(tokens), WORKERS[1])
    assert index.match(req(tokens), WORKERS).hits[URLS[1]].gpu == 6
    index.expire(now=10**12)
    assert not index.match(req(tokens), WORKERS).hits
    index.record(req(tokens), WORKERS[1])
    index.apply(URLS[1], BlockStored(page_hashes(tokens[:4], PS), None, tokens[:4], PS))
    index.expire(now=10**12)
    assert index.match(req(tokens), WORKERS).hits[URLS[1]].gpu == 4


def test_clear_one_worker_keeps_the_others():
    index = BlockIndex()
    tokens = list(range(8))
    for url in URLS[:3]:
        index.apply(url, BlockStored(page_hashes(tokens, PS), None, tokens, PS))
    index.clear_worker(URLS[1])
    hits = index.match(req(tokens), WORKERS).hits
    assert set(hits) == {URLS[0], URLS[2]}
    index.remove_worker(URLS[0])
    assert set(index.match(req(tokens), WORKERS).hits) == {URLS[2]}
    assert index.worker_size(URLS[2]) == 4


def test_orphans_are_counted_and_page_sizes_differ_per_worker():
    index = BlockIndex()
    index.apply(URLS[0], BlockStored([111], 999, [1, 2], 2))
    assert index.orphans == 1
    tokens = list(range(16))
    w4 = WorkerView(URLS[3], server_info={"page_size": 4})
    index.apply(URLS[3], BlockStored(page_hashes(tokens, 4), None, tokens, 4))
    index.apply(URLS[2], BlockStored(page_hashes(tokens, 2)[:3], None, tokens[:6], 2))
    hits = index.match(req(tokens + [99]), [WORKERS[2], w4]).hits
    assert hits[URLS[3]].gpu == 16 and hits[URLS[2]].gpu == 6


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=90), min_size=1, max_size=6),
       st.sampled_from([1, 2, 4]), st.sampled_from([None, "salt"]))
def test_page_hash_cache_equals_wire_hashing(prompts, page_size, salt):
    from index.page_hash_cache import PageHashCache

    cache = PageHashCache(every=2, max_segments=8)
    grown = []
    for p in prompts:  # conversations grow: each prompt extends the previous one
        grown = grown + p
        for tokens in (grown, p):
            assert cache.hashes(tokens, page_size, salt) == page_hashes(tokens, page_size, salt)


def test_page_hash_cache_reuses_the_previous_turn():
    from index.page_hash_cache import PageHashCache

    cache = PageHashCache(every=4)
    turn1 = list(range(400))
    cache.hashes(turn1, 2)
    hashed = cache.pages_hashed
    turn2 = turn1 + [7] * 50
    assert cache.hashes(turn2, 2) == page_hashes(turn2, 2)
    assert cache.pages_hashed - hashed <= 25 + 4 and cache.pages_reused >= 196


def _reference_page_hashes(tokens, page_size, salt=None):
    """SGLang's chain transcribed literally (struct per page), to pin wire.hashing down."""
    import hashlib
    import struct

    prev = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest() if salt else None
    out = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        h.update(struct.pack(f"<{page_size}I", *tokens[start:start + page_size]))
        prev = h.digest()
        out.append(int.from_bytes(prev[:8], "big", signed=True))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.sampled_from([1, 2, 3, 16]),
       st.sampled_from([None, "", "tenant"]))
def test_wire_hashing_matches_the_literal_chain(tokens, page_size, salt):
    assert page_hashes(tokens, page_size, salt) == _reference_page_hashes(tokens, page_size, salt)


def test_speculative_pages_extend_reported_ones():
    """A follow-up recorded after its prefix was reported only adds the new pages; the
    walk must still see reported + speculative pages as one prefix."""
    index = BlockIndex(speculative_ttl_s=30)
    first = list(range(8))
    index.apply(URLS[0], BlockStored(page_hashes(first, PS), None, first, PS))
    follow_up = first + [50, 51, 52, 53]
    request = req(follow_up, rid="f")
    assert index.match(request, WORKERS).hits[URLS[0]].gpu == 8
    index.record(request, WORKERS[0])
    assert index.speculative_pages() == 2  # only the two new pages
    assert index.match(req(follow_up + [9], rid="g"), WORKERS).hits[URLS[0]].gpu == 12


def test_batches_decoded_without_token_ids_apply_like_full_ones():
    from wire.kv_events import BlockStoredRef, EventBatch, decode_batch, encode_batch

    tokens = list(range(8))
    events = [BlockStored(page_hashes(tokens, PS), None, tokens, PS, None, "cpu_pinned"),
              BlockRemoved(page_hashes(tokens, PS)[1:], "CPU_PINNED")]
    for legacy in (False, True):
        batch = decode_batch(encode_batch(EventBatch(1.0, events), legacy_arrays=legacy), tokens=False)
        assert isinstance(batch.events[0], BlockStoredRef if not legacy else BlockStored)
        index = BlockIndex()
        index.apply_batch(URLS[0], batch.events)
        assert tuple(index.match(req(tokens), WORKERS).hits[URLS[0]]) == (0, 2, 0)


def test_page_size_comes_from_the_events_when_server_info_lacks_it():
    index = BlockIndex(default_page_size=1)
    worker = WorkerView(URLS[0])  # discovery has not filled server_info yet
    tokens = list(range(16))
    assert index.page_size_of(worker) == 1
    index.apply(URLS[0], BlockStored(page_hashes(tokens, 8), None, tokens, 8))
    assert index.page_size_of(worker) == 8
    assert index.match(req(tokens), [worker]).get(URLS[0]).gpu == 16


def test_a_request_decided_again_is_not_packed_again(monkeypatch):
    """A held request is matched again after others were: the ids it packed the first time
    stay on the request, and the second match reads them (and still finds the same)."""
    import index.views as base

    packs = []
    real = base.uint32_le
    monkeypatch.setattr(base, "uint32_le", lambda ids: packs.append(len(ids)) or real(ids))
    index = BlockIndex(speculative_ttl_s=30)
    first = list(range(8))
    index.apply(URLS[0], BlockStored(page_hashes(first, PS), None, first, PS))
    held, other = req(first + [50, 51], rid="held"), req([1, 2, 3, 4], rid="other")
    before = index.match(held, WORKERS).hits
    index.match(other, WORKERS)
    assert index.match(held, WORKERS).hits == before and before[URLS[0]].gpu == 8
    assert packs == [10, 4]
    assert held.packed_ids == real(held.token_ids)
