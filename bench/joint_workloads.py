"""Seeded workloads for ``bench.joint``: where PD disaggregation and KV offload both matter.

Every function returns ``TraceRecord``s (what ``bench.replay`` replays), timestamps in
milliseconds from 0 spread over ``span_s`` seconds, so a caller picks the arrival rate by
``len / span``. Prompts are 512-token blocks named by hash id (``bench.trace.expand``), so
requests that share leading ids share a real token prefix; ids are drawn from disjoint
ranges per workload so two workloads never share a block by accident.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from .trace import BLOCK, TraceRecord, conversation_keys, load_trace

_DOC_IDS = 10_000_000  # hash-id ranges: shared documents, questions, decode-heavy prompts
_QUESTION_IDS = 20_000_000
_DECODE_IDS = 30_000_000


def _blocks(first_id: int, tokens: int) -> list[int]:
    return list(range(first_id, first_id + (tokens + BLOCK - 1) // BLOCK))


def _spread(records: list[TraceRecord], span_s: float) -> list[TraceRecord]:
    """Rescale timestamps so the records span ``span_s`` seconds, order kept."""
    t0, t1 = records[0].timestamp, records[-1].timestamp
    k = span_s * 1000.0 / (t1 - t0) if t1 > t0 else 0.0
    return [TraceRecord((r.timestamp - t0) * k, r.input_length, r.output_length, r.hash_ids) for r in records]


def conversations(trace: str | Path, requests: int, span_s: float, seed: int = 0, min_turns: int = 2,
                  max_output: int = 512) -> list[TraceRecord]:
    """Long multi-turn conversations from the Mooncake conversation trace.

    A seeded sample of the trace's conversations with at least ``min_turns`` turns (each
    turn's prompt holds the previous turns), all their turns, in trace order, until
    ``requests`` records; then the hour of trace time is compressed into ``span_s``, so a
    returning turn still comes back after the traffic that arrived in between. Outputs are
    capped at ``max_output`` tokens to keep a run bounded.
    """
    records = load_trace(trace)
    by_conv: dict[str, list[int]] = defaultdict(list)
    for i, key in enumerate(conversation_keys(records)):
        if key is not None:
            by_conv[key].append(i)
    multi = sorted(k for k, idx in by_conv.items() if len(idx) >= min_turns)
    random.Random(seed).shuffle(multi)
    chosen: list[int] = []
    for key in multi:
        if len(chosen) >= requests:
            break
        chosen += by_conv[key]
    picked = [records[i] for i in sorted(chosen)[:requests]]
    picked = [TraceRecord(r.timestamp, r.input_length, max(1, min(r.output_length, max_output)), r.hash_ids)
              for r in picked]
    return _spread(picked, span_s)


def shared_documents(requests: int, span_s: float, seed: int = 0, documents: int = 40,
                     doc_tokens: tuple[int, int] = (12_000, 32_000), question_tokens: tuple[int, int] = (64, 400),
                     output_tokens: tuple[int, int] = (32, 256), zipf_s: float = 0.8) -> list[TraceRecord]:
    """Long shared-document Q&A: questions about ``documents`` long documents (popularity
    Zipf(``zipf_s``)), each prompt = the whole document + a fresh question; Poisson arrivals."""
    rng = random.Random(seed)
    docs = []
    next_id = _DOC_IDS
    for _ in range(documents):
        n = rng.randint(*doc_tokens) // BLOCK * BLOCK  # whole blocks: the question starts a new one
        docs.append(_blocks(next_id, n))
        next_id += len(docs[-1])
    weights = [1.0 / (k + 1) ** zipf_s for k in range(documents)]
    out = []
    t = 0.0
    for i in range(requests):
        doc = rng.choices(docs, weights)[0]
        q = rng.randint(*question_tokens)
        out.append(TraceRecord(t, len(doc) * BLOCK + q, rng.randint(*output_tokens),
                               doc + _blocks(_QUESTION_IDS + i * 4, q)))
        t += rng.expovariate(1.0)
    return _spread(out, span_s)


def decode_heavy(requests: int, span_s: float, seed: int = 0, long_share: float = 0.15,
                 short_prompt: tuple[int, int] = (512, 2_048), long_prompt: tuple[int, int] = (16_000, 48_000),
                 long_output: tuple[int, int] = (256, 768), short_output: tuple[int, int] = (16, 64),
                 system_tokens: int = 1_024) -> list[TraceRecord]:
    """A decode-heavy mix: most requests are short prompts with long answers (chat, code),
    ``long_share`` are long prompts with short answers (summaries) whose prefill stalls a
    colocated worker's decode batch. Every prompt opens with one shared system prompt."""
    rng = random.Random(seed)
    system = _blocks(_DECODE_IDS, system_tokens)
    next_id = _DECODE_IDS + len(system)
    out = []
    t = 0.0
    for _ in range(requests):
        if rng.random() < long_share:
            n, o = rng.randint(*long_prompt), rng.randint(*short_output)
        else:
            n, o = rng.randint(*short_prompt), rng.randint(*long_output)
        own = _blocks(next_id, n)
        next_id += len(own)
        out.append(TraceRecord(t, system_tokens + n, o, system + own))
        t += rng.expovariate(1.0)
    return _spread(out, span_s)


WORKLOADS: dict[str, Callable[..., list[TraceRecord]]] = {
    "conversation": conversations, "shared_doc": shared_documents, "decode_heavy": decode_heavy,
}
