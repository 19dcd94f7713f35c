"""Deterministic "model output": printable-ASCII token streams seeded per request.

The token at a sequence position is a function of the seed and that position (prompt
tokens count): a request whose prompt is another's prompt plus the first k tokens of its
answer, with the same seed, draws the rest of that answer (what a gateway that continues
a broken stream elsewhere sends, docs/migration.md); a real model with greedy decoding
behaves so. The whole output of a request is drawn once at admission (one keyed BLAKE2b
digest per 64 positions and a ``bytes.translate``), and stop strings / stop token ids are
located with ``bytes.find``, so the scheduler never does per-token Python work to produce text.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass

from .protocol import SamplingParams

_CHUNK = 64
_PRINTABLE = bytes(32 + (b % 95) for b in range(256))  # 0x20..0x7e


def seed_for(rid: str, params: SamplingParams, room: int | None) -> int:
    """Prefill and decode of one PD request must draw the same tokens: they share the room."""
    if params.sampling_seed is not None:
        return params.sampling_seed
    if room is not None:
        return room
    return zlib.crc32(rid.encode())


@dataclass(slots=True)
class Planned:
    out: bytes  # the output tokens (byte ids), already cut at the stop point
    finish: dict  # SGLang finish_reason
    text_len: int  # characters of ``out`` that are shown (stop strings trimmed)


def _draw(seed: int, start: int, n: int) -> bytes:
    """The tokens at positions ``start`` .. ``start + n - 1``: each depends on the seed and its
    position only, so the first k do not depend on n (PD prefill draws 1, decode n)."""
    if n <= 0:
        return b""
    key = (seed % (1 << 64)).to_bytes(8, "little")
    first, last = start // _CHUNK, (start + n - 1) // _CHUNK
    data = b"".join(hashlib.blake2b(c.to_bytes(8, "little"), key=key, digest_size=_CHUNK).digest()
                    for c in range(first, last + 1))
    skip = start - first * _CHUNK
    return data[skip:skip + n].translate(_PRINTABLE)


def plan_output(seed: int, max_new: int, params: SamplingParams, start: int = 0) -> Planned:
    """``start``: the position of the first output token (the prompt's length)."""
    out = _draw(seed, start, max_new)
    best: tuple[int, int, object] | None = None  # (end, text_end, matched)
    lo = max(params.min_new_tokens, 0)
    for s in params.stops():
        b = s.encode()
        i = out.find(b, lo)
        if i >= 0 and (best is None or i + len(b) < best[0]):
            best = (i + len(b), i + len(b) if params.no_stop_trim else i, s)
    for tid in params.stop_token_ids or ():
        if 0 <= tid < 256:
            i = out.find(bytes([tid]), lo)
            if i >= 0 and (best is None or i + 1 < best[0]):
                best = (i + 1, i + 1, tid)
    if best is not None:
        end, text_end, matched = best
        return Planned(out[:end], {"type": "stop", "matched": matched}, text_end)
    return Planned(out, {"type": "length", "length": len(out)}, len(out))


def token_logprob(token_id: int, position: int) -> float:
    """A stable fake logprob in [-2.0, -0.01]."""
    return -0.01 - ((token_id * 31 + position * 17) % 200) / 100.0
