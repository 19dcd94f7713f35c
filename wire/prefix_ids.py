"""Reading a token-id list that extends a recent one: that one's ids, then only the rest.

RL rollouts and agents send SGLang's ``/generate`` their own ``input_ids``, and every turn
re-sends the whole trajectory: the previous request's ids, the engine's answer, a tool's
result. msgspec builds a Python int per id (~115 us for 3,000 ids in the gateway, ~470 us
for 16,000), and packing them for the prefix index costs ~20 us more, on every turn, to
learn a few hundred new ids. GRPO sends each prompt a group's worth of times, identical.
Here a list's JSON text is compared with recent lists' texts (one ``memcmp``); where a
recent text is a prefix ending at an id, its ids are reused and only the text after it is
decoded.

The ids are kept and handed over as ``array("I")`` (uint32, what the prefix indexes match
on), never as a list: a list's int objects are the cost. Building them again from an array
(``tolist``) costs ~70% of msgspec's whole decode, and keeping recent lists' ints alive to
share them was slower still in the gateway (each turn touched thousands of ints that other
requests had pushed out of the CPU's caches). So a list read here is an array: it indexes,
slices, iterates and packs as a list of ints does, and it is no ``list``.

Why the reuse is exact: a JSON integer's text names one value, so a list text that starts
with another's text up to its last id, followed by optional whitespace and then ``,`` or
``]``, holds that list's ids first. The text after the ``,`` is decoded by msgspec as a list
of ints, which checks what it holds and refuses a dangling comma; the entries themselves are
texts msgspec decoded before. So a text this accepts is one msgspec accepts, with the same
ids. Ids no uint32 holds are refused (None), as the indexes would refuse to pack them.

Finding a candidate without hashing the whole text: an entry is filed under the power of two
``b`` at or below its length and the ``_KEY`` bytes before ``b``; a text probes each power of
two up to its own length, longest first (a dict lookup each). Lists that share their first
``b`` bytes (a fleet-wide system prompt, a GRPO group's siblings) share a bucket, which keeps
its ``per_key`` newest entries; past the shared part the bytes differ and so do the buckets.
Entries hold the text and the packed ids under one byte budget, least recently used out first.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import msgspec

_KEY = 64  # bytes of text before the power of two that file an entry
_WS = b" \t\r\n"  # JSON's whitespace
_WS_BYTES = (b" ", b"\t", b"\r", b"\n")
_ENTRY_BYTES = 300  # the entry, its key and its places in the dicts and lists, about
_decode_ids = msgspec.json.Decoder(list[int]).decode


class _Entry:
    __slots__ = ("head", "ids", "key", "size")

    def __init__(self, head: bytes, ids: array, key: tuple[int, bytes]) -> None:
        self.head = head  # the list's text up to its last id: no closing bracket
        self.ids = ids
        self.key = key
        self.size = len(head) + ids.itemsize * len(ids) + _ENTRY_BYTES


def _power(n: int) -> int:
    return 1 << (n.bit_length() - 1)


class RecentIds:
    """Recent id lists by their JSON text (see the module's docstring). Not thread-safe: the
    gateway reads bodies on its event loop."""

    def __init__(self, max_bytes: int = 64 << 20, min_bytes: int = 1024, per_key: int = 32) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = max(min_bytes, _KEY)  # shorter lists decode in a few us: not worth an entry
        self.per_key = per_key
        self._buckets: dict[tuple[int, bytes], list[_Entry]] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()
        self.bytes = 0
        # stats
        self.hits = self.misses = 0
        self.reused_ids = self.decoded_ids = 0

    def decode(self, text: bytes) -> array | None:
        """The ids of ``text`` (a JSON list ending in ``]``) as ``array("I")``, or None where it
        is no list of uint32 ints. A recent list's prefix is reused where there is one; the
        list is kept for the next either way, so do not change the array."""
        ids = self._reuse(text) if len(text) > self.min_bytes else None
        if ids is None:
            try:
                decoded = _decode_ids(text)
            except msgspec.DecodeError:  # (ValidationError is one)
                return None
            ids = array("I")
            try:
                ids.fromlist(decoded)
            except OverflowError:
                return None
            if len(text) > self.min_bytes:
                self.misses += 1
                self.decoded_ids += len(ids)
        self._put(text, ids)
        return ids

    def _reuse(self, text: bytes) -> array | None:
        found: _Entry | None = None
        b, low = _power(len(text) - 1), _power(self.min_bytes)
        while b >= low and found is None:  # the longest bucket with a prefix holds the longest prefix
            for entry in self._buckets.get((b, text[b - _KEY:b]), ()):
                n = len(entry.head)
                if (found is None or n > len(found.head)) and text.startswith(entry.head) \
                        and text[n:n + _KEY].lstrip(_WS)[:1] in (b",", b"]"):
                    found = entry
            b >>= 1
        if found is None:
            return None
        # The longest prefix that ends at an id: if the rest after it is no list of ints, no
        # shorter prefix's rest is either (that rest ends with this one's), so one decode.
        tail = self._tail(text, len(found.head))
        if tail is None:
            return None
        ids = found.ids[:]
        try:
            ids.fromlist(tail)
        except OverflowError:
            return None
        self._lru.move_to_end(id(found))
        self.hits += 1
        self.reused_ids += len(found.ids)
        self.decoded_ids += len(tail)
        return ids

    @staticmethod
    def _tail(text: bytes, at: int) -> list[int] | None:
        """The ids after ``text[:at]``, an entry's text that ``_reuse`` found followed by a
        ``,`` or the ``]`` (after any whitespace); None where the rest is no list of ints."""
        rest = text[at:].lstrip(_WS)
        if rest == b"]":
            return []
        try:
            tail = _decode_ids(b"[" + rest[1:])
        except msgspec.DecodeError:  # (ValidationError is one)
            return None
        return tail or None  # "[1,2,]" is no JSON

    def _put(self, text: bytes, ids: array) -> None:
        head = text[:-1]
        if head[-1:] in _WS_BYTES:
            head = head.rstrip(_WS)
        if len(head) < self.min_bytes or not ids or self.max_bytes <= 0:
            return
        b = _power(len(head))
        key = (b, head[b - _KEY:b])
        bucket = self._buckets.setdefault(key, [])
        for entry in bucket:
            if entry.head == head:  # the same list again (a GRPO group): keep the one entry
                self._lru.move_to_end(id(entry))
                return
        entry = _Entry(head, ids, key)
        if entry.size > self.max_bytes:
            return
        bucket.append(entry)
        self._lru[id(entry)] = entry
        self.bytes += entry.size
        if len(bucket) > self.per_key:
            self._drop(bucket[0])
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._lru.values())))

    def _drop(self, entry: _Entry) -> None:
        bucket = self._buckets[entry.key]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[entry.key]
        del self._lru[id(entry)]
        self.bytes -= entry.size

    def stats(self) -> dict[str, float]:
        return {"ids_reuse_hits_total": float(self.hits), "ids_reuse_misses_total": float(self.misses),
                "ids_reused_total": float(self.reused_ids), "ids_decoded_total": float(self.decoded_ids),
                "ids_reuse_bytes": float(self.bytes), "ids_reuse_entries": float(len(self._lru))}
