"""Cheap in-process keys for page chains: what the precise index matches prompts by.

SGLang names a cached page by a SHA-256 chain over the token ids (``wire.hashing``), about
a microsecond per page in Python: computing it for every prompt at routing time cost more
than the rest of the decision. But ``BlockStored`` events carry each block's tokens and
parent, so the index can name blocks by a chain of its own that is ~5x cheaper to compute:

    key(page i) = hash((key(page i-1), tuple(tokens of page i)))

seeded per ``cache_salt`` (``seed``), so salted chains never meet unsalted ones. The page
tuples come out of ``zip`` over one iterator (in C, reusing one tuple where it can) and
each chain step is one ``hash`` of a pair in a comprehension: ~12 ns per token here, about
a fifth of the SHA chain. Two different prefixes share a key only by a 64-bit hash collision, which
can mis-predict a cache hit and nothing worse.

The seed goes through ``hash`` of a ``bytes`` marker, which Python randomises per process
(``PYTHONHASHSEED``), so keys differ between processes and runs. That is fine because they
never leave the process: the index learns them from events and matches prompts in the same
interpreter, and nothing persists or sends them.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

_SEED_MARKER = b"kvgate-page-keys\0"


def seed(cache_salt: str | None) -> int:
    """The key that stands before the first page (``""`` and ``None`` are both unsalted, as
    in ``wire.hashing.salt_seed``)."""
    return hash((_SEED_MARKER, cache_salt or None))


def page_keys(token_ids: Sequence[int], page_size: int, start: int) -> list[int]:
    """Keys of every *full* page of ``token_ids``, chained from ``start`` (a ``seed`` or the
    key of the page before ``token_ids[0]``)."""
    key = start
    pages = iter(token_ids)  # zip over page_size copies of one iterator: a partial page is dropped
    return [key := hash((key, page)) for page in zip(*repeat(pages, page_size))]
