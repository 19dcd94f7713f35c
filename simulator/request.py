"""A request inside the simulated engine: its prompt, its planned output, and where the
scheduler has it (waiting, prefilling, running, finished) with what it found cached."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from .generation import Planned

CLIP_MAX_NEW = 4096  # SGLang's CLIP_MAX_NEW_TOKENS for the reservation estimate

WAITING, PREFILL, RUNNING, FINISHED = "waiting", "prefill", "running", "finished"


@dataclass(eq=False, slots=True)
class Req:
    rid: str
    input_ids: list[int]
    planned: Planned
    cache_salt: str | None = None
    priority: int | None = None
    prefilled: bool = False  # PD decode: KV arrived from prefill, skip the extend
    use_cache: bool = True
    dp_rank: int = 0
    arrival: float = field(default_factory=time.monotonic)
    state: str = WAITING
    digests: list[bytes] | None = None
    hashes: list[int] | None = None
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0  # loaded from the Mooncake pool (HiCache L3)
    pool: object = None  # pool_tier.Prefetch, when a storage backend is on
    extended: int = 0
    node: object = None
    locked_len: int = 0
    decode_start: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    abort_message: str | None = None
    done: asyncio.Future | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def out_len(self) -> int:
        return len(self.planned.out)

    @property
    def max_new(self) -> int:
        return min(self.out_len, CLIP_MAX_NEW)

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage
