"""Tokenizing a prompt that extends a recent one: that one's ids up to a special token, then
only the rest.

Every turn of a chat re-sends the whole history, so a gateway that tokenizes for precise
routing encodes the same text again and again: the 40th turn of a 40k-token conversation
pays for 40k tokens (~40 ms with ``simulator/tiny_tokenizer.py``'s BPE, ~10-40 ms with a
large model's) to learn a few hundred new ones. Here the ids of the longest prefix already
seen are reused and only the text after it is encoded.

Why a cut before a special token is exact: a Hugging Face tokenizer first splits the text
at its added tokens, then normalizes, pre-tokenizes and encodes each piece between them on
its own. So the ids of the text before an added token depend on that text alone. The rest
is encoded from the added token on, so its first ordinary piece sits after an added token
as it does in the whole prompt (Metaspace's ``prepend_scheme: first`` and the ``Prepend``
normalizer look at that). A token qualifies as a cut (``anchors``) when that split is sure
to happen wherever its text occurs: matched on raw text (``normalized`` false), taking no
whitespace around it (``lstrip``/``rstrip`` false), not ``single_word``, and sharing no
text with another added token (neither inside the other nor overlapping at an end). The
tokenizer must not truncate or pad. ``wire.tokenizer`` offers the chat template's own special
tokens; of a cluster of them (a message's end and the next header) only the first is a cut.
Where each cut's token sits in the ids is found by lining every anchor in the text up with
the next occurrence of its id, so clustered anchors that are not cuts keep their own places.

What is argued is also checked: the first ``verify_first`` reuses and one in
``verify_every`` after are encoded whole as well and compared; a difference turns reuse off
for good, with a warning, and the whole encoding is returned.

A prefix is found by the SHA-256 of the UTF-8 text before each cut (one pass over the text,
a copy of the hash state per cut), mapped to the entry that holds its ids and the cut's
place there; the deepest cut a recent prompt shares wins. Entries hold ids packed (4 bytes
a token) under one byte budget, least recently used out first; an entry whose every cut
was taken over by a newer prompt that extends it (the next turn) is dropped at once, so a
conversation keeps one entry, not one per turn. Measured in ``bench/micro/tokenize_reuse.py``
(bench/RESULTS.md): 0.15 of the tokenizer's CPU on 20-turn chats, 0.78 on the Mooncake trace.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate, count, repeat
from operator import add
from typing import Any

log = logging.getLogger("kvgate.tokenizer")

_CLUSTER = 64  # anchors closer than this (bytes) to the last cut kept are not cuts
_KEY_BYTES = 200  # about what a cut costs beside the ids: its digest, dict slot, tuple and place


class _Entry:
    __slots__ = ("ids", "keys", "places", "live", "size")

    def __init__(self, ids: array, keys: list[bytes], places: list[int]) -> None:
        self.ids = ids  # the prompt's ids, as the body encoder gives them
        self.keys = keys  # the digest of the text before each cut, in order
        self.places = places  # where each cut's token sits in ``ids``
        self.live = len(keys)  # keys still mapped to this entry
        self.size = ids.itemsize * len(ids) + _KEY_BYTES * len(keys)


def anchor_tokens(added: Mapping[int, Any], wanted: Sequence[str]) -> dict[str, int]:
    """The added tokens a prompt can be cut before (text -> id), from ``get_added_tokens_decoder``:
    see the module's docstring for the conditions. ``wanted``: the texts to consider, a chat
    template's own (a model may have hundreds of reserved ones; each is searched for in every
    prompt)."""
    contents = [t.content for t in added.values() if t.content]
    out: dict[str, int] = {}
    for i, tok in added.items():
        c = tok.content
        if not c or c not in wanted or tok.normalized or tok.lstrip or tok.rstrip or tok.single_word:
            continue
        if any(d != c and _share_text(c, d) for d in contents):
            continue
        out[c] = i
    return out


def _share_text(a: str, b: str) -> bool:
    """Whether an occurrence of ``a`` could be part of a match of ``b`` or the other way round."""
    if a in b or b in a:
        return True
    return any(a.endswith(b[:n]) or b.endswith(a[:n]) for n in range(1, min(len(a), len(b))))


class PrefixTokens:
    """Reuses the ids of recent prompts' prefixes (see the module's docstring). ``encode``:
    the tokenizer's own, without special tokens added; thread-safe, as prompts are encoded on a
    pool."""

    def __init__(self, encode: Callable[[str], list[int]], anchors: Mapping[str, int], max_bytes: int = 64 << 20,
                 min_chars: int = 512, verify_first: int = 8, verify_every: int = 256) -> None:
        self._encode = encode
        self._anchors = [(c.encode("utf-8"), i) for c, i in anchors.items()]
        self.max_bytes = max_bytes
        self.min_chars = min_chars
        self.verify_first, self.verify_every = verify_first, verify_every
        self._keys: dict[bytes, tuple[_Entry, int]] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.enabled = bool(self._anchors) and max_bytes > 0
        self.bytes = 0
        # stats
        self.reuses = self.misses = self.verified = 0
        self.reused_tokens = self.encoded_tokens = 0

    def encode(self, text: str) -> list[int]:
        return self.encode_packed(text)[0]

    def encode_packed(self, text: str) -> tuple[list[int], array | None]:
        """The ids, and the same ids packed as ``array("I")`` where they were (the precise index
        matches packed ids: a reused prefix is packed already). The array is shared: do not
        change it."""
        if not self.enabled or len(text) < self.min_chars:
            return self._encode(text), None
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: whatever the tokenizer makes of it
            return self._encode(text), None
        found = self._found(data)
        cuts = _cuts(found)
        keys = _prefix_digests(data, [found[c][0] for c in cuts])
        with self._lock:
            hit = self._deepest(keys)
        if hit is None:
            ids = self._encode(text)
            packed = array("I")
            packed.fromlist(ids)
            places = _places(ids, found, cuts, -1)
            with self._lock:
                self.misses += 1
                self.encoded_tokens += len(ids)
        else:
            j, entry = hit
            k = entry.places[j]
            rest = self._encode(data[found[cuts[j]][0]:].decode("utf-8"))
            packed = entry.ids[:k]
            ids = packed.tolist()
            ids += rest
            packed.fromlist(rest)
            places = entry.places[:j]
            tail = _places(ids, found, cuts[j:], k - 1)
            if tail[:1] == [k]:  # the rest starts with the cut's token, as it must
                places += tail
            with self._lock:
                self.reuses += 1
                self.reused_tokens += k
                self.encoded_tokens += len(rest)
                check = self.reuses <= self.verify_first or self.reuses % self.verify_every == 0
            if check and (whole := self._differs(text, ids, k)) is not None:
                return whole, None
        if places:
            with self._lock:
                self._insert(_Entry(packed, keys[:len(places)], places))
        return ids, packed

    def _found(self, data: bytes) -> list[tuple[int, int]]:
        """(byte offset, token id) of every anchor in the text, in order."""
        found: list[tuple[int, int]] = []
        for text, token in self._anchors:  # occurrence i starts after i + 1 pieces and i anchors (all in C)
            ends = accumulate(map(len, data.split(text)))
            found += zip(map(add, ends, range(0, len(data) + len(text), len(text))), repeat(token))
            found.pop()  # the end of the last piece, not an anchor
        found.sort()
        return found

    def _deepest(self, keys: list[bytes]) -> tuple[int, _Entry] | None:
        for j in range(len(keys) - 1, -1, -1):
            got = self._keys.get(keys[j])
            if got is not None and got[1] == j:  # the same text before it holds as many cuts
                self._lru.move_to_end(id(got[0]))
                return j, got[0]
        return None

    def _differs(self, text: str, ids: list[int], reused: int) -> list[int] | None:
        """The whole prompt's ids where ``ids`` (``reused`` of them reused) are not those."""
        whole = self._encode(text)
        with self._lock:
            self.verified += 1
            if whole == ids:
                return None
            self.enabled = False
            self._keys.clear()
            self._lru.clear()
            self.bytes = 0
        at = next((i for i, (a, b) in enumerate(zip(whole, ids)) if a != b), min(len(whole), len(ids)))
        log.warning("reusing a prompt's prefix ids gave ids that differ from encoding it whole (at token %d of "
                    "%d, %d reused): this tokenizer splits differently around its special tokens, so prefix "
                    "reuse is off from now on", at, len(whole), reused)
        return whole

    def _insert(self, entry: _Entry) -> None:
        if not self.enabled or entry.size > self.max_bytes:
            return
        keys = self._keys
        taken = Counter(got[0] for got in map(keys.get, entry.keys) if got is not None)
        keys.update(zip(entry.keys, zip(repeat(entry), count())))
        for old, n in taken.items():
            old.live -= n
            if old.live <= 0 and self._lru.pop(id(old), None) is not None:  # taken over whole: a later turn
                self.bytes -= old.size
        self._lru[id(entry)] = entry
        self.bytes += entry.size
        while self.bytes > self.max_bytes:
            _, oldest = self._lru.popitem(last=False)
            self.bytes -= oldest.size
            for key in oldest.keys:
                got = keys.get(key)
                if got is not None and got[0] is oldest:
                    del keys[key]

    def stats(self) -> dict[str, float]:
        return {"tokenize_prefix_reuses_total": float(self.reuses),
                "tokenize_prefix_misses_total": float(self.misses),
                "tokenize_prefix_reused_tokens_total": float(self.reused_tokens),
                "tokenize_prefix_encoded_tokens_total": float(self.encoded_tokens),
                "tokenize_prefix_verified_total": float(self.verified),
                "tokenize_prefix_entries": float(len(self._lru)),
                "tokenize_prefix_bytes": float(self.bytes),
                "tokenize_prefix_enabled": float(self.enabled)}


def _cuts(found: list[tuple[int, int]]) -> list[int]:
    """Which anchors a prompt may be cut before (indexes into ``found``): the first of each
    cluster (a message's end and the next one's header are one cluster; re-encoding past the
    rest costs a few tokens, keeping them would cost a key each), none at 0 (nothing to
    reuse). Which are kept depends only on the text before them, as a key must."""
    cuts: list[int] = []
    last = -_CLUSTER
    for i, (at, _) in enumerate(found):
        if at - last >= _CLUSTER and at:
            cuts.append(i)
            last = at
    return cuts


def _prefix_digests(data: bytes, offsets: list[int]) -> list[bytes]:
    """SHA-256 of ``data`` before each offset, in one pass."""
    view = memoryview(data)
    h = hashlib.sha256()
    keys: list[bytes] = []
    at = 0
    for cut in offsets:
        h.update(view[at:cut])
        at = cut
        keys.append(h.copy().digest())
    return keys


def _places(ids: list[int], found: list[tuple[int, int]], cuts: list[int], after: int) -> list[int]:
    """Where the tokens of ``cuts`` (indexes into ``found``) sit in ``ids``. Every anchor from
    the first cut on is lined up with the next of its tokens after the one before (from
    ``after``), cut or not, so each cut gets its own occurrence; where one is not found the
    rest are dropped, so only cuts known to line up are kept."""
    if not cuts:
        return []
    lined: list[int] = []
    for _, token in found[cuts[0]:]:
        try:
            after = ids.index(token, after + 1)
        except ValueError:
            break
        lined.append(after)
    first = cuts[0]
    return [lined[c - first] for c in cuts if c - first < len(lined)]
