"""Pages in the Mooncake pool count for every worker attached to it, not only the announcer."""

from __future__ import annotations

import pytest

from policies.base import RequestView, WorkerView
from index.block_index import BlockIndex
from index.prefix import Tiers
from wire.hashing import page_hashes
from wire.kv_events import BlockRemoved, BlockStored

PS = 4
TOKENS = list(range(100, 132))  # 8 pages
HASHES = page_hashes(TOKENS, PS)


def workers() -> list[WorkerView]:
    return [WorkerView(url=u, server_info={"page_size": PS}) for u in ("http://a:1", "http://b:1")]


def request() -> RequestView:
    return RequestView(request_id="r", route="/generate", token_ids=TOKENS)


def stored(hashes, medium, parent=None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[], block_size=PS, medium=medium)


def test_pool_pages_extend_every_workers_prefix():
    index = BlockIndex(default_page_size=PS)
    a, b = workers()
    index.slot(b.url)
    index.apply_batch(a.url, [stored(HASHES[:3], "GPU"), stored(HASHES[:6], "EXTERNAL")])
    match = index.match(request(), [a, b])
    assert match.get(a.url) == Tiers(gpu=3 * PS, host=0, pool=3 * PS)  # its own GPU pages, then the pool
    assert match.get(b.url) == Tiers(gpu=0, host=0, pool=6 * PS)  # never announced them, loads them all
    # said once for the fleet: only the worker holding more is listed
    assert match.everyone == Tiers(pool=6 * PS) and list(match.hits) == [a.url]


def test_a_worker_new_to_the_index_can_load_the_pool_too():
    """A worker that has neither published an event nor been routed to yet (one that just
    joined) is attached to the same pool: it is credited with the pool's pages like the
    rest, so a fresh worker is a candidate for pooled prompts from its first decision."""
    index = BlockIndex(default_page_size=PS)
    a, b = workers()
    index.apply_batch(a.url, [stored(HASHES[:3], "GPU"), stored(HASHES[:6], "EXTERNAL")])
    match = index.match(request(), [a, b])
    assert match.get(a.url) == Tiers(gpu=3 * PS, host=0, pool=3 * PS)
    assert match.get(b.url) == Tiers(pool=6 * PS) and match.everyone == Tiers(pool=6 * PS)
    assert BlockIndex(default_page_size=PS, shared_pool=False).match(request(), [a, b]).get(b.url) == Tiers()


def test_pool_eviction_announced_by_any_engine_removes_the_page_for_all():
    index = BlockIndex(default_page_size=PS)
    a, b = workers()
    index.slot(b.url)
    index.apply_batch(a.url, [stored(HASHES[:6], "EXTERNAL")])
    index.apply_batch(b.url, [BlockRemoved(block_hashes=[HASHES[2]], medium="EXTERNAL")])
    match = index.match(request(), [a, b])
    assert match.get(a.url).pool == match.get(b.url).pool == 2 * PS  # the chain breaks at the evicted page


@pytest.mark.parametrize("shared", [True, False])
def test_unshared_pools_stay_per_worker(shared):
    index = BlockIndex(default_page_size=PS, shared_pool=shared)
    a, b = workers()
    index.slot(b.url)
    index.apply_batch(a.url, [stored(HASHES[:5], "EXTERNAL")])
    match = index.match(request(), [a, b])
    assert match.get(a.url).pool == 5 * PS
    assert match.get(b.url).pool == (5 * PS if shared else 0)
