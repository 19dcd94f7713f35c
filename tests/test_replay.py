"""Trace expansion, oracle hit rates and an end-to-end replay against a simulated worker."""

from __future__ import annotations

import asyncio
import csv
import json
from pathlib import Path

from bench.burst_trace import bursts
from bench.hit_loss import served, split
from bench.replay import main as replay_main
from bench.replay import replay
from bench.trace import TraceRecord, bounded_oracle_hit_rate, conversation_keys, expand, load_trace, oracle_hit_rate
from simulator.cluster import SimCluster
from tests.sim_support import sim_worker

TRACE = Path(__file__).parent / "data" / "mooncake_conversation_head500.jsonl"  # see data/README.md


def test_expand_is_deterministic_and_prefixes_are_real():
    a = TraceRecord(0, 1100, 5, [7, 8, 9])
    b = TraceRecord(0, 700, 5, [7, 8])
    c = TraceRecord(0, 600, 5, [6, 8])
    ta, tb, tc = expand(a), expand(b), expand(c)
    assert len(ta) == 1100 and len(tb) == 700 and ta.isascii() and ta.isprintable()
    assert ta[:700] == tb  # same leading hash ids -> same leading tokens
    assert tc[:512] != ta[:512] and expand(a) == ta


def test_oracle_hit_rates():
    recs = [TraceRecord(0, 1024, 1, [1, 2]), TraceRecord(1, 1024, 1, [1, 2]), TraceRecord(2, 1024, 1, [1, 3])]
    # 2nd: everything but the last page (1024 - 64); 3rd: the first block (512)
    assert oracle_hit_rate(recs, page_size=64) == (960 + 512) / 3072
    assert bounded_oracle_hit_rate(recs, 10**9, page_size=64) == oracle_hit_rate(recs, page_size=64)
    assert bounded_oracle_hit_rate(recs, 512, page_size=64) < oracle_hit_rate(recs, page_size=64)
    real = load_trace(TRACE, 500)
    inf = oracle_hit_rate(real)
    assert 0 < bounded_oracle_hit_rate(real, 200_000) <= inf < 1



def test_conversation_keys_follow_the_first_block_after_the_shared_head():
    recs = [TraceRecord(0, 1500, 1, [0, 1, 2]), TraceRecord(1, 1500, 1, [0, 3, 4]),
            TraceRecord(2, 2000, 1, [0, 1, 2, 5]), TraceRecord(3, 400, 1, [0])]
    assert conversation_keys(recs) == ["conv-1", "conv-3", "conv-1", None]
    assert conversation_keys(recs[:1]) == [None] and conversation_keys([]) == []


def test_replay_sends_session_keys_as_a_header():
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    seen: list[str | None] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("X-Session-ID"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"text": "x", "meta_info": {"prompt_tokens": 1, "completion_tokens": 1}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        async with TestServer(app) as server:
            recs = [TraceRecord(0, 10, 1, [0, 1]), TraceRecord(0, 10, 1, [0, 2])]
            result = await replay(recs, str(server.make_url("")), time_scale=1.0, session_keys=["a", None])
            assert result.summary()["ok"] == 2

    asyncio.run(run())
    assert len(seen) == 2 and set(seen) == {"a", None}


def test_burst_trace_shares_one_system_prompt_per_burst():
    recs = bursts(prompts=2, prefix_blocks=3, tail_blocks=2, burst=4, count=3, gap_ms=1000)
    assert len(recs) == 12 and [r.timestamp for r in recs] == sorted(r.timestamp for r in recs)
    by_burst = [[r for r in recs if b * 1000 <= r.timestamp < b * 1000 + 1000] for b in range(3)]
    assert [len(b) for b in by_burst] == [4, 4, 4]
    # one system prompt per burst, cycling; every tail is the request's own
    assert [{tuple(r.hash_ids[:3]) for r in b} for b in by_burst] == [{(0, 1, 2)}, {(3, 4, 5)}, {(0, 1, 2)}]
    tails = [tuple(r.hash_ids[3:]) for r in recs]
    assert len(set(tails)) == 12 and all(len(t) == 2 for t in tails)
    assert all(r.input_length == 5 * 512 for r in recs)
    # the whole prompt but the last partial page is reusable by the burst's later requests
    assert oracle_hit_rate(recs) > 0.4


def test_hit_loss_splits_lost_hits_into_diverted_and_evicted(tmp_path):
    recs = [TraceRecord(0, 1024, 1, [1, 2]), TraceRecord(1, 1024, 1, [1, 2]),
            TraceRecord(2, 1024, 1, [1, 2]), TraceRecord(3, 1024, 1, [1, 3])]
    # Engine logs as the simulator writes them with --log-requests, one file per worker.
    (tmp_path / "unified-0-1.log").write_text(
        "x rid=replay-0-5 prompt=1024 cached=0 (device 0) ttft=0.1\n"
        "x rid=replay-1-6 prompt=1024 cached=448 (device 448) ttft=0.1\n")  # stayed, lost 512 of 960
    (tmp_path / "unified-1-2.log").write_text(
        "x rid=replay-2-7 prompt=1024 cached=0 ttft=0.1\n"  # went elsewhere: 960 diverted
        "x rid=replay-3-8 prompt=1024 cached=512 ttft=0.1\n")  # block 1 is held there: a full hit
    (tmp_path / "router.log").write_text("rid=replay-0-1 prompt=1 cached=1\n")  # not an engine
    got = served(tmp_path)
    assert served([tmp_path / "unified-1-2.log"]) == {2: ("unified-1-2", 0), 3: ("unified-1-2", 512)}
    assert got == {0: ("unified-0-1", 0), 1: ("unified-0-1", 448), 2: ("unified-1-2", 0), 3: ("unified-1-2", 512)}
    s = split(recs, got, page_size=64)
    assert s["hit"] == 960 / 4096
    assert s["evicted"] == 512 / 4096 and s["diverted"] == 960 / 4096 and s["requests_diverted"] == 1
    # Every reusable token is either reused or lost one of the two ways.
    assert s["hit"] + s["evicted"] + s["diverted"] == oracle_hit_rate(recs, page_size=64)


def test_replay_against_simulator(tmp_path):
    recs = [TraceRecord(i * 1000, 700 + i, 4, [0, 100 + (i % 2)]) for i in range(12)]  # 20 ms apart in wall time
    with sim_worker("--time-scale", "50") as (url, _):
        result = asyncio.run(replay(recs, url, api="generate", speedup=50, concurrency=8))
        s = result.summary()
        assert s["ok"] == 12 and s["time_scale"] == 50
        assert all(r.completion_tokens == 4 and r.ttft_s is not None for r in result.rows)
        # every request after the first two shares a full 576-token prefix page run with an earlier one
        assert sum(r.cached_tokens for r in result.rows[2:]) >= 10 * 512
        chat = asyncio.run(replay(recs[:4], url, api="chat", speedup=50, concurrency=4))
        assert chat.summary()["ok"] == 4 and chat.rows[3].cached_tokens > 0
        trace = tmp_path / "t.jsonl"
        trace.write_text("\n".join(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                               "output_length": r.output_length, "hash_ids": r.hash_ids})
                                   for r in recs))
        out = tmp_path / "out"
        assert replay_main(["--url", url, "--trace", str(trace), "--limit", "6", "--api", "completions",
                            "--out", str(out)]) == 0
        # several workers: client-side routing, per-worker load sampled from /v1/loads
        with SimCluster(workers=2, engine_args=["--time-scale", "50"], kv_events=False) as c:
            multi = asyncio.run(replay(recs, c.urls, api="generate", speedup=50, load_urls=c.urls,
                                       load_interval=0.02))
        assert {r.worker for r in multi.rows} == set(c.urls)
        assert {x.url for x in multi.loads} == set(c.urls)
    rows = list(csv.DictReader(open(out / "requests.csv")))
    assert len(rows) == 6 and all(r["ok"] == "True" for r in rows)
    assert json.loads((out / "summary.json").read_text())["summary"]["ok"] == 6
    assert (out / "ttft_cdf.png").stat().st_size > 0 and (out / "hit_rate.png").exists()
