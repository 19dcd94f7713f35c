"""Mooncake-format traces: load records and expand hash ids into real prompt text.

Each hash id is a 512-token block. Expansion is deterministic (block text depends on the
id only) and uses printable ASCII, so under the byte tokenizer 1 character = 1 token and
requests sharing leading hash ids share a real token prefix. The last block is cut to
``input_length``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

import msgspec

BLOCK = 512


def _default_trace() -> Path:
    """The shared trace sits beside the project root (``../shared/``, see shared/README.md);
    a git worktree one level deeper finds it one more level up."""
    root = Path(__file__).resolve().parent.parent
    candidates = [d / "shared" / "traces" / "mooncake_conversation_trace.jsonl" for d in (root.parent, root.parent.parent)]
    return next((c for c in candidates if c.exists()), candidates[0])


DEFAULT_TRACE = _default_trace()

_ALPHABET = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:-"
_TABLE = bytes(_ALPHABET[b % len(_ALPHABET)] for b in range(256))


class TraceRecord(msgspec.Struct):
    timestamp: float  # milliseconds from trace start
    input_length: int
    output_length: int
    hash_ids: list[int]


_decoder = msgspec.json.Decoder(TraceRecord)


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                out.append(_decoder.decode(line))
                if limit is not None and len(out) >= limit:
                    break
    return out


@lru_cache(maxsize=65536)
def block_text(hash_id: int, block_size: int = BLOCK) -> str:
    return random.Random(hash_id * 1_000_003 + 17).randbytes(block_size).translate(_TABLE).decode("ascii")


def expand(record: TraceRecord, block_size: int = BLOCK) -> str:
    """The prompt text of a record: its blocks concatenated, cut (or padded) to input_length."""
    text = "".join(block_text(h, block_size) for h in record.hash_ids)
    n = record.input_length
    if len(text) < n:  # a few traces under-count blocks: pad deterministically
        last = record.hash_ids[-1] if record.hash_ids else 0
        k = 0
        while len(text) < n:
            k += 1
            text += block_text(-(last * 1000 + k), block_size)
    return text[:n]


def conversation_keys(records: Sequence[TraceRecord]) -> list[str | None]:
    """A conversation key per record, derived from its hash ids (a Mooncake trace names no
    conversation): the first block after the head every record shares (the conversation
    trace's records all open with one system-prompt block). A new block there is a new
    conversation; a record that is all shared head has none."""
    if not records:
        return []
    head = list(records[0].hash_ids)
    for r in records[1:]:
        n = 0
        for a, b in zip(head, r.hash_ids):
            if a != b:
                break
            n += 1
        head = head[:n]
    return [f"conv-{r.hash_ids[len(head)]}" if len(r.hash_ids) > len(head) else None for r in records]


def block_spans(record: TraceRecord, block_size: int) -> Iterable[tuple[int, int]]:
    for i, h in enumerate(record.hash_ids):
        length = min(block_size, record.input_length - i * block_size)
        if length <= 0:
            return
        yield h, length


def engine_cap(hit: int, input_length: int, page_size: int) -> int:
    """SGLang matches whole pages and always recomputes at least the last token."""
    limit = ((input_length - 1) // page_size) * page_size
    return min((hit // page_size) * page_size, limit)


def oracle_hit_rate(records: Sequence[TraceRecord], page_size: int = 64, block_size: int = BLOCK) -> float:
    """Hit rate (cached / prompt tokens) of one infinite prefix cache seeing every request."""
    seen: dict[int, int] = {}
    hit = total = 0
    for r in records:
        h_tokens = 0
        prefix_ok = True
        for h, length in block_spans(r, block_size):
            if prefix_ok:
                s = seen.get(h, 0)
                h_tokens += min(s, length)
                prefix_ok = s >= length
            if seen.get(h, 0) < length:
                seen[h] = length
        hit += engine_cap(h_tokens, r.input_length, page_size)
        total += r.input_length
    return hit / total if total else 0.0


def bounded_oracle_hit_rate(records: Sequence[TraceRecord], capacity_tokens: int, page_size: int = 64,
                            block_size: int = BLOCK) -> float:
    """Same, with one LRU cache of ``capacity_tokens`` (blocks evicted least-recently-used)."""
    lru: OrderedDict[int, int] = OrderedDict()
    used = hit = total = 0
    for r in records:
        h_tokens = 0
        prefix_ok = True
        for h, length in block_spans(r, block_size):
            s = lru.get(h, 0)
            if prefix_ok:
                h_tokens += min(s, length)
                prefix_ok = s >= length
            if h in lru:
                lru.move_to_end(h)
            if s < length:
                lru[h] = length
                used += length - s
        while used > capacity_tokens and lru:
            _, length = lru.popitem(last=False)
            used -= length
        hit += engine_cap(h_tokens, r.input_length, page_size)
        total += r.input_length
    return hit / total if total else 0.0
