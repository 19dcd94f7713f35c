"""``kv_events``: the cache_aware rule on what the engines *report* they cache.

Each worker's SGLang KV-event stream (``--kv-events-config``) feeds a precise block index
(``policies.block_index`` via ``policies.kv_feed``), so matches reflect the engines' real
radix caches, evictions and HiCache tiers instead of a guess. Requests need token ids to be
hashed the way the engine does; those that arrive as text only are matched on an
approximate text tree that learns from the decisions it makes (counted as fallbacks in
stats; ``policies.fallback_index``).

Options beyond ``cache_aware``'s: ``kv_endpoints`` (worker URL -> endpoint or
``{endpoint, replay_endpoint, topic}``; default: each worker's ``server_info["kv_events"]``),
``page_size`` (when server_info lacks it), ``speculative_ttl_s``, ``replay_timeout_s``,
``max_index_blocks`` (the precise index's memory budget, in blocks; 0: none), ``kv_slice_ms``
(event work per turn of the gateway's loop before the feed lets requests run, default 0.5).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.base import Choice, RequestView, WorkerView
from policies.block_index import BlockIndex
from policies.cache_aware import CacheAware, make_radix
from policies.fallback_index import PreciseOrApprox
from policies.kv_feed import KvEventFeed, parse_endpoints
from policies.tree_budget import TreeBudget

# ~360 bytes a block with 64 workers when built, ~700 once churned at the budget
# (bench/index_budget.py), so 1.4-2.8 GiB; an SGLang fleet at page size 1 reports a block
# per token and can reach it.
DEFAULT_MAX_INDEX_BLOCKS = 1 << 22


def precise_index(options: Mapping[str, object], owner: str,
                  quiet: bool = False) -> tuple[PreciseOrApprox, KvEventFeed, TreeBudget]:
    """The precise index with its text fallback and the feed that keeps it current
    (``quiet``: a fleet without KV events is expected, say so at INFO only)."""
    precise = BlockIndex(default_page_size=int(options.get("page_size", 1)),
                         speculative_ttl_s=float(options.get("speculative_ttl_s", 3.0)),
                         shared_pool=bool(options.get("shared_pool", True)),
                         max_blocks=int(options.get("max_index_blocks", DEFAULT_MAX_INDEX_BLOCKS)))
    feed = KvEventFeed(precise, parse_endpoints(options.get("kv_endpoints")),
                       replay_timeout_s=float(options.get("replay_timeout_s", 2.0)), quiet=quiet,
                       slice_ms=float(options.get("kv_slice_ms", 0.5)))
    tree, budget = make_radix(options, key="text")
    return PreciseOrApprox(precise, tree, owner, fed=feed.feeds_any, quiet=quiet), feed, budget


class KvEvents(CacheAware):
    name = "kv_events"

    def __init__(self, **options) -> None:
        index, self.feed, budget = precise_index(options, self.name)
        super().__init__(index=index, **options)
        self.budget = budget

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice:
        self.feed.follow(workers)
        return super().select(request, workers)

    def on_worker_added(self, worker: WorkerView) -> None:
        self.feed.add(worker)

    def on_worker_removed(self, worker: WorkerView) -> None:
        self.feed.remove(worker.url)
        super().on_worker_removed(worker)

    async def start(self) -> None:
        await self.feed.start()
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        await self.feed.stop()

    def stats(self) -> Mapping[str, float]:
        out = dict(super().stats())
        out.update(self.feed.stats())
        return out
