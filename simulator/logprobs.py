"""Deterministic logprobs in SGLang's three shapes.

Every token at a position has a fixed logprob (``generation.token_logprob``). The top
candidates at a position are the token there first, then printable bytes each less likely
than the one before, so a client sees a well-formed distribution that is the same on every
call. Shapes:

- native (``/generate`` ``meta_info``): ``[logprob, token_id, text or None]`` per token, and
  per position a list of those for ``top_logprobs_num`` candidates (None for the first
  prompt token, which has no logprob);
- chat (``choices[].logprobs``): ``{"content": [{"token", "bytes", "logprob", "top_logprobs"}]}``;
- completions (``choices[].logprobs``): ``{"text_offset", "token_logprobs", "tokens", "top_logprobs"}``.

Output tokens are bytes (``generation``), so their text is the byte's character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .generation import token_logprob

_PRINTABLE = 95  # candidates are drawn from 0x20..0x7e
_STEP = 0.5  # each candidate is this much less likely than the one before


def top(token_id: int, position: int, k: int) -> list[tuple[float, int]]:
    """The ``k`` most likely tokens at ``position``, most likely first: the token there, then others."""
    first = token_logprob(token_id, position)
    out = [(first, token_id)] if k > 0 else []
    j = 1
    while len(out) < min(k, _PRINTABLE):
        alt = 32 + (token_id + 37 * j) % _PRINTABLE
        if alt != token_id and all(alt != t for _, t in out):
            out.append((round(first - _STEP * len(out), 4), alt))
        j += 1
    return out


def _char(token_id: int) -> str:
    return chr(token_id) if 0 <= token_id < 0x110000 else ""


def native(input_ids: Sequence[int], output: bytes, start: int, k: int,
           text: Callable[[int], str] | None) -> dict[str, Any]:
    """The ``meta_info`` fields of ``return_logprob``: prompt tokens from ``start`` (their
    logprobs), all output tokens, and with ``k`` > 0 the top ``k`` at each position.
    ``text`` names a prompt token (``return_text_in_logprobs``; None: no text)."""
    def named(t: int) -> str | None:
        return text(t) if text is not None else None

    def out_named(t: int) -> str | None:
        return _char(t) if text is not None else None

    meta: dict[str, Any] = {
        "input_token_logprobs": [[None if i == 0 else token_logprob(t, i), t, named(t)]
                                 for i, t in enumerate(input_ids) if i >= start],
        "output_token_logprobs": [[token_logprob(t, i), t, out_named(t)] for i, t in enumerate(output)],
        "output_token_logprobs_length": len(output),
    }
    if k > 0:
        meta["input_top_logprobs"] = [None if i == 0 else [[lp, c, named(c)] for lp, c in top(t, i, k)]
                                      for i, t in enumerate(input_ids) if i >= start]
        meta["output_top_logprobs"] = [[[lp, c, out_named(c)] for lp, c in top(t, i, k)] for i, t in enumerate(output)]
    return meta


def chat(output: bytes, first: int, k: int) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion for output tokens ``first`` onwards."""
    return {"content": [
        {"token": _char(t), "bytes": [t], "logprob": token_logprob(t, i),
         "top_logprobs": [{"token": _char(c), "bytes": [c], "logprob": lp} for lp, c in top(t, i, k)]}
        for i, t in enumerate(output) if i >= first]}


def completion(output: bytes, first: int, k: int) -> dict[str, Any]:
    """``choices[].logprobs`` of a text completion for output tokens ``first`` onwards
    (``text_offset`` is -1, as SGLang reports it)."""
    tokens = [(i, t) for i, t in enumerate(output) if i >= first]
    return {"text_offset": [-1] * len(tokens), "token_logprobs": [token_logprob(t, i) for i, t in tokens],
            "tokens": [_char(t) for _, t in tokens],
            "top_logprobs": [{_char(c): lp for lp, c in top(t, i, k)} for i, t in tokens] if k > 0 else []}
