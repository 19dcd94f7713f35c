"""How a scheduler sees its waiting queue: SGLang's schedule policies order it, and its load
snapshot counts the prompt tokens in it.

fcfs keeps arrival order; lpm serves the longest cached prefix first, falling back to fcfs
past 128 waiting, as SGLang does; with priority scheduling the priority decides first
(larger first unless ``--schedule-low-priority-values-first``)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .request import Req

if TYPE_CHECKING:
    from .scheduler import Scheduler

LPM_MAX_WAITING = 128  # SGLang matches the queue against the cache only up to this many


def _lpm(s: Scheduler) -> bool:
    return s.policy == "lpm" and len(s.waiting) <= LPM_MAX_WAITING


def _cached_pages(s: Scheduler, r: Req) -> int:
    if r.hashes is None:
        s.hash_prompt(r)
    return s.cache.match(r.hashes[: (r.prompt_len - 1) // s.page_size], touch=False).pages


def needs_order(s: Scheduler) -> bool:
    return _lpm(s) or (s.priority and s._unsorted)


def ordered(s: Scheduler) -> deque[Req]:
    """The waiting queue in the order the schedule policy takes it."""
    lpm = _lpm(s)
    keyed = []
    for r in s.waiting:
        prio = s._prio_sign * (r.priority or 0) if s.priority else 0
        hit = _cached_pages(s, r) if lpm and r.use_cache else 0
        keyed.append(((prio, -hit, r.arrival), r))
    keyed.sort(key=lambda kr: kr[0])
    return deque(r for _, r in keyed)


def queued_prompt_tokens(s: Scheduler, hit_rate: float) -> tuple[int, int]:
    """(uncached, all) prompt tokens waiting for prefill: every waiting prompt less its cached
    prefix, plus what the chunked prompt has left. SGLang knows a waiting prompt's prefix only
    where its schedule policy matched the queue (lpm, at most 128 waiting); otherwise it takes
    the recent hit rate."""
    exact = _lpm(s)
    uncached = total = 0
    for r in s.waiting:
        total += r.prompt_len
        if exact and r.use_cache:
            uncached += r.prompt_len - _cached_pages(s, r) * s.page_size
        else:
            uncached += round(r.prompt_len * (1.0 - hit_rate))
    if s.chunked is not None:
        rest = s.chunked.prompt_len - s.chunked.extended
        uncached += rest
        total += rest
    return uncached, total
