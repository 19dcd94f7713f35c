"""A page-granular radix prefix cache with a list of storage tiers.

Each trie node is one page of ``page_size`` tokens, keyed under its parent by SGLang's
page hash (the SHA-256 chain from ``wire.hashing``), so the key already commits to the
whole prefix and KV events come for free. A node lives in any subset of tiers
(``present`` bitmask): tier 0 is GPU memory, tier 1 the HiCache host pool, and further
tiers (a Mooncake Store pool) slot in by appending a ``Tier``.

Invariants kept by eviction (both checked by the tests against a brute-force model):
- tier 0 is prefix-closed: a page is on the device only if its parent is (leaf-first LRU
  eviction, never a page locked by a running request);
- the union of tiers is prefix-closed: a page is dropped entirely only if it has no
  children.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event

DEVICE = 0


@dataclass(slots=True)
class Tier:
    name: str  # device | host | storage
    capacity_tokens: int
    medium: str | None  # KV-event medium; None = this tier emits no events (like SGLang's L3)
    used_tokens: int = 0

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens


class Node:
    __slots__ = ("key", "parent", "children", "tokens", "present", "lock_ref", "last_access", "depth", "salt")

    def __init__(self, key: int | None, parent: Node | None, tokens: tuple[int, ...], depth: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.tokens = tokens
        self.present = 0
        self.lock_ref = 0
        self.last_access = 0.0
        self.depth = depth  # pages from the root
        self.salt: str | None = None  # the request's cache_salt, echoed in BlockStored

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, present={self.present:b}, lock={self.lock_ref})"


@dataclass(slots=True)
class Match:
    """The longest cached prefix: ``nodes[i]`` holds page i; ``per_tier[t]`` counts the pages
    served from tier t (the fastest tier holding each page)."""

    nodes: list[Node]
    per_tier: list[int]

    @property
    def pages(self) -> int:
        return len(self.nodes)

    @property
    def last(self) -> Node | None:
        return self.nodes[-1] if self.nodes else None


@dataclass
class RadixCache:
    page_size: int
    tiers: list[Tier]
    write_through: bool = True  # host tier mirrors device inserts (SGLang's default policy)
    clock: Callable[[], float] = lambda: 0.0
    events: list[Event] = field(default_factory=list)
    emit_events: bool = True

    def __post_init__(self) -> None:
        self.root = Node(None, None, (), 0)
        self.root.present = (1 << len(self.tiers)) - 1
        self.root.lock_ref = 1
        self._evictable: list[set[Node]] = [set() for _ in self.tiers]
        self.locked_tokens = 0

    # ---- queries -------------------------------------------------------------------
    def match(self, hashes: Sequence[int], touch: bool = True) -> Match:
        nodes: list[Node] = []
        per_tier = [0] * len(self.tiers)
        node = self.root
        now = self.clock()
        for h in hashes:
            child = node.children.get(h)
            if child is None or not child.present:
                break
            per_tier[(child.present & -child.present).bit_length() - 1] += 1
            if touch:
                child.last_access = now
            nodes.append(child)
            node = child
        return Match(nodes, per_tier)

    def evictable_tokens(self, tier: int = DEVICE) -> int:
        """Tokens the tier could free by repeated leaf eviction. Locked pages form an
        ancestor-closed set on the device, so everything else there is evictable."""
        if tier == DEVICE:
            return self.tiers[DEVICE].used_tokens - self.locked_tokens
        return self.tiers[tier].used_tokens

    # ---- mutation --------------------------------------------------------------------
    def insert(self, hashes: Sequence[int], tokens: Sequence[int], start: Node | None = None,
               salt: str | None = None) -> list[Node]:
        """Insert full pages onto the device; returns the path (existing + new nodes).

        Pages already present elsewhere (host) are promoted back to the device. The caller
        has made room in tier 0 (``evict``) for every page that is not yet on the device.
        """
        ps = self.page_size
        node = start or self.root
        now = self.clock()
        path: list[Node] = []
        for i, h in enumerate(hashes):
            child = node.children.get(h)
            if child is None:
                child = Node(h, node, tuple(tokens[i * ps:(i + 1) * ps]), node.depth + 1)
                child.salt = salt
                node.children[h] = child
            child.last_access = now
            if not child.present & 1:
                self._add(child, DEVICE)
                if self.write_through and len(self.tiers) > 1 and not child.present & 2:
                    if self.tiers[1].free_tokens >= ps or self.evict(1, ps) >= ps:
                        self._add(child, 1)
            path.append(child)
            node = child
        return path

    def promote(self, nodes: Sequence[Node]) -> int:
        """Load matched pages that live only in lower tiers back onto the device."""
        loaded = 0
        for n in nodes:
            if not n.present & 1:
                self._add(n, DEVICE)
                loaded += self.page_size
        return loaded

    def lock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            node.lock_ref += 1
            if node.lock_ref == 1:
                self.locked_tokens += self.page_size
                self._refresh(node)
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unbalanced unlock"
            if node.lock_ref == 0:
                self.locked_tokens -= self.page_size
                self._refresh(node)
            node = node.parent

    def evict(self, tier: int, tokens: int) -> int:
        """Free at least ``tokens`` from ``tier`` by LRU leaf eviction; returns tokens freed.

        A device page evicted with a host tier present is written back to the host (unless
        already there), as HiCache does; a page that ends up in no tier leaves the trie.
        """
        if tokens <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._evictable[tier]]
        heapq.heapify(heap)
        freed = 0
        ps = self.page_size
        while heap and freed < tokens:
            _, _, node = heapq.heappop(heap)
            if node not in self._evictable[tier]:
                continue
            nxt = tier + 1
            if nxt < len(self.tiers) and not node.present & (1 << nxt):
                # write back; the lower tier makes room for itself first
                if self.tiers[nxt].free_tokens >= ps or self.evict(nxt, ps) >= ps:
                    self._add(node, nxt)
            self._remove(node, tier)
            freed += ps
            parent = node.parent
            if parent is not None and parent in self._evictable[tier]:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Drop everything (``/flush_cache``); callers guarantee nothing is locked."""
        self.root.children.clear()
        for t in self.tiers:
            t.used_tokens = 0
        for s in self._evictable:
            s.clear()
        if self.emit_events:
            self.events.append(AllBlocksCleared())

    def drain_events(self) -> list[Event]:
        ev, self.events = self.events, []
        return ev

    # ---- internals -------------------------------------------------------------------
    def _add(self, node: Node, tier: int) -> None:
        node.present |= 1 << tier
        self.tiers[tier].used_tokens += self.page_size
        medium = self.tiers[tier].medium
        if self.emit_events and medium is not None:
            parent = node.parent
            self.events.append(BlockStored(
                block_hashes=[node.key], parent_block_hash=parent.key if parent is not self.root else None,
                token_ids=list(node.tokens), block_size=len(node.tokens), lora_id=None, medium=medium,
                cache_salt=node.salt,
            ))
        self._refresh(node)
        if node.parent is not None and node.parent is not self.root:
            self._refresh(node.parent)

    def _remove(self, node: Node, tier: int) -> None:
        node.present &= ~(1 << tier)
        self.tiers[tier].used_tokens -= self.page_size
        medium = self.tiers[tier].medium
        if self.emit_events and medium is not None:
            self.events.append(BlockRemoved(block_hashes=[node.key], medium=medium))
        parent = node.parent
        if not node.present and parent is not None:
            # gone from every tier: its (lower-tier-only) descendants became unreachable
            self._drop_subtree(node)
            del parent.children[node.key]
        else:
            self._refresh(node)
        if parent is not None and parent is not self.root:
            self._refresh(parent)

    def _drop_subtree(self, node: Node) -> None:
        for s in self._evictable:
            s.discard(node)
        for child in list(node.children.values()):
            for t in range(len(self.tiers)):
                if child.present & (1 << t):
                    child.present &= ~(1 << t)
                    self.tiers[t].used_tokens -= self.page_size
                    if self.emit_events and self.tiers[t].medium is not None:
                        self.events.append(BlockRemoved(block_hashes=[child.key], medium=self.tiers[t].medium))
            self._drop_subtree(child)
        node.children.clear()

    def _refresh(self, node: Node) -> None:
        """Recompute in which tiers ``node`` is an evictable leaf."""
        for t, s in enumerate(self._evictable):
            bit = 1 << t
            if not node.present & bit:
                ok = False
            elif t == DEVICE:
                ok = node.lock_ref == 0 and not any(c.present & 1 for c in node.children.values())
            else:
                # a copy may go if another tier still holds the page; the last copy only from a
                # leaf of this tier (children only in slower tiers, which write-back or
                # _drop_subtree handle) that no request is about to load back
                upto = (bit << 1) - 1
                ok = bool(node.present & ~bit) or (
                    node.lock_ref == 0 and not any(c.present & upto for c in node.children.values()))
            if ok:
                s.add(node)
            else:
                s.discard(node)

    # ---- introspection (tests, /server_info) ------------------------------------------
    def iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())


def build_tiers(device_tokens: int, host_tokens: int = 0) -> list[Tier]:
    tiers = [Tier("device", device_tokens, "GPU")]
    if host_tokens > 0:
        tiers.append(Tier("host", host_tokens, "CPU_PINNED"))
    return tiers
