"""The indexes built from policy options, so that no policy builds another policy's index.

``make_radix``: the approximate tree with the budget that sizes it. ``precise_index``: the
KV-event block index behind its text fallback, with the feed that keeps it current.
"""

from __future__ import annotations

from collections.abc import Mapping

from index.block_index import BlockIndex
from index.fallback import PreciseOrApprox
from index.kv_feed import KvEventFeed, parse_endpoints
from index.radix import RadixIndex
from index.tree_budget import TreeBudget


def make_radix(options: Mapping[str, object], key: str | None = None) -> tuple[RadixIndex, TreeBudget]:
    """The approximate tree from policy options, with the budget that sizes it."""
    tree = RadixIndex(key=key or str(options.get("key", "auto")), max_age_s=float(options.get("max_age_s", 0.0)))
    # Fixed by default: on the trace (bench/RESULTS.md, routing quality) a budget sized to
    # the fleet's KV ("auto") forgot conversations the engines still held: hit 0.111 vs
    # 0.134 and mean TTFT 3.16 vs 2.21 s for a 16M budget, back to back.
    return tree, TreeBudget(tree, options.get("max_tree_size", 1 << 24))


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
