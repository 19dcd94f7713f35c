"""The shared HiCache L3 pool for real: a ``mooncake_master`` and Mooncake Store clients on
127.0.0.1, simulated workers that back pages up to it and load them back, the gateway in
front, and the KV events (medium ``EXTERNAL``) that tell a router what the pool holds."""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request

import pytest

from tests.requires import missing, need
from tests.sim_support import join_kv_events
from tests.support import FREE_PORT, Proc, serve
from wire.hashing import digest_to_int64, page_digests, page_hashes

need("mooncake.store", "pip install mooncake-transfer-engine-non-cuda")
zmq = need("zmq")

from simulator.cluster import SimCluster  # noqa: E402
from simulator.pool_master import MooncakeMaster, master_binary  # noqa: E402
from simulator.pool_store import PageStore, StoreConfig  # noqa: E402
from simulator.pool_tier import Prefetch  # noqa: E402
from wire.kv_events import BlockRemoved, BlockStored, decode_batch  # noqa: E402

if master_binary() is None:
    missing("mooncake_master binary not found (pip install mooncake-transfer-engine-non-cuda)")

PAGE = 64
ENGINE = ("--profile", "tiny-test", "--time-scale", "4", "--page-size", str(PAGE), "--hicache-ratio", "1",
          "--kv-bytes-per-token", "1024", "--hicache-storage-prefetch-policy", "wait_complete")


def _post(url: str, body: dict, timeout: float = 30) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else {}


def _prompt(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(chr(97 + rng.randrange(26)) for _ in range(n))


class EventTap:
    """A SUB socket on one worker's KV-event publisher, connected before the traffic."""

    def __init__(self, endpoint: str, worker_url: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.events: list = []
        join_kv_events(self.sub, worker_url)  # subscribed: the warm-up prompts' events are dropped

    def drain(self, until, timeout: float = 10.0) -> list:
        deadline = time.monotonic() + timeout
        while not until(self.events) and time.monotonic() < deadline:
            if self.sub.poll(100):
                frames = self.sub.recv_multipart()
                self.events.extend(decode_batch(frames[-1]).events)
        return self.events

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def _external(events: list, kind: type) -> set[int]:
    return {h for e in events if isinstance(e, kind) and e.medium == "EXTERNAL" for h in e.block_hashes}


@pytest.fixture
def master():
    with MooncakeMaster() as m:
        yield m


@pytest.mark.parametrize("port", ["http_port", "metrics_port"])
def test_master_picks_new_ports_when_one_is_taken(port):
    """A port picked free can be bound by another process before the master binds it."""
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        m = MooncakeMaster()
        setattr(m, port, squatter.getsockname()[1])
        with m:
            assert getattr(m, port) != squatter.getsockname()[1] and m.popen.poll() is None


def test_pages_put_get_and_shared_between_clients(master):
    cfg = StoreConfig.from_extra_config(master.extra_config("16mb"))
    a, b = PageStore(cfg, page_bytes=PAGE * 512), PageStore(cfg, page_bytes=PAGE * 512)
    a.connect()
    b.connect()
    try:
        digests = page_digests(list(range(10 * PAGE)), PAGE)
        assert a.keys(digests[0]) == (digests[0].hex() + "_0_k", digests[0].hex() + "_0_v")  # SGLang's names
        assert b.hit_prefix(digests) == 0
        assert a.put_pages(digests[:6]) == 6
        assert b.hit_prefix(digests) == 6  # the other client sees the pool
        assert b.get_pages(digests[:6]) == 6  # and gets the bytes back intact
        assert a.remove_pages(digests[2:3]) == 1  # forced: fresh objects are under lease
        assert b.hit_prefix(digests) == 2
        assert b.get_pages(digests[:6]) == 2  # a hole ends the usable prefix
    finally:
        a.close()
        b.close()


def test_store_config_from_env(monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:1")
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", "http://127.0.0.1:2/metadata")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1gb")
    cfg = StoreConfig.from_extra_config(None)
    assert (cfg.master_server_address, cfg.global_segment_size, cfg.protocol) == ("127.0.0.1:1", 1 << 30, "tcp")
    assert StoreConfig.from_extra_config('{"global_segment_size": "512mb"}').global_segment_size == 512 << 20


def test_prefetch_policies_credit_what_was_loaded():
    pf = Prefetch(pages=10, start=100.0, load_s=2.0)
    assert pf.credited(100.5, "wait_complete") == 10  # the request waited for all of it
    assert pf.credited(101.0, "best_effort") == 5  # admitted halfway through the load
    assert pf.credited(105.0, "best_effort") == 10
    timed = Prefetch(pages=10, start=100.0, load_s=2.0, limit_s=1.0)
    assert timed.credited(105.0, "timeout") == 5  # cut off after limit_s


def _gateway(*worker_urls: str) -> Proc:
    return serve([sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", FREE_PORT, "--worker-urls",
                  *worker_urls, "--health-check-interval-secs", "0.3", "--policy", "round_robin"], "/readiness",
                 name="gateway", timeout=30)


def _wait_ready(gw: Proc, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(gw.url + "/workers", timeout=5) as resp:
            workers = json.loads(resp.read())
        items = workers.get("workers", workers) if isinstance(workers, dict) else workers
        if items and all(w.get("healthy", True) for w in items):
            return
        time.sleep(0.2)
    raise TimeoutError(f"gateway workers not healthy: {items}")


def test_pool_hit_on_another_worker_through_the_gateway():
    """Worker A serves a long prompt (write-through backs its pages up to the pool); the
    gateway then only has worker B, which has never seen the prompt: B loads it from the
    pool (cached_tokens_details.storage) and announces the pool pages as EXTERNAL."""
    prompt = _prompt(1, 3000)
    with SimCluster(workers=2, engine_args=ENGINE, pool=True, pool_segment="32mb") as cluster:
        a, b = cluster.urls
        tap_a, tap_b = EventTap(cluster.kv_event_endpoints[a], a), EventTap(cluster.kv_event_endpoints[b], b)
        gw = _gateway(a)
        try:
            out = _post(gw.url + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 4}})
            assert out["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
            want = set(page_hashes(list(prompt.encode()), PAGE)[: (len(prompt) - 1) // PAGE])
            events_a = tap_a.drain(lambda ev: want <= _external(ev, BlockStored))
            assert want <= _external(events_a, BlockStored), "A never announced its backups as EXTERNAL"

            _post(gw.url + "/workers", {"url": b})
            req = urllib.request.Request(gw.url + "/workers/" + a, method="DELETE")
            urllib.request.urlopen(req, timeout=5).read()
            _wait_ready(gw)
            out = _post(gw.url + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 4}})
            details = out["meta_info"]["cached_tokens_details"]
            assert details["storage"] == len(want) * PAGE and details["device"] == 0, details
            assert out["meta_info"]["cached_tokens"] == details["storage"]
            events_b = tap_b.drain(lambda ev: want <= _external(ev, BlockStored))
            assert want <= _external(events_b, BlockStored)
            stored_b = [e for e in events_b if isinstance(e, BlockStored) and e.medium == "EXTERNAL"]
            assert stored_b[0].parent_block_hash is None and stored_b[0].block_size == PAGE

            # B now has the prompt on its GPU: the next request is a device hit
            again = _post(gw.url + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 4}})
            assert again["meta_info"]["cached_tokens_details"]["device"] == len(want) * PAGE
        finally:
            gw.stop()
            tap_a.close()
            tap_b.close()


def test_pages_the_pool_lost_are_retracted():
    """B loads a prompt from the pool, other prompts push it out of B's GPU and host (B
    still believes the pool has it), the pool loses the tail: B's next lookup credits only
    what is left and retracts the rest with BlockRemoved EXTERNAL."""
    prompt = _prompt(2, 2000)
    usable = (len(prompt) - 1) // PAGE
    digests = page_digests(list(prompt.encode()), PAGE)[:usable]
    hashes = [digest_to_int64(d) for d in digests]
    with SimCluster(workers=2, engine_args=ENGINE, pool=True, pool_segment="32mb") as cluster:
        a, b = cluster.urls
        tap_b = EventTap(cluster.kv_event_endpoints[b], b)
        store = PageStore(StoreConfig.from_extra_config(cluster.master.extra_config("16mb")), PAGE * 1024)
        store.connect()
        try:
            _post(a + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1}})
            deadline = time.monotonic() + 10
            while store.hit_prefix(digests) < usable and time.monotonic() < deadline:
                time.sleep(0.1)
            out = _post(b + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1}})
            assert out["meta_info"]["cached_tokens_details"]["storage"] == usable * PAGE
            for seed in (10, 11, 12):  # 3 x 3800 tokens through a 4096-token GPU and host
                _post(b + "/generate", {"text": _prompt(seed, 3800), "sampling_params": {"max_new_tokens": 1}})
            gone_local = tap_b.drain(lambda ev: set(hashes) <= {
                h for e in ev if isinstance(e, BlockRemoved) and e.medium == "CPU_PINNED" for h in e.block_hashes})
            assert not set(hashes) & _external(gone_local, BlockRemoved)
            assert store.remove_pages(digests[5:]) == usable - 5
            out = _post(b + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1}})
            assert out["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 5 * PAGE}
            events = tap_b.drain(lambda ev: set(hashes[5:]) <= _external(ev, BlockRemoved))
            assert set(hashes[5:]) <= _external(events, BlockRemoved)
            assert not set(hashes[:5]) & _external(events, BlockRemoved)
        finally:
            store.close()
            tap_b.close()


def test_kvgate_up_pd_pool_serves():
    proc = serve([sys.executable, "-m", "gateway.cli", "up", "--pd", "--pool", "--prefill-workers", "1",
                  "--decode-workers", "1", "--port", FREE_PORT, "--profile", "tiny-test", "--time-scale", "4"],
                 "/readiness", name="kvgate-up")
    base = proc.url
    try:
        out = _post(base + "/generate", {"text": _prompt(3, 600), "sampling_params": {"max_new_tokens": 8}})
        assert out["meta_info"]["completion_tokens"] == 8
    finally:
        proc.stop()


def _pool_stats(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/server_info", timeout=5).read())["simulator"]["pool"]


def test_link_timing_charges_the_models_bytes_over_the_storage_bandwidth():
    """With --storage-timing link a pool load costs the profile's KV bytes (tiny-test: 128 KiB
    per token) over --storage-bandwidth-gbps in simulated seconds, not its loopback time."""
    prompt = _prompt(7, 2000)
    pages = (len(prompt) - 1) // PAGE
    engine = (*ENGINE, "--storage-timing", "link", "--storage-bandwidth-gbps", "10")
    with SimCluster(workers=2, engine_args=engine, pool=True, pool_segment="32mb") as cluster:
        a, b = cluster.urls
        _post(a + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 2}})
        deadline = time.monotonic() + 10
        while _pool_stats(a)["backup_pages"] < pages and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pool_stats(a)["backup_pages"] >= pages
        out = _post(b + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 2}})
        assert out["meta_info"]["cached_tokens_details"]["storage"] == pages * PAGE
        stats = _pool_stats(b)
        assert stats["fetched_pages"] == pages and stats["speedup"] is None  # no calibration in link timing
        assert stats["load_sim_s"] == pytest.approx(pages * PAGE * 131072 / 10e9)
        assert stats["fetch_bytes"] == pages * PAGE * 1024  # what really moved: --kv-bytes-per-token
