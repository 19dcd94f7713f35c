"""``kv_events``: the cache_aware rule on what the engines *report* they cache.

Each worker's SGLang KV-event stream (``--kv-events-config``) feeds a precise block index
(``index.block_index`` via ``index.kv_feed``), so matches reflect the engines' real
radix caches, evictions and HiCache tiers instead of a guess. Requests need token ids to be
hashed the way the engine does; those that arrive as text only are matched on an
approximate text tree that learns from the decisions it makes (counted as fallbacks in
stats; ``index.fallback``).

Options beyond ``cache_aware``'s: ``kv_endpoints`` (worker URL -> endpoint or
``{endpoint, replay_endpoint, topic}``; default: each worker's ``server_info["kv_events"]``),
``page_size`` (when server_info lacks it), ``speculative_ttl_s``, ``replay_timeout_s``,
``max_index_blocks`` (the precise index's memory budget, in blocks; 0: none), ``kv_slice_ms``
(event work per turn of the gateway's loop before the feed lets requests run, default 0.5).
"""

from __future__ import annotations

from collections.abc import Mapping

from dataclasses import dataclass

from index.build import PreciseOptions, precise_index
from index.prefix import PrefixIndex
from index.tree_budget import TreeBudget
from policies.base import WorkerView
from policies.cache_aware import CacheAware, CacheAwareOptions


@dataclass
class KvEventsOptions(CacheAwareOptions, PreciseOptions):
    """cache_aware's options and the precise index's."""

class KvEvents(CacheAware):
    name = "kv_events"
    Options = KvEventsOptions

    def build_index(self) -> tuple[PrefixIndex, TreeBudget]:
        index, self.feed, budget = precise_index(self.opts, self.name)
        return index, budget

    def on_worker_added(self, worker: WorkerView) -> None:
        self.feed.add(worker)
        super().on_worker_added(worker)

    def on_worker_updated(self, worker: WorkerView) -> None:
        self.feed.update(worker)
        super().on_worker_updated(worker)

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
