"""The indexes built from policy options, so that no policy builds another policy's index.

``make_radix``: the approximate tree with the budget that sizes it. ``precise_index``: the
KV-event block index behind its text fallback, with the feed that keeps it current. Their
options are dataclasses (``RadixOptions``, ``PreciseOptions``) that a policy's own options
extend, so one flat ``--policy-option key=value`` namespace reaches both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from index.block_index import BlockIndex
from index.fallback import PreciseOrApprox
from index.kv_feed import KvEventFeed, parse_endpoints
from index.radix import RadixIndex
from index.tree_budget import TreeBudget
from wire.options import on_off, opt

# ~360 bytes a block with 64 workers when built, ~700 once churned at the budget
# (bench/micro/index_budget.py), so 1.4-2.8 GiB; an SGLang fleet at page size 1 reports a block
# per token and can reach it.
DEFAULT_MAX_INDEX_BLOCKS = 1 << 22
# Fixed by default: a budget sized to the fleet's KV ("auto") forgot conversations the
# engines still held on the conversation trace (hit 0.111 vs 0.134, mean TTFT 3.16 vs 2.21 s).
DEFAULT_MAX_TREE_SIZE = 1 << 24


def _units_or_auto(value: Any) -> int | str:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("auto", "none", "")):
        return "auto"
    number = float(value)
    if not number.is_integer() or number < 0:
        raise ValueError("expected a whole number of units or 'auto'")
    return int(number)


def _endpoints(value: Any) -> Any:
    parse_endpoints(value)  # refuse a malformed mapping when the options are read
    return value


@dataclass
class RadixOptions:
    """The approximate tree (``index.radix``)."""

    key: str = opt("auto", "tree key: token ids when the request has them, else text (auto, tokens), or always text",
                    choices=("auto", "tokens", "text"))
    max_age_s: float = opt(0.0, "forget entries older than this (0: only the memory budget forgets)")
    max_tree_size: int | str = opt(DEFAULT_MAX_TREE_SIZE, "the tree's memory budget in tenant-units for the whole "
                                    "fleet; 'auto' follows the engines' KV capacity", parse=_units_or_auto)


@dataclass
class PreciseOptions:
    """The precise block index and its KV-event feed (``index.block_index``, ``index.kv_feed``)."""

    kv_endpoints: Any = opt(None, "worker URL -> ZMQ endpoint or {endpoint, replay_endpoint, topic} (JSON); "
                             "default: each worker's server_info kv_events", parse=_endpoints)
    page_size: int = opt(1, "page size when a worker's server_info lacks it")
    speculative_ttl_s: float = opt(3.0, "how long a routed request's pages count as cached before its events arrive")
    shared_pool: bool = opt(True, "pages in the Mooncake pool count for every worker", parse=on_off)
    max_index_blocks: int = opt(DEFAULT_MAX_INDEX_BLOCKS, "the precise index's memory budget in blocks (0: none)")
    replay_timeout_s: float = opt(2.0, "how long to wait for a gap's replay before clearing that worker")
    kv_slice_ms: float = opt(0.5, "event work per turn of the event loop before requests run")


def make_radix(options: RadixOptions, key: str | None = None) -> tuple[RadixIndex, TreeBudget]:
    """The approximate tree from policy options, with the budget that sizes it."""
    tree = RadixIndex(key=key or options.key, max_age_s=options.max_age_s)
    return tree, TreeBudget(tree, options.max_tree_size)


def precise_index(options: Any, owner: str, quiet: bool = False) -> tuple[PreciseOrApprox, KvEventFeed, TreeBudget]:
    """The precise index with its text fallback and the feed that keeps it current
    (``options``: ``RadixOptions`` and ``PreciseOptions`` in one object; ``quiet``: a fleet
    without KV events is expected, say so at INFO only)."""
    precise = BlockIndex(default_page_size=options.page_size, speculative_ttl_s=options.speculative_ttl_s,
                         shared_pool=options.shared_pool, max_blocks=options.max_index_blocks)
    feed = KvEventFeed(precise, parse_endpoints(options.kv_endpoints), replay_timeout_s=options.replay_timeout_s,
                       quiet=quiet, slice_ms=options.kv_slice_ms)
    tree, budget = make_radix(options, key="text")
    return PreciseOrApprox(precise, tree, owner, fed=feed.feeds_any, quiet=quiet), feed, budget
