"""Page-hash chains for routing, without re-hashing a conversation on every turn.

The precise index keys requests by SGLang's SHA-256 page chain, which costs about a
microsecond per page in Python: a 10k-token prompt at page size 16 is ~0.6 ms, far more
than the index walk. But turn N+1 of a conversation starts with turn N's prompt, whose
chain was already computed. So digests are remembered at checkpoints (every ``every``
pages) under a cheap key, the length plus Python's hash of the prompt bytes up to there,
and a new prompt resumes from its longest remembered checkpoint (found by bisection, since
checkpoints of one prompt are inserted together). Only the pages after it are hashed.
Results are exactly ``wire.hashing.page_hashes`` (a 64-bit key collision could only
mis-predict a cache hit, never corrupt a request).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from wire.hashing import chain_digests, digest_to_int64, page_digests, salt_seed, uint32_le


class PageHashCache:
    def __init__(self, every: int = 16, max_checkpoints: int = 65_536) -> None:
        self.every = int(every)
        self.max_checkpoints = int(max_checkpoints)
        self._cache: OrderedDict[tuple, tuple[bytes, list[int]]] = OrderedDict()
        self.pages_hashed = 0
        self.pages_reused = 0

    def hashes(self, tokens: Sequence[int], page_size: int, cache_salt: str | None = None) -> list[int]:
        pages = len(tokens) // page_size
        every = self.every
        if pages < every:
            self.pages_hashed += pages
            return [digest_to_int64(d) for d in page_digests(tokens, page_size, cache_salt)]
        buf = uint32_le(tokens[: pages * page_size])
        step = page_size * 4
        cache = self._cache
        salt = cache_salt or ""
        lo, hi, found = 0, pages // every, None
        while lo < hi:  # the longest remembered checkpoint
            mid = (lo + hi + 1) // 2
            key = (salt, page_size, mid, hash(buf[: mid * every * step]))
            got = cache.get(key)
            if got is None:
                hi = mid - 1
            else:
                cache.move_to_end(key)
                lo, found = mid, got
        start = lo * every
        if found is None:
            digests = chain_digests(buf, page_size, salt_seed(cache_salt))
            out = [digest_to_int64(d) for d in digests]
        else:
            digests = chain_digests(buf[start * step:], page_size, found[0])
            out = found[1][:start]
            out += [digest_to_int64(d) for d in digests]
        self.pages_hashed += pages - start
        self.pages_reused += start
        for j in range(lo + 1, pages // every + 1):
            end = j * every
            cache[(salt, page_size, j, hash(buf[: end * step]))] = (digests[end - start - 1], out)
        while len(cache) > self.max_checkpoints:
            cache.popitem(last=False)
        return out
