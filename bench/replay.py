"""Replay a Mooncake trace against an SGLang-compatible endpoint (a worker or a gateway).

Library use (other benches compare routing policies with it)::

    from bench.replay import replay
    result = asyncio.run(replay(records, "http://127.0.0.1:8000", api="chat", speedup=10))
    result.summary()  # dict; result.rows: one RequestResult per request

CLI::

    python -m bench.replay --url http://127.0.0.1:8000 --trace PATH --limit 500 --speedup 10 \
        --api generate --out bench/out/run1

Timestamps are honoured (divided by ``speedup``) under a concurrency bound; every request
streams so TTFT is measured at the first content chunk. When the target reports a
``time_scale`` (the simulator does), latencies are also given in simulated seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import msgspec

from .trace import DEFAULT_TRACE, TraceRecord, expand, load_trace, oracle_hit_rate

_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()
_JSON = {"Content-Type": "application/json"}


@dataclass(slots=True)
class RequestResult:
    index: int
    scheduled_s: float  # trace time / speedup
    sent_s: float  # when it actually went out (concurrency may delay it)
    ok: bool = False
    status: int = 0
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    worker: str = ""
    max_gap_s: float = 0.0  # longest wait between two events after the first content (a stall)
    engine_e2e_s: float | None = None  # the engine's own e2e_latency (meta_info), from its arrival there


@dataclass
class ReplayResult:
    rows: list[RequestResult]
    wall_s: float
    time_scale: float = 1.0
    meta: dict = field(default_factory=dict)
    loads: list = field(default_factory=list)  # LoadSample, when load_urls were given

    def summary(self) -> dict:
        return summarize(self.rows, self.wall_s, self.time_scale)


def _pct(xs: Sequence[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(p / 100 * (len(s) - 1)))))
    return s[k]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(rows: Sequence[RequestResult], wall_s: float, time_scale: float = 1.0) -> dict:
    ok = [r for r in rows if r.ok]
    f = time_scale
    ttft = [r.ttft_s * f for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s * f for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s * f for r in ok if r.e2e_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tok = sum(r.completion_tokens for r in ok)
    sim_s = wall_s * f
    return {
        "requests": len(rows), "ok": len(ok), "errors": len(rows) - len(ok), "wall_s": wall_s,
        "time_scale": f, "duration_s": sim_s,
        "ttft_mean_s": _mean(ttft), "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_mean_s": _mean(tpot), "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "e2e_p50_s": _pct(e2e, 50), "e2e_p99_s": _pct(e2e, 99),
        "req_per_s": len(ok) / sim_s if sim_s else None, "output_tok_per_s": out_tok / sim_s if sim_s else None,
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
    }


def _body(api: str, text: str, max_tokens: int, model: str, index: int) -> tuple[str, dict]:
    if api == "generate":
        return "/generate", {"text": text, "stream": True, "rid": f"replay-{index}-{time.monotonic_ns()}",
                             "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}
    if api == "completions":
        return "/v1/completions", {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": True,
                                   "ignore_eos": True, "stream_options": {"include_usage": True}}
    return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                    "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                                    "stream_options": {"include_usage": True}}


async def _one(session: aiohttp.ClientSession, base: str, api: str, row: RequestResult, text: str, max_tokens: int,
               model: str, timeout: float, worker_header: str, session_key: str | None = None) -> None:
    path, body = _body(api, text, max_tokens, model, row.index)
    headers = {**_JSON, "X-Request-ID": f"replay-{row.index}"}
    if session_key is not None:
        headers["X-Session-ID"] = session_key
    t0 = time.monotonic()
    try:
        async with session.post(base + path, data=_enc.encode(body), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            row.status = resp.status
            row.worker = resp.headers.get(worker_header, "")
            if resp.status != 200:
                row.error = (await resp.text())[:300]
                return
            last = None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                ev = _dec.decode(data)
                if "error" in ev:
                    row.error = str(ev["error"])[:300]
                    return
                _absorb(api, ev, row, t0)
                if row.ttft_s is not None:
                    now = time.monotonic()
                    if last is not None and now - last > row.max_gap_s:
                        row.max_gap_s = now - last
                    last = now
        row.e2e_s = time.monotonic() - t0
        if row.ttft_s is not None and row.completion_tokens > 1:
            row.tpot_s = (row.e2e_s - row.ttft_s) / (row.completion_tokens - 1)
        row.ok = row.ttft_s is not None
        if not row.ok:
            row.error = row.error or "no content received"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        row.error = f"{type(e).__name__}: {e}"[:300]


def _absorb(api: str, ev: dict, row: RequestResult, t0: float) -> None:
    if api == "generate":
        meta = ev.get("meta_info") or {}
        if row.ttft_s is None and ev.get("text"):
            row.ttft_s = time.monotonic() - t0
        row.prompt_tokens = meta.get("prompt_tokens", row.prompt_tokens)
        row.cached_tokens = meta.get("cached_tokens", row.cached_tokens)
        row.completion_tokens = meta.get("completion_tokens", row.completion_tokens)
        if meta.get("e2e_latency") is not None:
            row.engine_e2e_s = meta["e2e_latency"]
        if meta.get("finish_reason", {}) and meta["finish_reason"].get("type") == "abort":
            row.error = str(meta["finish_reason"].get("message"))
        return
    for ch in ev.get("choices") or ():
        piece = (ch.get("delta") or {}).get("content") if api == "chat" else ch.get("text")
        if piece and row.ttft_s is None:
            row.ttft_s = time.monotonic() - t0
    usage = ev.get("usage")
    if usage:
        row.prompt_tokens = usage.get("prompt_tokens", 0)
        row.completion_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        row.cached_tokens = details.get("cached_tokens") or 0


async def fetch_sim_lag(bases: Sequence[str]) -> float | None:
    """The simulator's worst lag behind its time scale (None when the target is not one)."""
    worst = None
    async with aiohttp.ClientSession() as s:
        for b in bases:
            try:
                async with s.get(b + "/server_info", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        lag = (_dec.decode(await r.read()).get("simulator") or {}).get("max_lag_sim_s")
                        if lag is not None:
                            worst = max(worst or 0.0, float(lag))
            except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError):
                pass
    return worst


async def fetch_time_scale(base: str) -> float:
    """The simulator reports ``time_scale`` in /server_info; real SGLang (and gateways) don't."""
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/server_info", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status == 200:
                    return float(_dec.decode(await r.read()).get("time_scale") or 1.0)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        pass
    return 1.0


Router = Callable[[int, TraceRecord, Sequence[str]], str]


def round_robin(i: int, record: TraceRecord, urls: Sequence[str]) -> str:
    return urls[i % len(urls)]


@dataclass(slots=True)
class LoadSample:
    t_s: float  # wall seconds since replay start
    url: str
    running: int
    waiting: int
    token_usage: float


async def _poll_loads(session: aiohttp.ClientSession, urls: Sequence[str], interval: float, start: float,
                      out: list[LoadSample]) -> None:
    """Sample each worker's /v1/loads (SGLang >= 0.5.10), summed over DP ranks."""
    while True:
        for u in urls:
            try:
                async with session.get(u.rstrip("/") + "/v1/loads", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        loads = _dec.decode(await r.read()).get("loads") or []
                        out.append(LoadSample(time.monotonic() - start, u,
                                              sum(x.get("num_running_reqs", 0) for x in loads),
                                              sum(x.get("num_waiting_reqs", 0) for x in loads),
                                              max((x.get("token_usage", 0.0) for x in loads), default=0.0)))
            except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError):
                pass
        await asyncio.sleep(interval)


async def replay(records: Sequence[TraceRecord], url: str | Sequence[str], *, api: str = "generate",
                 speedup: float = 1.0, concurrency: int = 256, model: str = "default",
                 max_tokens_cap: int | None = None, timeout: float = 600.0, time_scale: float | None = None,
                 worker_header: str = "x-kvgate-worker", router: Router | None = None,
                 load_urls: Sequence[str] = (), load_interval: float = 0.5,
                 on_progress: Callable[[int, int], None] | None = None,
                 session_keys: Sequence[str | None] | None = None) -> ReplayResult:
    """Send every record at ``timestamp / speedup``; returns per-request results.

    ``url`` is one endpoint (a worker or a gateway) or several workers, in which case
    ``router(i, record, urls)`` picks one per request (default round robin) - handy for
    engine-level baselines without a gateway. ``load_urls`` are polled for per-worker load.
    ``time_scale`` converts wall latencies to simulated ones (None: ask /server_info).
    ``session_keys``: one per record (None: none), sent as ``X-Session-ID``.
    """
    urls = [url] if isinstance(url, str) else list(url)
    bases = [u.rstrip("/") for u in urls]
    pick = router or round_robin
    if time_scale is None:
        time_scale = await fetch_time_scale(bases[0])
    sem = asyncio.Semaphore(concurrency)
    t_first = records[0].timestamp if records else 0.0
    rows = [RequestResult(i, (r.timestamp - t_first) / 1000.0 / speedup, 0.0) for i, r in enumerate(records)]
    samples: list[LoadSample] = []
    done = 0
    conn = aiohttp.TCPConnector(limit=concurrency + len(load_urls), force_close=False)
    start = time.monotonic()
    async with aiohttp.ClientSession(connector=conn) as session:
        poller = asyncio.create_task(_poll_loads(session, load_urls, load_interval, start, samples)) if load_urls else None

        async def run(i: int) -> None:
            nonlocal done
            rec, row = records[i], rows[i]
            delay = start + row.scheduled_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            text = expand(rec)
            mt = max(1, rec.output_length if max_tokens_cap is None else min(rec.output_length, max_tokens_cap))
            base = bases[0] if len(bases) == 1 else pick(i, rec, bases)
            async with sem:
                row.sent_s = time.monotonic() - start
                await _one(session, base, api, row, text, mt, model, timeout, worker_header,
                           session_keys[i] if session_keys is not None else None)
            if len(bases) > 1 and not row.worker:
                row.worker = base
            done += 1
            if on_progress:
                on_progress(done, len(records))

        try:
            await asyncio.gather(*(run(i) for i in range(len(records))))
        finally:
            if poller:
                poller.cancel()
    wall = time.monotonic() - start
    meta = {"url": urls if len(urls) > 1 else urls[0], "api": api, "speedup": speedup, "concurrency": concurrency,
            "sim_max_lag_s": await fetch_sim_lag(bases)}
    return ReplayResult(rows, wall, time_scale, meta, samples)


# ---- CLI ---------------------------------------------------------------------------------------
def format_table(summary: dict, oracle: float | None = None) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    lines = [
        f"requests {summary['requests']}  ok {summary['ok']}  errors {summary['errors']}  "
        f"duration {summary['duration_s']:.2f}s (wall {summary['wall_s']:.2f}s, time_scale {summary['time_scale']:g})",
        f"{'metric':<12}{'mean':>10}{'p50':>10}{'p99':>10}",
        f"{'TTFT ms':<12}{ms(summary['ttft_mean_s']):>10}{ms(summary['ttft_p50_s']):>10}{ms(summary['ttft_p99_s']):>10}",
        f"{'TPOT ms':<12}{ms(summary['tpot_mean_s']):>10}{ms(summary['tpot_p50_s']):>10}{ms(summary['tpot_p99_s']):>10}",
        f"{'E2E ms':<12}{'':>10}{ms(summary['e2e_p50_s']):>10}{ms(summary['e2e_p99_s']):>10}",
        f"throughput {summary['req_per_s'] or 0:.2f} req/s, {summary['output_tok_per_s'] or 0:.0f} output tok/s",
        f"hit rate {summary['hit_rate']:.3f} (cached {summary['cached_tokens']} / prompt {summary['prompt_tokens']})"
        + (f"  oracle {oracle:.3f}" if oracle is not None else ""),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, nargs="+", help="a gateway/worker, or several workers (round robin)")
    p.add_argument("--load-urls", nargs="*", default=[], help="workers whose /v1/loads to sample (plots per-worker load)")
    p.add_argument("--load-interval", type=float, default=0.2, help="wall seconds between load samples")
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--speedup", type=float, default=None, help="trace-time divisor (default: the target's time_scale)")
    p.add_argument("--api", choices=["generate", "completions", "chat"], default="generate")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens-cap", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=None, help="override the target's reported time_scale")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None, help="directory for requests.csv, summary.json and PNG plots")
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    records = load_trace(a.trace, a.limit)
    ts = a.time_scale if a.time_scale is not None else asyncio.run(fetch_time_scale(a.url[0].rstrip("/")))
    speedup = a.speedup if a.speedup is not None else ts

    def progress(done: int, total: int) -> None:
        if done % max(1, total // 20) == 0 or done == total:
            print(f"\r{done}/{total} requests", end="", file=sys.stderr, flush=True)

    load_urls = a.load_urls or (a.url if len(a.url) > 1 else [])
    result = asyncio.run(replay(records, a.url if len(a.url) > 1 else a.url[0], api=a.api, speedup=speedup,
                                concurrency=a.concurrency, model=a.model, max_tokens_cap=a.max_tokens_cap,
                                timeout=a.timeout, time_scale=ts, load_urls=load_urls,
                                load_interval=a.load_interval, on_progress=progress))
    print(file=sys.stderr)
    summary = result.summary()
    oracle = oracle_hit_rate(records)
    summary["oracle_hit_rate"] = oracle
    print(format_table(summary, oracle))
    lag = result.meta.get("sim_max_lag_s")
    if lag:
        print(f"note: the simulator fell up to {lag:.2f} simulated s behind its time scale (CPU-bound); "
              "latencies above are inflated by that much at worst - lower --time-scale to remove it")
    if a.out:
        from .report import write_outputs

        paths = write_outputs(result, summary, a.out, plots=not a.no_plots)
        print("wrote " + ", ".join(str(x) for x in paths))
    errors = [r.error for r in result.rows if not r.ok][:3]
    if errors:
        print("first errors: " + " | ".join(errors), file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
