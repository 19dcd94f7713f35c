"""One simulated SGLang engine: tokenizer + radix cache + scheduler + telemetry.

The HTTP layers (``http_native``, ``http_openai``) turn requests into ``Item``s
(``simulator.items``), run them (``simulator.runner``) and shape the answers; everything
that SGLang's TokenizerManager and Scheduler would decide lives here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from wire.tokenizer import ByteTokenizer, load_tokenizer

from .clock import SimClock
from .config import version_tuple
from .cost_model import CostModel
from . import logprobs
from .generation import plan_output, seed_for
from .items import ApiError, Item, check_item, expand_generate
from .kv_publisher import KVEventPublisher
from .metrics import Metrics
from .profiles import get_profile
from .protocol import GenerateReqInput
from .radix_cache import RadixCache, build_tiers
from .scheduler import FINISHED, Req, Scheduler

log = logging.getLogger("simulator")
# The storage tier in a worker's trie is its view of the shared pool, which the master
# bounds and evicts; locally it never fills.
POOL_VIEW_TOKENS = 1 << 40


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.version = args.sglang_version
        self.vt = version_tuple(self.version)
        ov = {"max_total_num_tokens": args.max_total_tokens, "max_running_requests": args.max_running_requests,
              "chunked_prefill_size": args.chunked_prefill_size, "context_length": args.context_length}
        self.profile = get_profile(args.profile, **ov)
        self.model_path = args.model_path or self.profile.model_path
        # (whole prompts, as SGLang encodes them: the reference the gateway's prefix reuse is checked against)
        self.tokenizer = (load_tokenizer(args.tokenizer, args.chat_template, reuse_bytes=0) if args.tokenizer
                          else ByteTokenizer())
        self.page_size = args.page_size
        self.mode = args.disaggregation_mode
        self.engine_type = "unified" if self.mode == "null" else self.mode
        self.clock = SimClock(args.time_scale)
        self.rng = random.Random(args.seed)
        self.started = time.monotonic()
        self.ready = False
        self.requests_seen = 0
        self.metrics = Metrics(args.model_name, self.engine_type)
        self.publisher: KVEventPublisher | None = None
        self.ranks: list[Rank] = []
        self._next_rank = 0
        self.pd = None  # set by server for PD roles
        self.page_store = None  # pool_store.PageStore with --hicache-storage-backend mooncake
        self.storage_tokens = 0  # prompt tokens served from the pool
        # finished requests' prompt tokens, and of those the ones served from each cache tier
        self.cached_by_tier = {"prompt": 0, "device": 0, "host": 0, "storage": 0}
        self.storage_speedup: float | None = None

    @property
    def host_tokens(self) -> int:
        a = self.args
        if not (a.enable_hierarchical_cache or a.hicache_ratio or a.hicache_size or a.hicache_storage_backend):
            return 0
        if a.hicache_size:
            return int(a.hicache_size * 1e9 / self.profile.kv_bytes_per_token)
        return int(self.profile.max_total_num_tokens * (a.hicache_ratio or 2.0))

    async def start(self) -> None:
        """Build the loop-bound parts (futures, sockets) inside the running loop.

        ``--dp-size N`` gives N independent ranks (own pool, radix cache, scheduler and KV
        publisher on port base + rank), like SGLang's data parallelism without DP attention.
        """
        self.cost = CostModel(self.profile)
        self.page_store = await self._connect_pool() if self.args.hicache_storage_backend else None
        for rank in range(max(1, self.args.dp_size)):
            tiers = build_tiers(self.profile.max_total_num_tokens, self.host_tokens,
                                POOL_VIEW_TOKENS if self.page_store else 0)
            cache = RadixCache(self.page_size, tiers, write_through=self.args.hicache_write_policy == "write_through",
                               clock=time.monotonic, emit_events=self.args.kv_events is not None)
            publisher = None
            if self.args.kv_events is not None:
                publisher = KVEventPublisher(_rank_config(self.args.kv_events, rank), self.args.host,
                                             legacy_arrays=self.vt < (0, 5, 20), dp_rank=rank)
                publisher.start()
            sched = Scheduler(
                self.cost, cache, self.clock, page_size=self.page_size,
                max_total_tokens=self.profile.max_total_num_tokens, max_running=self.profile.max_running_requests,
                chunk_size=self.profile.chunked_prefill_size,
                on_events=publisher.publish if publisher else None, on_finish=self._on_finish,
                policy=self.args.schedule_policy, priority=self.args.enable_priority_scheduling,
                low_priority_values_first=self.args.schedule_low_priority_values_first,
            )
            if self.page_store is not None:
                sched.pool = self._pool_tier(cache, publisher)
                sched.pool.start()
            sched.start()
            self.ranks.append(Rank(rank, cache, sched, publisher))
        self.scheduler, self.cache, self.publisher = self.ranks[0].scheduler, self.ranks[0].cache, self.ranks[0].publisher
        self.ready = True

    async def stop(self) -> None:
        for r in self.ranks:
            await r.scheduler.stop()
            if r.scheduler.pool is not None:
                await r.scheduler.pool.stop()
            if r.publisher:
                await r.publisher.close()
        if self.page_store is not None:
            await asyncio.to_thread(self.page_store.close)

    async def _connect_pool(self):
        """Join the Mooncake Store named by the extra config (or MOONCAKE_* env vars)."""
        from .pool_store import PageStore, StoreConfig

        cfg = StoreConfig.from_extra_config(self.args.hicache_storage_backend_extra_config)
        store = PageStore(cfg, self.page_size * self.args.kv_bytes_per_token)
        await asyncio.to_thread(store.connect)
        self.storage_speedup = self.args.storage_speedup
        if self.storage_speedup is None and self.args.storage_timing == "measured":
            measured = await asyncio.to_thread(store.calibrate)
            self.storage_speedup = self.args.storage_bandwidth_gbps * 1e9 / measured
        log.info("HiCache storage: mooncake master %s, segment %d MiB, page %d bytes, timing %s, speedup %s",
                 cfg.master_server_address, cfg.global_segment_size >> 20, store.page_bytes,
                 self.args.storage_timing, self.storage_speedup)
        return store

    def _pool_tier(self, cache: RadixCache, publisher: KVEventPublisher | None):
        from .pool_tier import PoolTier

        extra = json.loads(self.args.hicache_storage_backend_extra_config or "{}")
        return PoolTier(self.page_store, cache, self.clock, page_size=self.page_size,
                        policy=self.args.hicache_storage_prefetch_policy,
                        bytes_ratio=self.profile.kv_bytes_per_token / self.args.kv_bytes_per_token,
                        speedup=self.storage_speedup,
                        link_bytes_per_s=(self.args.storage_bandwidth_gbps * 1e9
                                          if self.args.storage_timing == "link" else None),
                        model_page_bytes=self.page_size * self.profile.kv_bytes_per_token,
                        timeout_base=float(extra.get("prefetch_timeout_base", 1.0)),
                        timeout_per_ki_token=float(extra.get("prefetch_timeout_per_ki_token", 0.25)),
                        publish=publisher.publish if publisher else None)

    # ---- ranks -------------------------------------------------------------------------
    def sched_of(self, req: Req) -> Scheduler:
        return self.ranks[req.dp_rank].scheduler

    def abort(self, rid: str | None, message: str) -> int:
        n = sum(r.scheduler.abort(rid, message) for r in self.ranks)
        if self.pd is not None:
            n += self.pd.abort(rid)
        return n

    def flush(self) -> bool:
        if any(r.scheduler.busy() for r in self.ranks):
            return False
        return all(r.scheduler.flush() for r in self.ranks)

    def pool_stats(self) -> dict | None:
        """The Mooncake pool traffic of all ranks (``/server_info``, benchmarks)."""
        if self.page_store is None:
            return None
        from dataclasses import asdict

        out: dict[str, float] = {"credited_tokens": self.storage_tokens}
        for r in self.ranks:
            for k, v in asdict(r.scheduler.pool.stats).items():
                out[k] = max(out.get(k, 0), v) if k == "max_lag_sim_s" else out.get(k, 0) + v
        out["speedup"] = self.storage_speedup
        return out

    def host_tier(self) -> tuple[int, int]:
        """(used, capacity) of the HiCache host pools, summed over ranks."""
        if not self.host_tokens:
            return 0, 0
        return (sum(r.cache.tiers[1].used_tokens for r in self.ranks),
                sum(r.cache.tiers[1].capacity_tokens for r in self.ranks))

    # ---- request parsing (``simulator.items``) ------------------------------------------
    def items_from_generate(self, body: GenerateReqInput) -> tuple[list[Item], bool]:
        """Expand a GenerateReqInput; returns (items, is_batch)."""
        return expand_generate(body, self.tokenizer.encode, strict=self.vt >= (0, 5, 23))

    def validate(self, item: Item) -> None:
        check_item(item, self.profile, len(self.ranks), disaggregated=self.mode != "null")

    # ---- running ------------------------------------------------------------------------
    def make_req(self, item: Item, *, prefilled: bool = False) -> Req:
        p = item.params
        max_new = p.max_new_tokens if p.max_new_tokens is not None else 128
        if self.mode == "prefill":
            max_new = 1  # prefill computes the first token; decode does the rest
        if self.mode == "decode":
            max_new = max(max_new, 1)
        seed = seed_for(item.rid, p, item.bootstrap_room) + item.seed_offset
        planned = plan_output(seed, max_new, p, start=len(item.input_ids))
        return Req(rid=item.rid, input_ids=item.input_ids, planned=planned, cache_salt=item.cache_salt,
                   priority=item.priority, prefilled=prefilled,
                   use_cache=not self.args.disable_radix_cache and self.mode != "decode",
                   arrival=item.received)

    def submit(self, req: Req, dp_rank: int | None = None) -> Req:
        if any(req.rid in r.scheduler.reqs for r in self.ranks):
            raise ApiError(400, f"Duplicate request ID: {req.rid}")
        if dp_rank is None:  # SGLang's DP controller default: round robin
            dp_rank = self._next_rank
            self._next_rank = (self._next_rank + 1) % len(self.ranks)
        req.dp_rank = dp_rank
        return self.ranks[dp_rank].scheduler.submit(req)

    async def stream_progress(self, req: Req) -> AsyncIterator[int]:
        """Yield the generated-token count each time it grows, ending when ``req`` ends."""
        sent = 0
        sched = self.sched_of(req)
        interval = max(1, self.args.stream_interval)
        while True:
            if req.state == FINISHED:
                n = sched.generated(req)
                if n != sent or n == 0:
                    yield n
                return
            n = sched.generated(req)
            if n >= sent + interval or (n > sent and sent == 0):  # the first token goes out at once
                sent = n
                yield n
            await sched.tick()

    def _on_finish(self, req: Req) -> None:
        now = time.monotonic()
        ttft = (req.first_token_at - req.arrival) if req.first_token_at else None
        gen = req.out_len if req.abort_message is None else (1 if req.first_token_at else 0)
        self.storage_tokens += req.cached_storage
        tiers = self.cached_by_tier
        tiers["prompt"] += req.prompt_len
        tiers["device"] += req.cached_device
        tiers["host"] += req.cached_host
        tiers["storage"] += req.cached_storage
        self.metrics.observe_finish(req.prompt_len, req.cached_tokens, gen, ttft, now - req.arrival,
                                    req.abort_message is not None)
        if self.args.log_requests:
            log.info("rid=%s prompt=%d cached=%d (device %d, host %d, storage %d) out=%d ttft=%s e2e=%.4f%s",
                     req.rid, req.prompt_len, req.cached_tokens, req.cached_device, req.cached_host,
                     req.cached_storage, gen,
                     f"{ttft:.4f}" if ttft is not None else "-", now - req.arrival,
                     f" abort={req.abort_message!r}" if req.abort_message else "")

    # ---- answers ---------------------------------------------------------------------------
    def finish_reason(self, req: Req, n: int) -> dict | None:
        if req.abort_message is not None:
            code = 500 if req.abort_message.startswith("Decode transfer") else 400
            return {"type": "abort", "message": req.abort_message, "status_code": code}
        if req.state != FINISHED:
            return None
        if self.mode == "prefill":
            return {"type": "length", "length": 0}
        return req.planned.finish

    def text_of(self, req: Req, n: int) -> str:
        out = req.planned.out
        if req.state == FINISHED and n == len(out):
            return out[: req.planned.text_len].decode("ascii")
        return out[:n].decode("ascii")

    def meta_info(self, req: Req, item: Item, n: int, finished: bool, pd_meta: dict | None = None) -> dict:
        fr = self.finish_reason(req, n) if finished else None
        details = {"device": req.cached_device, "host": req.cached_host}
        if len(self.cache.tiers) > 2:
            details["storage"] = req.cached_storage
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": fr,
            "prompt_tokens": req.prompt_len,
            "weight_version": "default",
            "completion_tokens": n,
            "cached_tokens": req.cached_tokens,
            "cached_tokens_details": details,
            "e2e_latency": time.monotonic() - req.arrival,
        }
        if finished and req.first_token_at is not None:
            meta["response_sent_to_client_ts"] = time.time()
        if pd_meta:
            meta.update(pd_meta)
        if item.return_logprob:
            # A decode worker never ran the prompt forward, so like SGLang it has no prompt
            # logprobs: the router puts prefill's in front.
            start = max(item.logprob_start_len, 0) if item.logprob_start_len >= 0 else len(req.input_ids)
            if self.mode == "decode":
                start = len(req.input_ids)
            text = (lambda t: self.tokenizer.decode([t])) if item.return_text_in_logprobs else None
            meta.update(logprobs.native(req.input_ids, req.planned.out[:n], start, item.top_logprobs_num, text))
        return meta

    def output_ids(self, req: Req, n: int, sent: int = 0) -> list[int]:
        ids = list(req.planned.out[:n])
        if self.vt <= (0, 5, 5):
            return ids[sent:]
        return ids

    def load_snapshots(self) -> list[dict]:
        """One load record per DP rank."""
        cap = self.profile.max_total_num_tokens
        out = []
        for r in self.ranks:
            s = r.scheduler
            used = s.load_tokens
            # a decode worker prefills nothing: SGLang reports no queued prefill for it
            uncached, queued = s.queued_prompt_tokens(self.metrics.cache_hit_rate) if self.mode != "decode" else (0, 0)
            out.append({"dp_rank": r.index, "running": s.running_count, "waiting": s.waiting_count, "used": used,
                        "cap": cap, "usage": used / cap if cap else 0.0, "waiting_uncached": uncached,
                        "total": used + queued})
        return out

    def fault_roll(self, rate: float) -> bool:
        return rate > 0 and self.rng.random() < rate

    def note_request(self) -> None:
        """Counts generation requests for ``--fault-crash-after``."""
        self.requests_seen += 1
        n = self.args.fault_crash_after
        if n and self.requests_seen > n:
            log.error("fault injection: crashing after %d requests", n)
            os._exit(17)


@dataclass(slots=True)
class Rank:
    index: int
    cache: RadixCache
    scheduler: Scheduler
    publisher: KVEventPublisher | None


def _rank_config(cfg: dict, rank: int) -> dict:
    """SGLang binds DP rank r's publisher (and replay socket) at the base port + r."""
    if rank == 0:
        return cfg
    out = dict(cfg)
    for key in ("endpoint", "replay_endpoint"):
        if out.get(key):
            head, port = out[key].rsplit(":", 1)
            out[key] = f"{head}:{int(port) + rank}"
    return out


async def sleep_forever() -> None:
    await asyncio.Event().wait()
