"""A trie of page runs keyed by packed token bytes: where the precise index keeps every page.

Why a trie and not a dict per page: matching a prompt against per-page dict entries needs a
key per page (a hash chain over every token) and one lookup per page in a dict of a million
entries, ~0.2 us each in memory latency alone; together ~95 us for a 2,600-token prompt
in CPython. Here a prompt is packed once (``wire.hashing.uint32_le``, one C call) and
compared run by run with ``bytes.startswith`` (memcmp): a conversation's pages sit in one or
a few runs, so the walk is a handful of C calls whatever the prompt's length.

A ``Run`` is a sequence of whole pages with per-page state kept in parallel lists:
``masks`` (the workers' tier bits, see ``index.block_masks``), ``names`` (the block hash
naming the page: None, one int, or a list of the few that share it; the index's memory
budget evicts a run by these), ``spec`` (speculative bits) and ``pooled`` (in the shared
pool). ``flat`` and ``spec_flat`` say how many leading pages are known to carry the first
page's mask (its speculative bits): a lower bound that a write before it lowers
(``truncate``, ``spec_changed``, ``block_masks._set_mask``) and a match raises once it has
counted, so a long run is not counted again on every match (~45 us of a match through a
4,000-page run at page size 1). Appending leaves it: it never passes the run's end.
Runs never split. A page that diverges from a run at offset ``i`` starts a child run stored
under ``children[i][first page bytes]``: its path is the run's first ``i`` pages, then its
own. So a page's place, ``(run, offset)``, never changes while the page lives, and the
index can keep ``block hash -> (run, offset)`` without rewriting it. A run grows only at
its end (``append``), where a new page continues the run even if children hang there:
they still diverge at that offset. Dead pages (no hash, no speculative bit) are trimmed
from a run's tail, and a run left empty and childless leaves its parent.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import repeat
from typing import Any

from index.common_prefix import common_units


class Run:
    __slots__ = ("key", "width", "masks", "names", "spec", "pooled", "until", "children", "parent", "link", "flat",
                 "spec_flat")

    def __init__(self, parent: Run | None, link: Any, width: int, pages: bytes = b"") -> None:
        n = len(pages) // width
        self.key = bytearray(pages)  # the pages' tokens as uint32 LE, ``width`` bytes per page
        self.width = width
        self.masks: list[int] = [0] * n
        self.names: list[Any] = [None] * n  # per page: None, a block hash, or a list of them
        self.spec: list[int] | None = None
        self.pooled: bytearray | None = None
        self.until: dict[int, list[float]] | None = None  # slot -> per-page speculative expiry
        self.children: dict[int, dict[bytes, Run]] = {}
        self.parent = parent
        self.link = link  # (offset, first page) under the parent; the namespace for a root
        self.flat = self.spec_flat = 0  # leading pages known to share masks[0] (spec[0])

    def append(self, pages: bytes, n: int) -> None:
        self.key += pages
        self.masks.extend(repeat(0, n))
        self.names.extend(repeat(None, n))
        if self.spec is not None:
            self.spec.extend(repeat(0, n))
        if self.pooled is not None:
            self.pooled.extend(bytes(n))

    def mark_pooled(self, i: int, on: bool) -> None:
        if self.pooled is None:
            if not on:
                return
            self.pooled = bytearray(len(self.masks))
        self.pooled[i] = on

    def spec_changed(self, a: int, b: int | None = None) -> None:
        """``spec[a:]`` may have changed; or, given ``b``, each of ``spec[a:b]`` by one same
        operation, which keeps equal bits equal (a record's or expiry's whole range)."""
        if a < self.spec_flat:
            self.spec_flat = a if a or b is None else min(self.spec_flat, b)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` pages."""
        del self.key[n * self.width:], self.masks[n:], self.names[n:]
        self.flat, self.spec_flat = min(self.flat, n), min(self.spec_flat, n)
        if self.spec is not None:
            del self.spec[n:]
            if not any(self.spec):
                self.spec = None
        if self.pooled is not None:
            del self.pooled[n:]
        for until in (self.until or {}).values():
            del until[n:]

    def spec_list(self) -> list[int]:
        if self.spec is None:
            self.spec = [0] * len(self.masks)
            self.spec_flat = len(self.masks)
        return self.spec


Path = list[tuple[Run, int]]  # (run, leading pages of it on the path), root first


def walk(run: Run, prompt: bytes) -> tuple[Path, Run, int]:
    """The runs ``prompt`` (whole pages) follows from ``run``: the path with the pages it
    shares with each, and where it stopped (a run and the offset of the first page not on
    the path), which is where ``grow`` continues."""
    path: Path = []
    pos, end, width = 0, len(prompt), run.width
    while True:
        key = run.key
        if prompt.startswith(key, pos):
            n = len(run.masks)
        elif not prompt.startswith(key[:width], pos):  # not even the first page (a sibling's run)
            n = 0
        else:  # diverges inside the run (or the prompt ends there): bisect the pages, in C
            with memoryview(key) as view:
                n = common_units(prompt, pos, view, 1, min(len(key), end - pos) // width, width)
        if n:
            path.append((run, n))
        pos += n * width
        kids = run.children.get(n) if run.children else None
        if kids is None or pos + width > end:
            return path, run, n
        nxt = kids.get(prompt[pos:pos + width])
        if nxt is None:
            return path, run, n
        run = nxt


def grow(run: Run, at: int, pages: bytes) -> tuple[Run, int]:
    """Add ``pages`` where ``walk`` stopped (``run``, offset ``at``, no child there for the
    first of them); returns the run holding them and the offset of the first."""
    width = run.width
    n = len(pages) // width
    if at == len(run.masks):
        run.append(pages, n)
        return run, at
    first = bytes(pages[:width])
    child = Run(run, (at, first), width, pages)
    run.children.setdefault(at, {})[first] = child
    return child, 0


def step(run: Run, at: int, page: bytes) -> tuple[Run, int]:
    """The place of ``page`` right after offset ``at - 1`` of ``run``, added if new."""
    if at < len(run.masks) and run.key.startswith(page, at * run.width):
        return run, at
    kids = run.children.get(at)
    if kids is not None:
        child = kids.get(page)
        if child is not None:
            return child, 0
    return grow(run, at, page)


def detach(run: Run, roots: dict, lru: OrderedDict | None = None) -> Run | None:
    """Take ``run`` (and so its subtree) out of the trie; returns its parent.

    ``lru`` is the index's eviction order (oldest first), which leaves out runs that are all
    branch point. A parent that has pages past its last branch again joins it at the front
    when it was left out: those pages were last used through the branch that is gone."""
    if lru is not None:
        lru.pop(run, None)
    parent = run.parent
    if parent is None:
        if roots.get(run.link) is run:
            del roots[run.link]
        return None
    at, first = run.link
    kids = parent.children[at]
    del kids[first]
    if not kids:
        del parent.children[at]
        # the parent's pages past its (new) last branch: evictable again, and old
        if lru is not None and parent not in lru and max(parent.children, default=-1) < len(parent.masks):
            lru[parent] = None
            lru.move_to_end(parent, last=False)
    run.parent = None
    return parent


def trim(run: Run, roots: dict, lru: OrderedDict | None = None) -> None:
    """Drop dead pages (no hash names them, no speculative bit, not pooled) from the tail of
    ``run``, and runs left empty, upwards (and out of ``lru``, the index's eviction order)."""
    while True:
        n = len(run.masks)
        names, masks, spec, pooled, children = run.names, run.masks, run.spec, run.pooled, run.children
        while (n and names[n - 1] is None and not masks[n - 1] and n not in children
               and (spec is None or not spec[n - 1]) and (pooled is None or not pooled[n - 1])):
            n -= 1
        if n < len(run.masks):
            run.truncate(n)
        if n or run.children:
            return
        parent = detach(run, roots, lru)
        if parent is None:
            return
        run = parent
