"""Size the approximate tree to what the engines can actually hold.

An approximate index that remembers more than the engines cache keeps routing follow-ups
to workers that evicted them long ago (sglang-router's tree allows 2^26 characters per
worker): the "hit" is gone, and the load it concentrates is real. With
``max_tree_size=auto`` the one global budget follows the fleet's KV capacity (the default
is a fixed 2^24 units, which measured better on the conversation trace; see
``index.build.make_radix``): the sum of every worker's ``max_total_num_tokens`` (from ``/server_info``, or
the engine load report), times the index units per token (1 for token keys; for text,
characters per token learned from the engines' ``prompt_tokens``). A fixed number keeps
the budget fixed. Until a capacity is known the fallback budget applies.

The units per token are learned from completed requests: a text key's length over the
engine's ``prompt_tokens`` (~4 for BPE, 1 for the simulator's byte tokenizer), a token key's
length over it (~1).
"""

from __future__ import annotations

from index.views import Outcome, RequestView, WorkerView
from index.radix import RadixIndex

DEFAULT_UNITS_PER_TOKEN = 4.0  # characters per BPE token in English; learned from outcomes


def worker_capacity(worker: WorkerView) -> int:
    cap = worker.server_info.get("max_total_num_tokens")
    if not cap and worker.load is not None:
        cap = worker.load.max_tokens
    try:
        return int(cap or 0)
    except (TypeError, ValueError):
        return 0


class TreeBudget:
    """The tree's unit budget: the fleet's KV capacity (``worker_changed``/``worker_removed``
    keep it) times the learned units per token (``learn``)."""

    def __init__(self, tree: RadixIndex, option: object = "auto", fallback: int = 1 << 24) -> None:
        self.tree = tree
        self.auto = option in (None, "auto")
        self.fallback = int(fallback)
        self.tree.max_units = self.fallback if self.auto else int(option)  # type: ignore[arg-type]
        self.units_per_token = DEFAULT_UNITS_PER_TOKEN
        self.capacity_tokens = 0
        self._capacity: dict[str, int] = {}  # per worker url

    def worker_changed(self, worker: WorkerView) -> None:
        """A worker joined or reported anew: re-read its capacity."""
        if self.auto:
            self._capacity[worker.url] = worker_capacity(worker)
            self._refit()

    def worker_removed(self, url: str) -> None:
        if self._capacity.pop(url, None) is not None:
            self._refit()

    def _refit(self) -> None:
        self.capacity_tokens = sum(self._capacity.values())
        self._apply()

    def learn(self, request: RequestView, outcome: Outcome) -> None:
        """Index units per engine token, from the requests the engine reported on."""
        if not self.auto or not outcome.prompt_tokens:
            return
        tokens_keyed = request.token_ids is not None and (self.tree.key_mode != "text" or request.text is None)
        units = len(request.token_ids) if tokens_keyed else len(request.text or "")  # type: ignore[arg-type]
        if units:
            self.units_per_token += 0.05 * (units / outcome.prompt_tokens - self.units_per_token)
            if self.capacity_tokens:
                self._apply()

    def _apply(self) -> None:
        if not self.capacity_tokens:
            self.tree.max_units = self.fallback
            return
        self.tree.max_units = max(int(self.capacity_tokens * self.units_per_token), 1)

    def stats(self) -> dict[str, float]:
        return {"index_fleet_capacity_tokens": float(self.capacity_tokens),
                "index_units_per_token": self.units_per_token}
