"""kv_events over real ZMQ sockets on 127.0.0.1: the engine side is a PUB and a ROUTER
speaking SGLang's KV-event wire (frames built with wire.kv_events.encode_batch)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from policies.base import RequestView, WorkerView
from policies.kv_events import KvEvents
from index.kv_feed import publishers_for
from wire.hashing import page_hashes
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch, pack_seq, unpack_seq

PS = 4
TOPIC = "kv"


class EnginePublisher:
    """The engine's end: an XPUB (a PUB that also shows us when a subscriber joined) and the
    replay ROUTER answering ``[b"", start_seq]`` with its buffer and a seq -1 terminator."""

    def __init__(self, ctx: zmq.asyncio.Context, legacy: bool = False) -> None:
        self.ctx = ctx
        self.legacy = legacy
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replay_requests: list[int] = []
        self._server = asyncio.get_running_loop().create_task(self._serve_replay())

    def server_info(self) -> dict:
        return {"page_size": PS, "kv_events": {
            "publisher": "zmq", "endpoint": f"tcp://*:{self.port}", "topic": TOPIC,
            "replay_endpoint": f"tcp://*:{self.replay_port}"}}

    async def wait_subscriber(self, timeout: float = 5.0) -> None:
        assert await self.pub.poll(int(timeout * 1000)), "no subscriber joined"
        assert (await self.pub.recv())[0] == 1  # subscribe message

    async def send(self, *events, publish: bool = True) -> int:
        return await self.send_payload(encode_batch(EventBatch(time.time(), list(events)), legacy_arrays=self.legacy),
                                       publish)

    async def send_payload(self, payload: bytes, publish: bool = True) -> int:
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if publish:
            await self.pub.send_multipart([TOPIC.encode(), pack_seq(seq), payload])
        return seq

    async def _serve_replay(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            start_seq = unpack_seq(start)
            self.replay_requests.append(start_seq)
            for seq, payload in self.buffer:
                if seq >= start_seq:
                    await self.router.send_multipart([ident, b"", pack_seq(seq), payload])
            await self.router.send_multipart([ident, b"", pack_seq(-1), b""])

    async def close(self) -> None:
        self._server.cancel()
        self.pub.close(0)
        self.router.close(0)


def stored(tokens: list[int], medium: str = "GPU") -> BlockStored:
    return BlockStored(page_hashes(tokens, PS), None, tokens, PS, None, medium)


def req(tokens: list[int] | None, rid: str = "r", text: str | None = None) -> RequestView:
    return RequestView(rid, "/generate", token_ids=tokens, text=text)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _setup(legacy: bool = False, **options):
    ctx = zmq.asyncio.Context()
    engine = EnginePublisher(ctx, legacy=legacy)
    worker = WorkerView("http://127.0.0.1:30001", server_info=engine.server_info())
    other = WorkerView("http://127.0.0.1:30002", server_info={"page_size": PS})
    policy = KvEvents(speculative_ttl_s=0, **options)
    policy.on_worker_added(worker)
    await policy.start()
    await engine.wait_subscriber()
    return ctx, engine, worker, other, policy


def _each_turn(policy: KvEvents) -> tuple[asyncio.Task, list[int]]:
    """A task standing for the requests on the loop, and the events the index had applied
    at each of its turns."""
    index, applied = policy.index.precise, []

    async def bystander() -> None:
        while True:
            applied.append(index.events_applied)
            await asyncio.sleep(0)

    return asyncio.get_running_loop().create_task(bystander()), applied


def _most_per_turn(applied: list[int]) -> int:
    return max(b - a for a, b in zip(applied, applied[1:]))


async def _teardown(ctx, engine, policy) -> None:
    await policy.stop()
    await engine.close()
    ctx.destroy(linger=0)


def hit(policy: KvEvents, worker: WorkerView, tokens: list[int]) -> int:
    return policy.index.precise.match(req(tokens + [0]), [worker]).get(worker.url).total


A, B, C, D = ([k] * 8 for k in (11, 12, 13, 14))


def test_endpoint_comes_from_server_info_with_host_filled_in():
    w = WorkerView("http://10.1.2.3:30000", server_info={"kv_events": {
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5560", "topic": "kv"}, "dp_size": 2})
    pubs = publishers_for(w)
    assert [(p.endpoint, p.replay) for p in pubs] == [
        ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5560"), ("tcp://10.1.2.3:5558", "tcp://10.1.2.3:5561")]
    assert publishers_for(w, {w.url: "tcp://h:1"})[0].endpoint == "tcp://h:1"


def test_dropped_sequence_is_replayed_from_the_router():
    async def main():
        ctx, engine, worker, _, policy = await _setup()
        try:
            await engine.send(stored(A))
            await until(lambda: hit(policy, worker, A) == 8)
            await engine.send(stored(B))
            await engine.send(stored(C), publish=False)  # lost on the wire
            await engine.send(stored(D))
            await until(lambda: hit(policy, worker, D) == 8)
            assert hit(policy, worker, C) == 8, "the lost batch must come back through replay"
            assert engine.replay_requests[-1] == 2
            stats = policy.stats()
            assert stats["kv_gaps"] == 1 and stats["kv_replayed"] >= 1 and stats["kv_unrecoverable"] == 0
        finally:
            await _teardown(ctx, engine, policy)

    asyncio.run(main())


def test_a_burst_is_applied_whole_in_slices_that_let_the_loop_run():
    """A backlog is drained a slice at a time: between slices the loop runs other tasks (the
    requests), and what is left is applied without waiting for the publisher to send more
    (ZMQ's descriptor signals only when new messages arrive)."""
    async def main():
        ctx, engine, worker, _, policy = await _setup(kv_slice_ms=0)  # a message per turn
        bystander, applied = _each_turn(policy)
        try:
            chains = [[1000 + i] * 8 for i in range(300)]
            for c in chains:  # (sends on a ready socket complete without yielding: one burst)
                await engine.send(stored(c))
            await until(lambda: policy.stats()["kv_messages"] == 300)
            assert all(hit(policy, worker, c) == 8 for c in chains)
            assert _most_per_turn(applied) == 1, "more than one message applied in a turn of the loop"
        finally:
            bystander.cancel()
            await _teardown(ctx, engine, policy)

    asyncio.run(main())


def test_past_the_slice_the_other_publishers_wait_for_the_next_turn():
    """With a zero slice one message per turn of the loop, whichever publisher it came from:
    a fleet's backlog cannot hold a turn for a message per publisher."""
    async def main():
        ctx, engine, worker, _, policy = await _setup(kv_slice_ms=0)
        second = EnginePublisher(ctx)
        worker2 = WorkerView("http://127.0.0.1:30003", server_info=second.server_info())
        policy.on_worker_added(worker2)
        await second.wait_subscriber()
        bystander, applied = _each_turn(policy)
        try:
            for i in range(150):
                await engine.send(stored([2000 + i] * 8))
                await second.send(stored([3000 + i] * 8))
            await until(lambda: policy.index.precise.events_applied == 300)
            assert hit(policy, worker, [2149] * 8) == 8 and hit(policy, worker2, [3149] * 8) == 8
            most = _most_per_turn(applied)
            assert most == 1, f"{most} messages applied in one turn of the loop"
        finally:
            bystander.cancel()
            await second.close()
            await _teardown(ctx, engine, policy)

    asyncio.run(main())


def test_a_big_message_is_applied_a_part_at_a_time_between_other_tasks():
    """A scheduler step at page size 1 reports thousands of pages in one message: the loop
    runs other tasks between its parts, which see it partly applied, and then all of it."""
    async def main():
        ctx, engine, worker, _, policy = await _setup(kv_slice_ms=0)
        index = policy.index.precise
        watcher, seen = _each_turn(policy)
        try:
            tokens = list(range(5000, 5000 + 1500 * PS))
            hashes = page_hashes(tokens, PS)
            await engine.send(*(BlockStored([h], hashes[j - 1] if j else None, tokens[j * PS:(j + 1) * PS], PS)
                                for j, h in enumerate(hashes)))  # ~150 KB: one page per event, as SGLang
            await until(lambda: index.events_applied == 1500)
            assert hit(policy, worker, tokens) == 1500 * PS
            partly = sorted({n for n in seen if 0 < n < 1500})
            assert len(partly) >= 4, f"other tasks ran only at {partly} of 1500 events applied"
        finally:
            watcher.cancel()
            await _teardown(ctx, engine, policy)

    asyncio.run(main())


def test_a_batch_this_version_cannot_read_is_dropped_alone():
    async def main():
        ctx, engine, worker, _, policy = await _setup()
        try:
            await engine.send(stored(A))
            await until(lambda: hit(policy, worker, A) == 8)
            for event in ({"type": "BlockPinned", "block_hashes": [1]}, ["BlockStored", [1]]):  # (and a short array)
                await engine.send_payload(msgspec.msgpack.encode([time.time(), [event], None]))
            await engine.send(stored(B))
            await until(lambda: hit(policy, worker, B) == 8)
            stats = policy.stats()
            assert stats["kv_decode_errors"] == 2 and stats["kv_gaps"] == 0
            assert hit(policy, worker, A) == 8, "the worker's blocks must not be cleared"
        finally:
            await _teardown(ctx, engine, policy)

    asyncio.run(main())


def test_gap_the_buffer_no_longer_covers_clears_the_worker():
    async def main():
        ctx, engine, worker, _, policy = await _setup()
        try:
            await engine.send(stored(A))
            await until(lambda: hit(policy, worker, A) == 8)
            await engine.send(stored(B), publish=False)
            engine.buffer.clear()  # the publisher's replay buffer rolled over
            await engine.send(stored(C))
            await until(lambda: policy.stats()["kv_unrecoverable"] == 1)
            await until(lambda: hit(policy, worker, C) == 8)
            assert hit(policy, worker, A) == 0, "state from before the hole must be dropped"
        finally:
            await _teardown(ctx, engine, policy)

    asyncio.run(main())


def test_all_blocks_cleared_removed_and_tiers():
    async def main():
        ctx, engine, worker, _, policy = await _setup(legacy=True)  # <= 0.5.19 array events
        try:
            await engine.send(stored(A), stored(A + B, "CPU_PINNED"))
            await until(lambda: hit(policy, worker, A + B) == 16)
            assert policy.stats()["index_hash_keyed_blocks"] == 0  # the feed decoded the token ids
            tiers = policy.index.precise.match(req(A + B + [0]), [worker]).get(worker.url)
            assert (tiers.gpu, tiers.host) == (8, 8)
            await engine.send(BlockRemoved(page_hashes(A, PS), "GPU"))
            await until(lambda: policy.index.precise.match(req(A + B + [0]), [worker]).get(worker.url).gpu == 0)
            assert hit(policy, worker, A + B) == 16  # still in host memory
            await engine.send(AllBlocksCleared())
            await until(lambda: hit(policy, worker, A + B) == 0)
            assert policy.stats()["index_blocks"] == 0
        finally:
            await _teardown(ctx, engine, policy)

    asyncio.run(main())


def test_late_join_replays_what_the_publisher_buffered_and_restart_clears():
    async def main():
        ctx = zmq.asyncio.Context()
        engine = EnginePublisher(ctx)
        await engine.send(stored(A))  # before anyone subscribes: only the replay buffer has it
        worker = WorkerView("http://127.0.0.1:30001", server_info=engine.server_info())
        policy = KvEvents(speculative_ttl_s=0)
        await policy.start()
        policy.on_worker_added(worker)
        try:
            await engine.wait_subscriber()
            await engine.send(stored(B))
            await until(lambda: hit(policy, worker, B) == 8)
            assert hit(policy, worker, A) == 8 and engine.replay_requests == [0]
            engine.seq = 0  # the engine restarted: sequence numbers start over
            engine.buffer.clear()
            await engine.send(stored(C))
            await until(lambda: hit(policy, worker, C) == 8)
            assert hit(policy, worker, A) == 0 and policy.stats()["kv_restarts"] == 1
            # The publisher goes away: what it described is gone with it.
            engine.pub.close(0)
            await until(lambda: hit(policy, worker, C) == 0)
            assert policy.stats()["kv_disconnects"] >= 1
        finally:
            await _teardown(ctx, engine, policy)

    asyncio.run(main())


def test_routing_follows_events_and_falls_back_without_token_ids(caplog):
    async def main():
        ctx, engine, worker, other, policy = await _setup()
        try:
            long_prompt = [5] * 64
            await engine.send(stored(long_prompt))
            await until(lambda: hit(policy, worker, long_prompt) == 64)
            assert policy.stats()["index_hash_keyed_blocks"] == 0  # keyed by tokens, not SHA
            choice = policy.select(req(long_prompt + [1, 2, 3], "p1"), [other, worker])
            assert choice.worker.url == worker.url and choice.predicted_cached_tokens == 64
            assert choice.reason == "prefix"
            caplog.set_level(logging.WARNING, logger="kvgate.policies")
            text_only = "no tokenizer configured " * 20
            first = policy.select(req(None, "t1", text=text_only), [other, worker])
            second = policy.select(req(None, "t2", text=text_only + "?"), [other, worker])
            assert second.worker.url == first.worker.url and second.reason == "prefix"
            assert policy.stats()["fallback_requests_total"] == 2
            assert caplog.text.count("without token ids") == 1  # logged once
        finally:
            await _teardown(ctx, engine, policy)

    asyncio.run(main())


PUBLISHING = {"page_size": PS, "kv_events": {"endpoint": "tcp://*:5557", "topic": "kv"}}  # never started


def test_speculative_entries_cover_the_gap_before_events():
    policy = KvEvents(speculative_ttl_s=30)
    ws = [WorkerView(f"http://127.0.0.1:{31000 + i}", server_info=PUBLISHING) for i in range(3)]
    for w in ws:
        policy.on_worker_added(w)
    prompt = [9] * 40
    first = policy.select(req(prompt, "a"), ws)
    second = policy.select(req(prompt + [1] * 8, "b"), ws)
    assert second.worker.url == first.worker.url and second.predicted_cached_tokens == 40
    policy.index.precise.expire(now=time.monotonic() + 60)
    assert policy.index.precise.match(req(prompt, "c"), ws).hits == {}


def test_the_text_tree_learns_only_from_the_decisions_it_makes():
    """A chat request carries its text beside its token ids: matched on the precise index,
    its text stays out of the fallback tree (inserting it cost every decision ~21 us); a
    request the tree routes is learned, so its follow-up keeps its worker."""
    policy = KvEvents(speculative_ttl_s=30)
    ws = [WorkerView(f"http://127.0.0.1:{31000 + i}", server_info=PUBLISHING) for i in range(3)]
    for w in ws:
        policy.on_worker_added(w)
    text = "a long chat rendered by its template " * 20
    policy.select(req(list(text.encode()), "a", text=text), ws)
    policy.select(req(list((text + "!").encode()), "b", text=text + "!"), ws)
    assert policy.stats()["approx_index_units"] == 0 and policy.stats()["fallback_requests_total"] == 0
    first = policy.select(req(None, "c", text=text + "?"), ws)  # no ids (say its template failed)
    assert policy.stats()["approx_index_units"] >= len(text) + 1  # (plus its namespace prefix)
    second = policy.select(req(None, "d", text=text + "??"), ws)
    assert second.worker.url == first.worker.url and second.reason == "prefix"


def test_server_info_that_arrives_after_the_worker_is_picked_up():
    async def main():
        ctx = zmq.asyncio.Context()
        engine = EnginePublisher(ctx)
        worker = WorkerView("http://127.0.0.1:30001")  # still starting: no server_info yet
        policy = KvEvents(speculative_ttl_s=0)
        await policy.start()
        policy.on_worker_added(worker)
        try:
            assert policy.stats()["kv_subscribers"] == 0
            worker = worker.reported(server_info=engine.server_info())  # the gateway's discovery caught up
            policy.on_worker_updated(worker)
            await engine.wait_subscriber()
            await engine.send(stored(A))
            await until(lambda: hit(policy, worker, A) == 8)
        finally:
            await _teardown(ctx, engine, policy)

    asyncio.run(main())


def test_fleet_without_kv_events_routes_on_the_approximate_index(caplog):
    caplog.set_level(logging.WARNING, logger="kvgate.policies")
    policy = KvEvents()
    ws = [WorkerView(f"http://127.0.0.1:{32000 + i}", server_info={"page_size": PS}) for i in range(3)]
    for w in ws:
        policy.on_worker_added(w)
    prompt = "a long shared document " * 30
    first = policy.select(req(list(prompt.encode()), "a", text=prompt), ws)
    second = policy.select(req(list((prompt + "?").encode()), "b", text=prompt + "?"), ws)
    assert second.worker.url == first.worker.url and second.reason == "prefix"
    stats = policy.stats()
    assert stats["fallback_no_events_total"] == 2 and stats["fallback_requests_total"] == 2
    assert "publishes KV events" in caplog.text and "names no KV event publisher" in caplog.text
