"""The routing state a policy reads: which prompt prefixes sit on which worker, in which tier.

``views``: the request and worker snapshots every layer shares. ``prefix``: the index
protocol (``PrefixIndex``, ``IndexMatch``, ``Tiers``). ``radix``: the approximate tree the
gateway builds from its own decisions; ``block_index``: the precise index the engines' KV
events build, over its parts ``worker_slots``, ``block_places``, ``hash_keyed``,
``speculative``, ``block_budget`` and ``block_masks``; ``kv_feed``: the ZMQ subscription
that feeds it; ``fallback``: precise where it can be, approximate otherwise; ``build``: both
built from policy options.
"""
