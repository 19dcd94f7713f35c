"""What fits in a scheduler's KV pool: SGLang admits a request when its uncached prompt, the
host pages it brings back and a share of its output fit in the free plus evictable tokens,
less what the running requests' outputs are expected to take (``new_token_ratio``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .request import PREFILL, Req

if TYPE_CHECKING:
    from .scheduler import Scheduler

RESERVE_RATIO = 0.3  # SGLang's new_token_ratio decays from 0.7 towards ~0.14; a middle value


def reserved(s: Scheduler) -> int:
    return int(max(0, s.sum_max_new - s.gen_tokens_running) * RESERVE_RATIO)


def make_room(s: Scheduler, need: int) -> bool:
    """Whether ``need`` tokens fit, evicting cached pages nobody holds if that makes them fit."""
    avail = s.capacity - s.used_tokens - reserved(s)
    if avail >= need:
        return True
    if avail + s.cache.evictable_tokens() < need:
        return False
    s.cache.evict(0, need - avail)
    return s.capacity - s.used_tokens - reserved(s) >= need


def take_ready(s: Scheduler) -> None:
    """PD decode: start the requests whose KV has arrived, while they fit."""
    while s.ready and s.n_run < s.max_running:
        r = s.ready[0]
        if not make_room(s, r.prompt_len + int(r.max_new * RESERVE_RATIO)):
            break
        s.ready.popleft()
        s.private_prompt += r.prompt_len
        s.sum_max_new += r.max_new
        r.extended = r.prompt_len
        s.start_decode(r)


def admit(s: Scheduler, r: Req) -> tuple[bool, int]:
    """Match ``r``'s prompt in the cache (and the pool), lock the prefix and book its memory:
    (admitted, host tokens to load back)."""
    ps = s.page_size
    if r.hashes is None:
        s.hash_prompt(r)
    m = None
    if r.use_cache:
        m = s.cache.match(r.hashes[: (r.prompt_len - 1) // ps])  # always extend >= 1 token
        if s.pool is not None:
            m = s.pool.limit(m, r, s.sim_now)
        s.cache.lock(m.last)
    cached_pages = m.pages if m else 0
    host_pages = cached_pages - (m.per_tier[0] if m else 0)
    cached = cached_pages * ps
    if not make_room(s, (r.prompt_len - cached) + host_pages * ps + int(r.max_new * RESERVE_RATIO)):
        if m:
            s.cache.unlock(m.last)
        return False, 0
    if m and host_pages:
        s.cache.promote(m.nodes)
    r.node = m.last if m else None
    r.locked_len = cached
    r.cached_device = (m.per_tier[0] if m else 0) * ps
    storage_pages = m.per_tier[2] if m and len(m.per_tier) > 2 else 0
    r.cached_host = (host_pages - storage_pages) * ps
    r.cached_storage = storage_pages * ps
    r.extended = cached
    r.state = PREFILL
    s.private_prompt += r.prompt_len - cached
    s.sum_max_new += r.max_new
    return True, host_pages * ps
