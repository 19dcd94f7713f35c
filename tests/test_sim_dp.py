"""--dp-size: independent DP ranks in one worker, addressed with routed_dp_rank."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import zmq

from tests.sim_support import join_kv_events, spawn_sim
from tests.support import Proc, ProcExited, bind_failed
from simulator.cluster import _free_run
from wire.kv_events import BlockStored, decode_batch


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _dp2_worker() -> tuple[Proc, int]:
    """A worker with two DP ranks publishing on base and base + 1 (SGLang's layout); a run
    of ports taken before the worker binds it is picked again."""
    for attempt in range(4):
        base = _free_run("127.0.0.1", 2)
        cfg = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{base}", "topic": "kv"})
        try:
            return spawn_sim("--time-scale", "50", "--dp-size", "2", "--kv-events-config", cfg), base
        except ProcExited as exc:
            if attempt == 3 or not bind_failed(exc.proc.output()):
                raise
    raise AssertionError("unreachable")


def test_dp_ranks_have_their_own_cache_loads_and_publishers():
    proc, base = _dp2_worker()
    url = proc.url
    try:
        ctx = zmq.Context()
        subs = []
        for rank in range(2):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(f"tcp://127.0.0.1:{base + rank}")
            subs.append(s)
        try:
            join_kv_events(subs[1], url, routed_dp_rank=1)
            text = "D" * 700
            body = {"text": text, "routed_dp_rank": 1, "sampling_params": {"max_new_tokens": 2}}
            assert post(url + "/generate", body)[1]["meta_info"]["cached_tokens"] == 0
            assert post(url + "/generate", body)[1]["meta_info"]["cached_tokens"] >= 640
            other = post(url + "/generate", dict(body, routed_dp_rank=0))[1]
            assert other["meta_info"]["cached_tokens"] == 0  # rank 0 never saw it
            status, err = post(url + "/generate", dict(body, routed_dp_rank=2))
            assert status == 400
            loads = json.loads(urllib.request.urlopen(url + "/v1/loads", timeout=5).read())["loads"]
            assert [entry["dp_rank"] for entry in loads] == [0, 1]
            # rank 1's events on base + 1, tagged attn_dp_rank 1
            got = []
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not got:
                if subs[1].poll(100):
                    got.append(decode_batch(subs[1].recv_multipart()[2]))
            assert got and got[0].attn_dp_rank == 1
            assert any(isinstance(e, BlockStored) for e in got[0].events)
        finally:
            for s in subs:
                s.close(0)
            ctx.term()
    finally:
        proc.stop()
