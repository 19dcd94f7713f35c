"""PD disaggregation roles: the prefill bootstrap server and a real Mooncake KV transfer.

Flow (SGLang's, with the simulator's own control messages on the bootstrap server):
1. decode gets a request with ``bootstrap_host/port/room``, reserves a region of its
   registered pool (prompt tokens x ``--kv-bytes-per-token``), asks the prefill's bootstrap
   server ``GET /route`` and then ``POST /kv/transfer`` with its Mooncake session and
   destination address, and waits (``--disaggregation-waiting-timeout``);
2. prefill computes the prompt (scheduler, cost model), fills its source region with the
   request's KV bytes, waits for the decode's info for that room
   (``--disaggregation-bootstrap-timeout``), and ``transfer_sync_write``s the bytes into
   the decode's memory over the Mooncake transfer engine;
3. decode verifies the CRC32 the prefill reports against the bytes that landed, then runs
   the decode phase.

Bytes and time are scaled like the pool tier's (``pool_tier.py``): the bytes really moved
over loopback are ``--kv-bytes-per-token`` per prompt token (small, to fit this machine),
while the transfer is *charged* as the model's KV (``profile.kv_bytes_per_token``) over a
``--transfer-bandwidth-gbps`` link, in simulated seconds. Each prefill has one link (its
NIC), served first come first served: a transfer starts when both its KV and its decode's
registration are ready and the link is free, and the decode is answered when the link
would have finished it. Loopback time overlaps that window; when loopback alone takes
longer (a busy CPU), the excess is counted as lag (``TransferStats.max_lag_sim_s``), not
hidden. ``meta_info.kv_transfer`` and the ``kv_transfer_*`` metrics report the model's
bytes and simulated time; the loopback figures ride along as ``loopback_*``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import aiohttp
import msgspec
from aiohttp import web

from .engine import Engine
from .items import ApiError, Item
from .kv_pool import KVPool
from .scheduler import FINISHED, Req

log = logging.getLogger("simulator.pd")
_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()
_PATTERN_LEN = 1 << 16


def _kv_bytes(room: int, n: int) -> bytes:
    """The 'KV cache' of a request: deterministic per room, cheap to make for any size."""
    pattern = random.Random(room).randbytes(_PATTERN_LEN)
    reps = n // _PATTERN_LEN + 1
    return (pattern * reps)[:n]


@dataclass(slots=True)
class TransferStats:
    """PD KV traffic of one worker (``/server_info`` -> ``simulator.pd_transfer``)."""

    transfers: int = 0
    model_bytes: int = 0  # the profile's KV bytes (what a real fleet would move)
    loopback_bytes: int = 0  # bytes really moved through Mooncake here
    sim_s: float = 0.0  # simulated transfer time charged, link queueing included
    queue_sim_s: float = 0.0  # of which waiting for the link
    loopback_wall_s: float = 0.0
    max_lag_sim_s: float = 0.0  # loopback outlasting the modelled transfer

    def add(self, model_bytes: int, loopback_bytes: int, sim_s: float, loopback_s: float) -> None:
        self.transfers += 1
        self.model_bytes += model_bytes
        self.loopback_bytes += loopback_bytes
        self.sim_s += sim_s
        self.loopback_wall_s += loopback_s

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class TransferEngineHandle:
    """One Mooncake TransferEngine per worker, with one registered pool."""

    def __init__(self, host: str, pool_bytes: int) -> None:
        from mooncake.engine import TransferEngine  # ImportError -> PD mode refuses to start

        self.te = TransferEngine()
        rc = self.te.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize failed ({rc})")
        self.session = f"{host}:{self.te.get_rpc_port()}"
        # own threads: a transfer must not queue behind HiCache backups in the default executor
        self.executor = ThreadPoolExecutor(2, thread_name_prefix="pd-transfer")
        self.pool = KVPool(pool_bytes)
        rc = self.te.register_memory(self.pool.base, pool_bytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory failed ({rc})")

    def write(self, peer_session: str, src_off: int, dst_addr: int, n: int) -> tuple[int, float]:
        """(return code, seconds the write took in its thread)."""
        t0 = time.perf_counter()
        rc = self.te.transfer_sync_write(peer_session, self.pool.base + src_off, dst_addr, n)
        return rc, time.perf_counter() - t0


@dataclass
class _Room:
    decode_info: asyncio.Future
    result: asyncio.Future
    created: float = field(default_factory=time.monotonic)


class PrefillPD:
    def __init__(self, engine: Engine, te: TransferEngineHandle) -> None:
        self.engine = engine
        self.te = te
        self.rooms: dict[int, _Room] = {}
        self.registered: list[dict] = []
        self._runner: web.AppRunner | None = None
        self.stats = TransferStats()
        self.link_free_at = 0.0  # simulated instant this prefill's link finishes its queue
        self.link_bytes_per_s = engine.args.transfer_bandwidth_gbps * 1e9

    def _room(self, room: int) -> _Room:
        r = self.rooms.get(room)
        if r is None:
            loop = asyncio.get_running_loop()
            r = self.rooms[room] = _Room(loop.create_future(), loop.create_future())
        return r

    async def start(self) -> None:
        app = web.Application()
        app.router.add_put("/route", self._put_route)
        app.router.add_get("/route", self._get_route)
        app.router.add_get("/health", lambda r: web.Response(text="OK"))
        app.router.add_post("/kv/transfer", self._kv_transfer)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        a = self.engine.args
        await web.TCPSite(self._runner, a.host, a.disaggregation_bootstrap_port).start()

    async def close(self) -> None:
        if self._runner:
            await self._runner.cleanup()
        self.te.executor.shutdown(wait=False, cancel_futures=True)

    async def _put_route(self, request: web.Request) -> web.Response:
        self.registered.append(_dec.decode(await request.read()))
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.Response:
        a = self.engine.args
        if request.query.get("engine_rank", "-1") == "-1":
            body = {"prefill_attn_tp_size": 1, "prefill_dp_size": a.dp_size, "prefill_pp_size": 1,
                    "prefill_page_size": self.engine.page_size}
        else:
            body = {"rank_ip": a.host, "rank_port": self.te.te.get_rpc_port()}
        return web.Response(body=_enc.encode(body), content_type="application/json")

    async def _kv_transfer(self, request: web.Request) -> web.Response:
        """Decode's registration for a room; answered once the KV bytes have been written."""
        info = _dec.decode(await request.read())
        st = self._room(int(info["room"]))
        if not st.decode_info.done():
            st.decode_info.set_result(info)
        try:
            result = await asyncio.wait_for(asyncio.shield(st.result), self.engine.args.disaggregation_waiting_timeout)
        except asyncio.TimeoutError:  # the request for this room never reached this prefill
            self._fail(st, "prefill never received the request for this room")
            self.rooms.pop(int(info["room"]), None)
            result = st.result.result()
        return web.Response(body=_enc.encode(result), content_type="application/json")

    async def send(self, item: Item, req: Req) -> dict:
        """After the prefill forward: push this request's KV to its decode."""
        room = int(item.bootstrap_room) if item.bootstrap_room is not None else None
        if room is None:  # SGLang prefill without a room cannot hand off; answer like a unified worker
            return {}
        a, eng = self.engine.args, self.engine
        st = self._room(room)
        n = req.prompt_len * a.kv_bytes_per_token
        off = await self.te.pool.alloc(n, a.disaggregation_bootstrap_timeout)
        try:
            data = _kv_bytes(room, n)
            self.te.pool.write(off, data)
            checksum = zlib.crc32(data)
            try:
                info = await asyncio.wait_for(asyncio.shield(st.decode_info), a.disaggregation_bootstrap_timeout)
            except asyncio.TimeoutError:
                self._fail(st, "bootstrap timeout")
                raise ApiError(500, f"Prefill bootstrap failed for request {req.rid}: no decode for room {room}",
                               "InternalServerError") from None
            if eng.fault_roll(a.fault_transfer_fail_rate):
                eng.metrics.transfer_failed.inc()
                self._fail(st, "injected transfer failure (--fault-transfer-fail-rate)")
                raise ApiError(500, f"KV transfer failed for request {req.rid}", "InternalServerError")
            loop = asyncio.get_running_loop()
            ready, end = self._reserve_link(req.prompt_len)
            rc, loop_s = await loop.run_in_executor(self.te.executor, self.te.write, info["session"], off,
                                                    int(info["dst_addr"]), n)
            if rc != 0:
                eng.metrics.transfer_failed.inc()
                self._fail(st, f"mooncake transfer_sync_write returned {rc}")
                raise ApiError(500, f"KV transfer failed for request {req.rid}", "InternalServerError")
            wait = (end - eng.clock.now()) / eng.clock.scale
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                self.stats.max_lag_sim_s = max(self.stats.max_lag_sim_s, -wait * eng.clock.scale)
            model = req.prompt_len * eng.profile.kv_bytes_per_token
            ms = (end - ready) * 1000
            self.stats.add(model, n, end - ready, loop_s)
            observe_transfer(eng, model, ms)
            if not st.result.done():
                st.result.set_result({"ok": True, "checksum": checksum, "bytes": n, "transfer_ms": ms,
                                      "model_bytes": model, "loopback_ms": loop_s * 1000})
            return {"kv_transfer": {"bytes": model, "latency_ms": ms, "loopback_bytes": n,
                                    "loopback_ms": loop_s * 1000}}
        finally:
            await self.te.pool.free(off, n)
            self.rooms.pop(room, None)

    def _reserve_link(self, prompt_tokens: int) -> tuple[float, float]:
        """(ready, end): simulated instants this transfer is ready and its last byte lands,
        queued behind the transfers already on this prefill's link."""
        eng = self.engine
        ready = eng.clock.now()
        link_s = prompt_tokens * eng.profile.kv_bytes_per_token / self.link_bytes_per_s
        start = max(ready, self.link_free_at)
        self.link_free_at = start + link_s
        self.stats.queue_sim_s += start - ready
        return ready, self.link_free_at

    def _fail(self, st: _Room, why: str) -> None:
        if not st.result.done():
            st.result.set_result({"ok": False, "error": why})

    def queue_gauges(self) -> dict[str, float]:
        return {"num_prefill_bootstrap_queue_reqs": sum(1 for r in self.rooms.values() if not r.decode_info.done())}

    def abort(self, rid: str | None) -> int:
        return 0  # a prefill request is in the scheduler until its (bounded) hand-off


class DecodePD:
    def __init__(self, engine: Engine, te: TransferEngineHandle) -> None:
        self.engine = engine
        self.te = te
        self.transferring = 0
        self.stats = TransferStats()
        self.pending: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()

    async def close(self) -> None:
        if self._session:
            await self._session.close()
        self.te.executor.shutdown(wait=False, cancel_futures=True)

    def queue_gauges(self) -> dict[str, float]:
        return {"num_decode_transfer_queue_reqs": self.transferring, "num_decode_prealloc_queue_reqs": 0}

    async def receive(self, item: Item, req: Req) -> Req:
        """Wait for this request's KV from its prefill, then hand it to the scheduler.

        The wait runs as its own task so ``/abort_request`` (a router aborting the decode leg
        after its prefill leg failed) can end it without tearing down the HTTP response.
        """
        task = asyncio.get_running_loop().create_task(self._receive(item, req))
        self.pending[req.rid] = task
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # aborted through /abort_request
                return self._failed(req, "Abort before KV transfer finished", transfer_failure=False)
            task.cancel()  # our client went away
            raise
        finally:
            self.pending.pop(req.rid, None)

    def abort(self, rid: str | None) -> int:
        tasks = list(self.pending.values()) if rid is None else [t for t in (self.pending.get(rid),) if t]
        for t in tasks:
            t.cancel()
        return len(tasks)

    async def _receive(self, item: Item, req: Req) -> Req:
        a, eng = self.engine.args, self.engine
        n = req.prompt_len * a.kv_bytes_per_token
        host = item.bootstrap_host or "127.0.0.1"
        port = item.bootstrap_port or 8998
        self.transferring += 1
        t0 = time.perf_counter()
        off = None
        try:
            off = await self.te.pool.alloc(n, a.disaggregation_waiting_timeout)
            timeout = aiohttp.ClientTimeout(total=a.disaggregation_waiting_timeout)
            base = f"http://{host}:{port}"
            async with self._session.get(base + "/route", params={"engine_rank": "0", "target_dp_group": "0"},
                                         timeout=timeout) as r:
                r.raise_for_status()
            body = {"room": int(item.bootstrap_room), "rid": req.rid, "session": self.te.session,
                    "dst_addr": self.te.pool.base + off, "nbytes": n}
            async with self._session.post(base + "/kv/transfer", data=_enc.encode(body), timeout=timeout) as r:
                r.raise_for_status()
                result = _dec.decode(await r.read())
            if not result.get("ok"):
                raise RuntimeError(result.get("error", "prefill reported failure"))
            got = zlib.crc32(self.te.pool.read(off, n))
            if got != result["checksum"] or result["bytes"] != n:
                raise RuntimeError(f"KV checksum mismatch ({got:#x} != {result['checksum']:#x})")
            self.stats.add(result["model_bytes"], n, result["transfer_ms"] / 1000, result["loopback_ms"] / 1000)
            observe_transfer(eng, result["model_bytes"], result["transfer_ms"])
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, MemoryError, OSError) as e:
            log.warning("decode transfer for %s failed: %s", req.rid, e)
            return self._failed(req, f"Decode transfer failed for request rid={req.rid}: {type(e).__name__} {e}")
        finally:
            self.transferring -= 1
            if off is not None:
                await self.te.pool.free(off, n)
        req.first_token_at = time.monotonic()
        log.debug("room %s: %d bytes in %.1f ms", item.bootstrap_room, n, (time.perf_counter() - t0) * 1000)
        return eng.submit(req, item.dp_rank)

    def _failed(self, req: Req, message: str, transfer_failure: bool = True) -> Req:
        if transfer_failure:
            self.engine.metrics.transfer_failed.inc()
        req.state = FINISHED
        req.abort_message = message
        req.done = asyncio.get_running_loop().create_future()
        req.done.set_result(None)
        self.engine._on_finish(req)
        return req


def observe_transfer(engine: Engine, model_bytes: int, sim_ms: float) -> None:
    engine.metrics.kv_transfer_ms.observe(sim_ms)
    if sim_ms > 0:
        engine.metrics.kv_transfer_speed.set(model_bytes / sim_ms / 1e6)


async def start_pd(engine: Engine) -> PrefillPD | DecodePD:
    a = engine.args
    if a.disaggregation_transfer_backend not in ("mooncake", "fake"):
        raise ApiError(400, f"transfer backend {a.disaggregation_transfer_backend!r} is not simulated")
    te = TransferEngineHandle(a.host, a.kv_pool_mb * 1024 * 1024)
    pd: PrefillPD | DecodePD = PrefillPD(engine, te) if a.disaggregation_mode == "prefill" else DecodePD(engine, te)
    await pd.start()
    return pd
