"""Deterministic "model" vectors: an embedding is a function of the prompt's token ids alone.

Each token id has a fixed pseudo-random direction; a prompt's embedding is the sum over its
tokens, normalised to unit length. Prompts that share tokens point the same way, so cosine
similarity behaves roughly like a bag-of-words model's (rerank relies on it), and the same
ids give the same vector in every process.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache

_ROUND = 6


@lru_cache(maxsize=1 << 16)
def _direction(token_id: int, dim: int) -> tuple[float, ...]:
    rng = random.Random(token_id * 1_000_003 + dim)
    return tuple(rng.uniform(-1.0, 1.0) for _ in range(dim))


def embed(ids: Sequence[int], dim: int, keep: int | None = None) -> list[float]:
    """The unit embedding of ``ids`` in ``dim`` dimensions; ``keep`` leading ones, renormalised
    (a Matryoshka model's ``dimensions``)."""
    acc = [0.0] * dim
    for token, count in Counter(ids).items():
        for j, x in enumerate(_direction(token, dim)):
            acc[j] += count * x
    acc = acc[:keep] if keep else acc
    norm = math.sqrt(sum(x * x for x in acc)) or 1.0
    return [round(x / norm, _ROUND) for x in acc]


def class_logits(ids: Sequence[int], dim: int, classes: int = 2) -> list[float]:
    """A sequence-classification head's logits: the first ``classes`` embedding components, scaled."""
    return [round(4.0 * x, _ROUND) for x in embed(ids, dim)[:classes]]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return sum(x * y for x, y in zip(a, b)) / (na * nb) if na and nb else 0.0


def softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [round(e / total, _ROUND) for e in exps]
