"""Page-hash chains for routing, without re-hashing a conversation on every turn.

The precise index keys requests by SGLang's SHA-256 page chain, about a microsecond per
page in Python: a 10k-token prompt at page size 16 costs ~0.6 ms, far more than the index
walk. But turn N+1 of a conversation starts with turn N's prompt, whose chain was already
computed. So the chain is memoised per segment of ``every`` pages, keyed by the digest
before the segment and Python's hash of the segment's packed tokens (a ~1 us siphash
instead of ``every`` SHA-256 calls). A prompt walks its segments from the start while they
are remembered and hashes only the rest. Results are exactly ``wire.hashing.page_hashes``;
a 64-bit key collision could only mis-predict a cache hit, never corrupt a request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from wire.hashing import chain_digests, digest_to_int64, salt_seed, uint32_le


class PageHashCache:
    def __init__(self, every: int = 16, max_segments: int = 32_768) -> None:
        self.every = int(every)
        self.max_segments = int(max_segments)
        # (page size, digest before the segment, hash of its bytes) -> (digest after, its hashes)
        self._cache: OrderedDict[tuple, tuple[bytes, list[int]]] = OrderedDict()
        self.pages_hashed = 0
        self.pages_reused = 0

    def hashes(self, tokens: Sequence[int], page_size: int, cache_salt: str | None = None) -> list[int]:
        every, cache = self.every, self._cache
        pages = len(tokens) // page_size
        segments = pages // every
        data = uint32_le(tokens[: pages * page_size])
        size = every * page_size * 4
        prev = salt_seed(cache_salt)
        out: list[int] = []
        done = 0
        while done < segments:  # reuse remembered segments from the start
            key = (page_size, prev, hash(data[done * size: (done + 1) * size]))
            got = cache.get(key)
            if got is None:
                break
            cache.move_to_end(key)
            prev = got[0]
            out += got[1]
            done += 1
        digests = chain_digests(data[done * size:], page_size, prev)
        rest = [digest_to_int64(d) for d in digests]
        for k in range(segments - done):  # remember the complete segments just hashed
            before = prev if k == 0 else digests[k * every - 1]
            cache[(page_size, before, hash(data[(done + k) * size: (done + k + 1) * size]))] = (
                digests[(k + 1) * every - 1], rest[k * every: (k + 1) * every])
        while len(cache) > self.max_segments:
            cache.popitem(last=False)
        self.pages_reused += done * every
        self.pages_hashed += len(rest)
        out += rest
        return out
