"""The approximate radix index against brute force, and its global budget."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import RequestView, WorkerView
from index.radix import RadixIndex

TENANTS = [f"http://w{i}" for i in range(4)]
WORKERS = [WorkerView(u) for u in TENANTS]


def req(text: str | None = None, tokens: list[int] | None = None, salt: str | None = None) -> RequestView:
    return RequestView("r", "/generate", text=text, token_ids=tokens, cache_salt=salt)


def lcp(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def brute(inserted: list[tuple[str, str]], query: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for text, url in inserted:
        n = lcp(text, query)
        if n > out.get(url, 0):
            out[url] = n
    return out


def check_invariants(index: RadixIndex) -> None:
    """Children hold subsets of their parent's tenants; the unit counters match the tree."""
    units = 0
    per_tenant: dict[str, int] = {}
    nodes = 0
    stack = list(index.root.children.values())
    while stack:
        node = stack.pop()
        nodes += 1
        assert node.tenants, "a node without tenants must have been deleted"
        if node.parent is not index.root:
            assert node.tenants.keys() <= node.parent.tenants.keys()
        for url in node.tenants:
            units += len(node.key)
            per_tenant[url] = per_tenant.get(url, 0) + len(node.key)
        stack.extend(node.children.values())
    assert units == index.units
    assert nodes == index.nodes
    assert all(index.worker_size(u) == n for u, n in per_tenant.items())


texts = st.text(alphabet="abc", min_size=0, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(texts, st.sampled_from(TENANTS)), max_size=25), st.lists(texts, min_size=1, max_size=6))
def test_match_equals_brute_force_longest_common_prefix(inserts, queries):
    index = RadixIndex(max_units=1 << 30, key="text")
    for text, url in inserts:
        index.record(req(text), WorkerView(url))
    check_invariants(index)
    for q in queries:
        match = index.match(req(q), WORKERS)
        got = {w.url: match.get(w.url).gpu for w in WORKERS if match.get(w.url).gpu}
        assert got == brute(inserts, q)
        assert index.match(req(q), WORKERS).query_len == len(q)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="abcd", max_size=30), st.sampled_from(TENANTS)), min_size=1, max_size=60),
       st.integers(min_value=10, max_value=80))
def test_budget_bounds_memory_and_keeps_the_latest_insert(inserts, budget):
    index = RadixIndex(max_units=budget, key="text")
    prefix = len("\x00s\x00")  # the namespace key every text key carries
    for text, url in inserts:
        index.record(req(text), WorkerView(url))
        assert index.units <= budget
        check_invariants(index)
    text, url = inserts[-1]
    if len(text) + prefix <= budget * index.low_water:
        # The most recently used path is the last thing LRU eviction would take.
        assert index.match(req(text), [WorkerView(url)]).get(url).gpu == len(text)


def test_eviction_takes_the_least_recently_used_tenant_leaf_first():
    index = RadixIndex(max_units=10_000, key="text")
    a, b = WorkerView(TENANTS[0]), WorkerView(TENANTS[1])
    index.record(req("shared-prefix/A-tail"), a)
    index.record(req("shared-prefix/B-tail"), b)
    index.record(req("shared-prefix/A-tail"), a)  # A is now more recent than B
    index.max_units = index.units - 1
    index._evict_to(index.max_units)
    match = index.match(req("shared-prefix/B-tail"), [a, b])
    assert match.get(a.url).gpu == len("shared-prefix/")  # A keeps its path, B lost its leaf
    assert match.get(b.url).gpu == len("shared-prefix/")
    assert not match.hits and match.everyone.gpu == len("shared-prefix/")  # said once for both
    assert index.match(req("shared-prefix/A-tail"), [a]).get(a.url).gpu == len("shared-prefix/A-tail")
    check_invariants(index)


def test_budget_is_global_across_workers():
    index = RadixIndex(max_units=2_000, key="text")
    for i in range(200):
        index.record(req(f"conversation {i} " + "x" * 50), WORKERS[i % 4])
    assert index.units <= 2_000
    assert index.evicted_units > 0
    assert sum(index.worker_size(u) for u in TENANTS) == index.units


def test_remove_worker_and_age_eviction():
    index = RadixIndex(max_units=1 << 20, key="text", max_age_s=10)
    index.insert_key("\x00s\x00old text", TENANTS[0], now=100.0)
    index.insert_key("\x00s\x00new text", TENANTS[1], now=200.0)
    index.insert_key("\x00s\x00old text too", TENANTS[2], now=200.0)
    index.maintain(now=205.0)
    hits = index.match(req("old text too"), WORKERS).hits
    assert TENANTS[0] not in hits and hits[TENANTS[2]].gpu == len("old text too")
    index.remove_worker(TENANTS[2])
    assert index.worker_size(TENANTS[2]) == 0
    assert TENANTS[2] not in index.match(req("old text too"), WORKERS).hits
    check_invariants(index)


def test_token_ids_salt_and_text_do_not_share_prefixes():
    index = RadixIndex(key="auto")
    w = WORKERS[0]
    index.record(req("hello world", tokens=[104, 101, 108, 108, 111]), w)
    assert index.match(req(tokens=[104, 101, 108, 999]), WORKERS).hits[w.url].gpu == 3
    assert index.match(req(tokens=[104, 101, 108, 999]), WORKERS).unit == "tokens"
    assert not index.match(req("hello world"), WORKERS).hits  # token key, not text
    assert not index.match(req(tokens=[104, 101, 108], salt="s"), WORKERS).hits
    index.record(req(tokens=[10**7, 5]), w)  # ids past the code point range still index
    assert index.match(req(tokens=[10**7, 5, 6]), WORKERS).hits[w.url].gpu == 2


def test_token_keys_take_the_packed_ids_and_pack_a_request_once(monkeypatch):
    """Ids packed already (the gateway's tokenizer) key the tree as the ids do; a request
    matched again after another (held, then decided again) is not packed again."""
    import index.views as base

    packs = []
    real = base.uint32_le
    monkeypatch.setattr(base, "uint32_le", lambda ids: packs.append(len(ids)) or real(ids))
    index = RadixIndex(key="auto")
    w = WORKERS[0]
    index.record(RequestView("a", "/generate", token_ids=[5, 6, 7, 8], packed_ids=real([5, 6, 7, 8])), w)
    assert packs == []
    held = RequestView("held", "/generate", token_ids=[5, 6, 7, 9, 10])
    other = RequestView("other", "/generate", token_ids=[5, 6, 1])
    assert index.match(held, WORKERS).hits[w.url].gpu == 3
    assert index.match(other, WORKERS).hits[w.url].gpu == 2
    assert index.match(held, WORKERS).hits[w.url].gpu == 3
    assert packs == [5, 3]
    # Packed ids that are not these ids (another length) are not trusted.
    stale = RequestView("stale", "/generate", token_ids=[5, 6, 7, 8, 1], packed_ids=real([9, 9]))
    assert index.match(stale, WORKERS).hits[w.url].gpu == 4


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.text("ab", min_size=1, max_size=12), st.integers(0, 3), st.booleans()),
                min_size=1, max_size=20))
def test_a_retracted_insert_leaves_the_tree_as_the_others_made_it(ops):
    """Each insert may be withdrawn right after it (its request went elsewhere): the tree then
    answers as if only the kept inserts had been made, and stays consistent."""
    index = RadixIndex(max_units=1 << 20)
    kept: list[tuple[str, str]] = []
    for i, (text, tenant, withdrawn) in enumerate(ops):
        request = RequestView(f"r{i}", "/generate", text=text)
        index.record(request, WORKERS[tenant])
        if withdrawn:
            index.retract(request, WORKERS[tenant])
        else:
            kept.append((text, TENANTS[tenant]))
        check_invariants(index)
    for text, _, _ in ops:
        match = index.match(req(text), WORKERS)
        got = {w.url: match.get(w.url).gpu for w in WORKERS if match.get(w.url).gpu}
        assert got == brute(kept, text)
