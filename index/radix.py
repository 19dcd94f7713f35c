"""Approximate prefix index: one multi-tenant radix tree for the whole fleet.

The tree mirrors what each worker *probably* caches: every request routed to a worker is
inserted under that worker (a tenant). Nothing confirms it, so it is approximate, but it
needs no engine cooperation and works on plain text.

Why one global budget instead of sglang-router's per-tenant ``max_tree_size``: the router's
memory grows with the number of workers and its periodic eviction lets the tree overshoot
between passes. Here every (node, tenant) pair sits in one LRU list; an insert touches its
path leaf first, so a pair comes before its parent's pair for the same tenant and the front
of the list is (almost always, see ``_pop_leaf``) a tenant's leaf. Eviction pops it in O(1)
the moment an insert pushes the total over the budget. The budget counts *tenant-units* (a node's length once per
tenant holding it), which is what the mirrored caches hold in sum.

Keys are ``str``: text as is, token ids mapped one code point per id, so one compressed
trie with C-speed ``startswith`` serves both. A namespace prefix per (kind, cache_salt)
keeps salted and unsalted, text and token keys apart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from index.views import RequestView, SameUrls, WorkerView
from index.common_prefix import common_units
from index.prefix import IndexMatch, Tiers, Unit
from wire.hashing import uint32_le


class _Node:
    __slots__ = ("key", "children", "parent", "tenants")

    def __init__(self, key: str, parent: _Node | None, tenants: dict[str, float] | None = None) -> None:
        self.key = key
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.tenants: dict[str, float] = tenants if tenants is not None else {}


def _common_len(edge: str, key: str, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``key[pos:]``."""
    return common_units(key, pos, edge, 0, min(len(edge), len(key) - pos))


def tokens_key(token_ids: Sequence[int], packed: bytes | None = None) -> str:
    """One code point per token id, via a C-speed UTF-32 decode of the packed ids
    (``packed``: the same ids packed already)."""
    try:
        return (uint32_le(token_ids) if packed is None else packed).decode("utf-32-le", "surrogatepass")
    except (UnicodeDecodeError, OverflowError):  # ids past U+10FFFF: fold, collisions are harmless
        return "".join(chr(t % 0x110000) for t in token_ids)


class RadixIndex:
    """``PrefixIndex`` over text or token ids with one LRU budget for all workers.

    ``key``: ``text`` (always text), ``tokens`` (token ids when present, else text) or
    ``auto`` (same as ``tokens``). ``max_units``: the global budget in tenant-units.
    ``max_age_s``: optional age limit applied by ``maintain`` (the router's timer).
    """

    def __init__(self, max_units: int = 1 << 24, key: str = "auto", max_age_s: float = 0.0,
                 low_water: float = 0.95) -> None:
        self.max_units = int(max_units)
        self.key_mode = key
        self.max_age_s = float(max_age_s)
        self.low_water = float(low_water)
        self.unit: Unit = "chars"
        self.root = _Node("", None)
        self._lru: OrderedDict[tuple[_Node, str], None] = OrderedDict()
        self.units = 0
        self.nodes = 0
        self._tenant_units: dict[str, int] = {}
        self.evicted_units = 0
        self._recorded: OrderedDict[str, tuple[str, list[_Node]]] = OrderedDict()  # request id -> what it added
        self._last_key: tuple | None = None
        self._wanted_of = SameUrls()  # the workers the last match was for
        self._wanted: set[str] = set()  # and their urls

    # -- keys ---------------------------------------------------------------------------
    def _key(self, request: RequestView) -> tuple[str, int, Unit]:
        source = request.token_ids
        if source is None or (self.key_mode == "text" and request.text is not None):
            source = request.text
        last = self._last_key
        # select matches, then records, the same request: build its key once.
        if last is not None and last[0] == request.request_id and last[1] is source:
            return last[2]
        if source is not None and source is request.token_ids:
            prefix = f"\x00t{request.cache_salt or ''}\x00"
            got = (prefix + tokens_key(source, request.packed()), len(prefix), "tokens")
        else:
            prefix = f"\x00s{request.cache_salt or ''}\x00"
            got = (prefix + (source or ""), len(prefix), "chars")
        self._last_key = (request.request_id, source, got)
        return got

    def usable(self, request: RequestView) -> bool:
        return request.text is not None or request.token_ids is not None

    # -- lookups ------------------------------------------------------------------------
    def _walk(self, key: str) -> list[tuple[_Node, int]]:
        path: list[tuple[_Node, int]] = []
        node, pos, n = self.root, 0, len(key)
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                break
            edge = child.key
            if key.startswith(edge, pos):
                pos += len(edge)
                path.append((child, pos))
                node = child
            else:
                path.append((child, pos + _common_len(edge, key, pos)))
                break
        return path

    def match(self, request: RequestView, workers: Sequence[WorkerView]) -> IndexMatch:
        key, skip, unit = self._key(request)
        result = IndexMatch(len(key) - skip, unit)
        if self._wanted_of.changed(workers):
            self._wanted = set(self._wanted_of.urls)
        wanted = self._wanted
        hits = result.hits
        # Tenants only shrink going down a path, so the deepest node holding a tenant is
        # where its match ends; a node every candidate holds (a system prompt on the whole
        # fleet) is what all of them reuse, said once (64 entries cost ~30 us of a match).
        for node, end in reversed(self._walk(key)):
            if end <= skip:
                break
            held = node.tenants.keys() & wanted
            if len(held) == len(wanted):
                result.everyone = Tiers(end - skip)
                break
            for url in held:
                if url not in hits:
                    hits[url] = Tiers(end - skip)
        return result

    def match_key(self, key: str) -> dict[str, int]:
        """Per-tenant match of a raw key (tests and tools)."""
        out: dict[str, int] = {}
        for node, end in reversed(self._walk(key)):
            for url in node.tenants:
                out.setdefault(url, end)
        return out

    def worker_size(self, url: str) -> int:
        return self._tenant_units.get(url, 0)

    # -- updates ------------------------------------------------------------------------
    def record(self, request: RequestView, worker: WorkerView) -> None:
        key, _, _ = self._key(request)
        added = self.insert_key(key, worker.url)
        if added:
            self._recorded[request.request_id] = (worker.url, added)
            if len(self._recorded) > 4096:  # a retract follows its record within milliseconds
                self._recorded.popitem(last=False)

    def retract(self, request: RequestView, worker: WorkerView) -> None:
        """Take back what the request's last ``record`` on ``worker`` added (the nodes that
        did not hold ``worker`` before it), leaf first; a node that since holds ``worker``
        below it (another request's insert) keeps it."""
        found = self._recorded.get(request.request_id)
        if found is None or found[0] != worker.url:
            return
        del self._recorded[request.request_id]
        url = worker.url
        for node in found[1]:
            if url not in node.tenants or any(url in c.tenants for c in node.children.values()):
                continue
            self._lru.pop((node, url), None)
            self._evict_pair(node, url, counted=False)

    def insert_key(self, key: str, url: str, now: float | None = None) -> list[_Node]:
        """Insert ``key`` under ``url``; returns the nodes that did not hold ``url`` before, leaf first."""
        now = time.monotonic() if now is None else now
        lru = self._lru
        path: list[_Node] = []
        node, pos, n = self.root, 0, len(key)
        while pos < n:
            first = key[pos]
            child = node.children.get(first)
            if child is None:
                child = _Node(key[pos:], node)
                node.children[first] = child
                self.nodes += 1
                path.append(child)
                break
            edge = child.key
            if key.startswith(edge, pos):
                pos += len(edge)
            else:
                m = _common_len(edge, key, pos)
                mid = _Node(edge[:m], node, dict(child.tenants))
                node.children[first] = mid
                child.key = edge[m:]
                child.parent = mid
                mid.children[child.key[0]] = child
                self.nodes += 1
                for tenant in mid.tenants:  # behind the child's pairs (see _pop_leaf)
                    lru[(mid, tenant)] = None
                child = mid
                pos += m
            path.append(child)
            node = child
        added = 0
        new: list[_Node] = []
        for nd in reversed(path):  # leaf first, so every parent pair ends up behind its child
            pair = (nd, url)
            if url in nd.tenants:
                lru.move_to_end(pair)
            else:
                lru[pair] = None
                added += len(nd.key)
                new.append(nd)
            nd.tenants[url] = now
        if added:
            self.units += added
            self._tenant_units[url] = self._tenant_units.get(url, 0) + added
            if self.units > self.max_units:
                self._evict_to(int(self.max_units * self.low_water))
        return new

    def _evict_pair(self, node: _Node, url: str, counted: bool = True) -> None:
        del node.tenants[url]
        size = len(node.key)
        self.units -= size
        if counted:
            self.evicted_units += size
        left = self._tenant_units[url] - size
        if left:
            self._tenant_units[url] = left
        else:
            del self._tenant_units[url]
        if not node.tenants and node.parent is not None:
            # No tenant means no child either (children hold subsets of our tenants).
            del node.parent.children[node.key[0]]
            node.parent = None
            self.nodes -= 1

    def _pop_leaf(self) -> tuple[_Node, str]:
        """The least recently used pair, or a leaf under it for the same tenant. Splitting
        an edge appends the new upper node's pairs at the back, so the front can be an inner
        pair whose subtree is just as old; its deepest pair for that tenant goes first."""
        node, url = next(iter(self._lru))
        while True:
            child = next((c for c in node.children.values() if url in c.tenants), None)
            if child is None:
                break
            node = child
        del self._lru[(node, url)]
        return node, url

    def _evict_to(self, target: int) -> None:
        while self.units > target and self._lru:
            self._evict_pair(*self._pop_leaf())

    def remove_worker(self, url: str) -> None:
        # Rare (a worker leaves), so a scan is fine; deepest first keeps the tree consistent.
        def depth(node: _Node) -> int:
            d = 0
            while node.parent is not None:
                node, d = node.parent, d + 1
            return d

        for pair in sorted((p for p in self._lru if p[1] == url), key=lambda p: -depth(p[0])):
            del self._lru[pair]
            self._evict_pair(*pair)

    def maintain(self, now: float | None = None) -> None:
        if self.max_age_s <= 0:
            return
        cutoff = (time.monotonic() if now is None else now) - self.max_age_s
        while self._lru:
            node, url = next(iter(self._lru))
            if node.tenants[url] >= cutoff:
                break
            self._evict_pair(*self._pop_leaf())

    def stats(self) -> Mapping[str, float]:
        return {
            "index_units": self.units,
            "index_budget_units": self.max_units,
            "index_nodes": self.nodes,
            "index_pairs": len(self._lru),
            "index_evicted_units": self.evicted_units,
            "index_tenants": len(self._tenant_units),
        }
