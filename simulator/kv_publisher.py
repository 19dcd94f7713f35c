"""SGLang's ZMQ KV-event publisher: PUB for live events, ROUTER for replay.

Frames are ``[topic, seq (8-byte BE), msgpack(EventBatch)]`` with ``seq`` from 0; the last
``buffer_size`` batches are kept so a subscriber that missed some can ask the ROUTER for
everything from ``start_seq`` (answered as ``[b"", seq, payload]`` ... then seq -1).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from wire.kv_events import EventBatch, encode_batch, pack_seq, unpack_seq

log = logging.getLogger("simulator.kv_events")
_END = pack_seq(-1)


def _bind_addr(endpoint: str, host: str) -> str:
    return endpoint.replace("*", host)


class KVEventPublisher:
    def __init__(self, config: dict, host: str, *, legacy_arrays: bool, dp_rank: int = 0,
                 buffer_size: int = 10_000) -> None:
        self.topic = (config.get("topic") or "").encode()
        self.legacy = legacy_arrays
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._ctx = zmq.asyncio.Context()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(_bind_addr(config["endpoint"], host))
        self.router = None
        self._task: asyncio.Task | None = None
        if config.get("replay_endpoint"):
            self.router = self._ctx.socket(zmq.ROUTER)
            self.router.bind(_bind_addr(config["replay_endpoint"], host))

    def start(self) -> None:
        if self.router is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="kv-replay")

    def publish(self, events: list) -> None:
        if not events:
            return
        payload = encode_batch(EventBatch(time.time(), events, self.dp_rank), legacy_arrays=self.legacy)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        try:
            # a PUB socket never blocks; an asyncio-socket send of a PUB completes at once
            self.pub.send_multipart([self.topic, pack_seq(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover - HWM reached: SGLang drops too
            pass

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) < 3:
                continue
            ident, start = frames[0], unpack_seq(frames[-1])
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([ident, b"", pack_seq(seq), payload])
            await self.router.send_multipart([ident, b"", _END, b""])

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        self._ctx.term()
