"""KV events from a running simulator, read by a real ZMQ subscriber and decoded with wire.kv_events."""

from __future__ import annotations

import json
import time
import urllib.request

import msgspec
import pytest
import zmq

from tests.sim_support import join_kv_events, sim_worker
from tests.support import FREE_PORT
from wire.hashing import page_hashes
from wire.kv_events import AllBlocksCleared, BlockStored, decode_batch, pack_seq, unpack_seq

VECTOR = [3817746824117602890, -4216701448867210342]  # tokens [1,2,3,4], page size 2


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read()) if r.headers.get("Content-Type", "").startswith("application/json") else {}


def _collect(sub: zmq.Socket, want, timeout: float = 5.0) -> list:
    frames_seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(100):
            frames = sub.recv_multipart()
            frames_seen.append(frames)
            if want(frames_seen):
                break
    return frames_seen


@pytest.mark.parametrize("version,legacy", [("0.5.23", False), ("0.5.19", True)])
def test_hash_vector_and_replay(version, legacy):
    cfg = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{FREE_PORT}", "topic": "kv",
                      "replay_endpoint": f"tcp://*:{FREE_PORT}"})
    with sim_worker("--page-size", "2", "--time-scale", "50", "--kv-events-config", cfg,
                    "--sglang-version", version) as (url, proc):
        info = json.loads(urllib.request.urlopen(url + "/server_info", timeout=5).read())
        assert info["kv_events"]["endpoint"] == f"tcp://*:{proc.ports[0]}"
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(info["kv_events"]["endpoint"].replace("*", "127.0.0.1"))
        try:
            joined_at = join_kv_events(sub, url)
            _post(url + "/generate", {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 1}})

            def stored(fs):
                hs = [h for f in fs for e in decode_batch(f[2]).events if isinstance(e, BlockStored)
                      for h in e.block_hashes]
                return set(VECTOR) <= set(hs)

            frames = _collect(sub, stored)
            assert frames and stored(frames), frames
            assert all(f[0] == b"kv" and len(f[1]) == 8 for f in frames)
            assert [unpack_seq(f[1]) for f in frames] == list(range(joined_at + 1, joined_at + 1 + len(frames)))
            raw = msgspec.msgpack.decode(frames[0][2])
            assert isinstance(raw[1][0], list if legacy else dict)  # event encoding follows the version
            events = [e for f in frames for e in decode_batch(f[2]).events]
            first = next(e for e in events if e.block_hashes == [VECTOR[0]])
            second = next(e for e in events if e.block_hashes == [VECTOR[1]])
            assert (first.parent_block_hash, first.token_ids, first.block_size, first.medium) == (None, [1, 2], 2, "GPU")
            assert (second.parent_block_hash, second.token_ids) == (VECTOR[0], [3, 4])

            # a salted request chains from the salt seed, never sharing pages with unsalted ones
            _post(url + "/generate", {"input_ids": [1, 2, 3, 4, 5], "cache_salt": "tenant-a",
                                      "sampling_params": {"max_new_tokens": 1}})
            salted = page_hashes([1, 2, 3, 4], 2, "tenant-a")
            got = _collect(sub, lambda fs: any(e.block_hashes == [salted[1]] for f in fs
                                               for e in decode_batch(f[2]).events if isinstance(e, BlockStored)))
            assert got and not set(salted) & set(VECTOR)
            salted_ev = next(e for f in got for e in decode_batch(f[2]).events
                             if isinstance(e, BlockStored) and e.block_hashes == [salted[1]])
            assert salted_ev.parent_block_hash == salted[0]
            if not legacy:  # the array form has no slot for it
                assert salted_ev.cache_salt == "tenant-a"

            # flush -> AllBlocksCleared
            urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"), timeout=5)
            got = _collect(sub, lambda fs: any(isinstance(e, AllBlocksCleared) for f in fs
                                               for e in decode_batch(f[2]).events))
            assert any(isinstance(e, AllBlocksCleared) for f in got for e in decode_batch(f[2]).events)
            last_seq = unpack_seq(got[-1][1])

            # replay from seq 1: every buffered batch from 1 on, then seq -1
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(info["kv_events"]["replay_endpoint"].replace("*", "127.0.0.1"))
            dealer.send_multipart([b"", pack_seq(1)])
            seqs = []
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                assert dealer.poll(2000), "replay did not answer"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if unpack_seq(seq) == -1:
                    break
                decode_batch(payload)
                seqs.append(unpack_seq(seq))
            assert seqs == list(range(1, last_seq + 1))
            dealer.close(0)
        finally:
            sub.close(0)
            ctx.term()


def test_the_gateway_feed_replays_what_it_missed_from_the_simulators_router(monkeypatch):
    """The gateway's KV-event feed against a simulated engine's real PUB and ROUTER: it
    subscribes after the first prompts were served (late join: replayed from seq 0), then
    loses one message on the wire (a gap: replayed strictly from the ROUTER), and ends with
    an index that predicts exactly what the engine reports cached for every prompt."""
    import asyncio

    from policies.base import RequestView, WorkerView
    from index.kv_subscriber import Subscriber
    from policies.kv_events import KvEvents

    cfg = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{FREE_PORT}", "topic": "kv",
                      "replay_endpoint": f"tcp://*:{FREE_PORT}"})
    # 3 whole pages and a partial one (an engine recomputes a prompt's last token), nothing shared
    prompts = [[100 + k] * 12 + [7] * (1 + k % 3) for k in range(12)]

    def serve_prompt(url: str, tokens: list[int]) -> int:
        out = _post(url + "/generate", {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1}})
        return out["meta_info"]["cached_tokens"]

    async def main(url: str) -> None:
        info = json.loads(urllib.request.urlopen(url + "/server_info", timeout=5).read())
        worker = WorkerView(url, server_info=info)
        sent = prompts[:2]
        for tokens in sent:  # before anyone subscribes: only the replay buffer has these
            await asyncio.to_thread(serve_prompt, url, tokens)
        policy = KvEvents(speculative_ttl_s=0)
        policy.on_worker_added(worker)
        await policy.start()
        feed, dropped = policy.feed, []
        real_receive = Subscriber._receive

        async def lossy(self, pub, seq, payload, expected, pace):
            if feed.counters["messages"] >= 1 and not dropped:
                dropped.append(seq)  # lost on the wire: never applied, the next one shows the gap
                return expected
            return await real_receive(self, pub, seq, payload, expected, pace)

        monkeypatch.setattr(Subscriber, "_receive", lossy)

        def predicted(tokens: list[int]) -> int:
            return policy.index.precise.match(RequestView("p", "/generate", token_ids=tokens), [worker]).get(url).total

        try:
            for tokens in prompts[2:]:  # until the subscription joined, one message was lost and replayed
                sent.append(tokens)
                await asyncio.to_thread(serve_prompt, url, tokens)
                if feed.counters["gaps"]:
                    break
                await asyncio.sleep(0.05)
            deadline = time.monotonic() + 10
            while predicted(sent[-1]) == 0:  # events arrive in order: all before it are in too
                assert time.monotonic() < deadline, feed.counters
                await asyncio.sleep(0.02)
            c = feed.counters
            assert dropped and c["gaps"] == 1 and c["unrecoverable"] == 0 and c["replayed"] >= 3, c
            expected = [predicted(tokens) for tokens in sent]
            engine = [await asyncio.to_thread(serve_prompt, url, tokens) for tokens in sent]
            assert expected == engine and all(engine), (expected, engine)
        finally:
            await policy.stop()

    with sim_worker("--page-size", "4", "--time-scale", "50", "--kv-events-config", cfg) as (url, _):
        asyncio.run(main(url))
