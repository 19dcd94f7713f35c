"""Blocks the precise index keeps by block hash, and the SHA-chain match that finds them.

A block that cannot be placed in the page trie (an event without token ids, a parent the
index never saw, a chain start hashed some other way) is kept by its hash: ``by_hash`` names
them and ``hashed`` holds their masks. While any exist, a match also computes the prompt's
SHA page chain (memoised across turns, ``index.page_hash_cache``) and ORs both page by page,
so matches stay exactly what a SHA-keyed index gives; the cost comes back only while such
blocks do. The last prompt's packed ids and SHA chains are kept here for both.
"""

from __future__ import annotations

from itertools import chain as chained, repeat, takewhile
from operator import or_

from index.block_masks import _held_pages, _path_masks
from index.page_hash_cache import PageHashCache
from index.page_trie import Path
from index.views import RequestView


class HashKeyed:
    """The blocks kept by hash (``hashed``, ``by_hash``) and the last prompt's SHA chains."""

    def __init__(self) -> None:
        self.hashed: dict[int, int] = {}  # block hash -> tier bits, for blocks with no place
        self.by_hash: set[int] = set()  # block hashes held (or pooled) with no place
        self.chains = PageHashCache()
        self._last_prompt: list = [None, None, {}, None]  # [tokens, packed, SHA chains, salt]

    def prompt(self, request: RequestView) -> list:
        """[tokens, packed ids (None if some id is no uint32), SHA chains by page size] of the
        last request seen: select and record both need them, one right after the other."""
        tokens = request.token_ids or []
        got = self._last_prompt
        # The cache holds the token list itself, so identity cannot be a recycled id().
        if got[0] is not tokens or got[3] != request.cache_salt:
            got = self._last_prompt = [tokens, request.packed(), {}, request.cache_salt]
        return got

    def hashes_for(self, request: RequestView, page_size: int) -> list[int]:
        """The request's SHA page chain, needed only while blocks are keyed by hash."""
        got = self.prompt(request)
        chains = got[2]
        if page_size not in chains:
            try:
                chains[page_size] = self.chains.hashes(got[0], page_size, request.cache_salt)
            except (OverflowError, TypeError):
                chains[page_size] = []
        return chains[page_size]

    def held(self, request: RequestView, page_size: int, path: Path, wanted: int,
             pool: set[int]) -> tuple[dict[int, int], int]:
        """Page by page along the request's SHA chain: (bit -> leading pages held, as
        ``block_masks._held_pages``; leading pages the shared pool holds), with the trie
        path's masks and pool flags ORed in."""
        hashes = self.hashes_for(request, page_size)
        on_path = chained(chained.from_iterable(_path_masks(r, n) for r, n in path), repeat(0))
        pages = _held_pages(map(or_, on_path, map(self.hashed.get, hashes, repeat(0))), wanted)
        flags = chained(chained.from_iterable(r.pooled[:n] if r.pooled else bytes(n) for r, n in path),
                        repeat(0))
        pooled = len(list(takewhile(bool, map(or_, flags, map(pool.__contains__, hashes)))))
        return pages, pooled
