"""Claims: a group's routing decisions made one at a time per worker, through the bus's
server (NATS JetStream), so that a burst spread over several processes does not herd.

Records on the core bus arrive a few hundred microseconds to milliseconds after a
decision; a burst of requests spread round-robin over replicas is decided faster than
that, each process blind to the others' choices, and they all pick the same best worker.
A claim makes the decision atomic per worker with an optimistic check:

- Every routed request's first leg is published, before it is sent to the worker, to a
  JetStream stream with one subject per worker (``<subject>.claims.<worker hash>``),
  with the header ``Nats-Expected-Last-Subject-Sequence``: the last claim on that
  worker this process has applied.
- The server accepts it only when no other claim on that worker came in between. Then
  this process decided knowing every earlier choice of that worker, as one process would.
- Refused, the process waits (``catch_up_s`` at most) until the claims it missed have
  arrived and been booked, and asks its policy again: it may now choose another worker.
  After ``tries`` refusals, it keeps its last choice.

Every process consumes the stream (an ordered consumer, starting from each worker's last
claim), so a claim reaches the peers as fast as the server can push it; the record is
the leg's ``Routed`` record, applied as the core bus's copy would be (the copy that
follows on the core bus is then a duplicate and is ignored).

Nothing waits long on a claim and no request fails because of one. A claim that the
server does not answer within ``timeout_s``, a bus that is down, or a NATS without
JetStream makes the request go with its choice, counted, as without claims.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Callable
from datetime import datetime, timezone

from nats.errors import Error as NatsError

from gateway.bus import batch_header
from nats.js import api
from nats.js.errors import APIError

log = logging.getLogger("kvgate.claims")

STALE_S = 5.0  # a claim stored longer ago than this is only a sequence number
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-sequence check
_LAST = re.compile(r"(\d+)\s*$")


def worker_token(url: str) -> str:
    """A subject token for ``url`` (a URL has dots, which separate subject tokens)."""
    return hashlib.blake2b(url.encode(), digest_size=8).hexdigest()


def stream_name(subject: str) -> str:
    return "KVGATE_CLAIMS_" + re.sub(r"[^A-Za-z0-9_-]", "_", subject)


class Claims:
    """One process's claims; ``on_batch`` applies a claim's record (``Peers.apply``)."""

    def __init__(self, subject: str, on_batch: Callable[[bytes], None], timeout_s: float = 0.05,
                 catch_up_s: float = 0.02, tries: int = 3, max_rps: float = 100.0) -> None:
        self.max_rps = max_rps  # 0: claim every decision
        self._second, self._this_second, self._last_second = 0.0, 0, 0
        self.prefix = f"{subject}.claims"
        self.stream = stream_name(subject)
        self.on_batch = on_batch
        self.timeout_s, self.catch_up_s, self.tries = timeout_s, catch_up_s, tries
        self.ready = False  # a stream and a consumer on this connection
        self.last: dict[str, int] = {}  # worker token -> the sequence of its last claim applied here
        self._waiting: dict[str, list[tuple[int, asyncio.Future]]] = {}
        self._js = None
        self._sub = None
        self.won = self.lost = self.unsettled = 0  # claims accepted, refused, left unanswered

    async def attach(self, nc) -> None:
        """On every (re)connection: the stream (kept in the server's memory, so a restarted
        server needs it again) and a fresh consumer."""
        self.ready = False
        self.last.clear()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except (NatsError, OSError):
                pass
            self._sub = None
        js = nc.jetstream(timeout=2)
        config = api.StreamConfig(name=self.stream, subjects=[self.prefix + ".>"], storage=api.StorageType.MEMORY,
                                  max_msgs_per_subject=1, max_age=600.0, discard=api.DiscardPolicy.OLD)
        try:
            try:
                await js.add_stream(config)
            except APIError as exc:  # there, made by another version: take it as it is
                if exc.err_code != 10058:
                    raise
            self._sub = await js.subscribe(self.prefix + ".>", cb=self._received, ordered_consumer=True,
                                           deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)
        except (NatsError, OSError, asyncio.TimeoutError) as exc:
            log.warning("state bus: no claims (%s): a burst spread over processes may herd; "
                        "enable JetStream on the NATS server", exc or type(exc).__name__)
            return
        self._js = js
        self.ready = True

    def detach(self) -> None:
        self.ready = False

    @property
    def active(self) -> bool:
        """Whether decisions made now claim (``wanted`` without counting one)."""
        return self.ready and (not self.max_rps or (self._this_second <= self.max_rps
                                                    and self._last_second <= self.max_rps))

    def wanted(self) -> bool:
        """Whether this decision should claim: claims work, and this process decided fewer
        than ``max_rps`` requests in this second and the last. A claim costs ~0.2 ms of this
        process's CPU and ~0.15 ms of the server's; at a fleet's LLM rates that is nothing,
        but a process routing thousands of short requests a second would spend most of its
        time on claims, while each blind decision is a small share of its load."""
        if not self.ready:
            return False
        if not self.max_rps:
            return True
        now = time.monotonic()
        if now - self._second >= 1.0:
            self._last_second = self._this_second if now - self._second < 2.0 else 0
            self._second, self._this_second = now, 0
        self._this_second += 1
        return self._this_second <= self.max_rps and self._last_second <= self.max_rps

    async def _received(self, msg) -> None:
        token = msg.subject.rpartition(".")[2]
        meta = msg.metadata
        seq = meta.sequence.stream
        if seq > self.last.get(token, 0):
            self.last[token] = seq
        # A new consumer starts from each worker's last claim, for its sequence: one from long
        # ago is not applied (its request is over; one still in flight comes again on Hello).
        if (datetime.now(timezone.utc) - meta.timestamp).total_seconds() < STALE_S:
            try:
                self.on_batch(msg.data)
            except Exception:
                log.exception("claims: could not apply a claim of %d bytes", len(msg.data))
        self._wake(token)

    def _wake(self, token: str) -> None:
        waiting = self._waiting.get(token)
        if not waiting:
            return
        last = self.last.get(token, 0)
        keep = []
        for seq, future in waiting:
            if seq <= last:
                if not future.done():
                    future.set_result(None)
            else:
                keep.append((seq, future))
        if keep:
            self._waiting[token] = keep
        else:
            del self._waiting[token]

    async def claim(self, url: str, record: bytes) -> bool:
        """Publish ``record`` (an encoded ``Routed``) as a claim on ``url`` (when ``wanted``):
        True when the choice stands (claimed, or the claim could not be settled), False when another
        process claimed ``url`` first; its claim has then been applied here (or waited for
        ``catch_up_s``), and the caller should choose again."""
        if not self.ready:
            return True
        token = worker_token(url)
        expected = self.last.get(token, 0)
        try:
            ack = await self._js.publish(f"{self.prefix}.{token}", batch_header(1) + record, timeout=self.timeout_s,
                                         headers={"Nats-Expected-Last-Subject-Sequence": str(expected)})
        except APIError as exc:
            found = _LAST.search(exc.description or "") if exc.err_code == WRONG_LAST_SEQUENCE else None
            if found is None:
                self.unsettled += 1
                return True
            self.lost += 1
            await self._caught_up(token, int(found.group(1)))
            return False
        except (NatsError, OSError, asyncio.TimeoutError):
            self.unsettled += 1
            return True
        self.won += 1
        if ack.seq > self.last.get(token, 0):
            self.last[token] = ack.seq
        return True

    async def _caught_up(self, token: str, seq: int) -> None:
        """Until the claims on ``token`` up to ``seq`` have been applied here, ``catch_up_s`` at most."""
        if self.last.get(token, 0) >= seq:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(token, []).append((seq, future))
        try:
            await asyncio.wait_for(future, self.catch_up_s)
        except asyncio.TimeoutError:
            # A claim that expired or one this consumer skipped: go on from the server's word.
            self.last[token] = max(self.last.get(token, 0), seq)
            self._wake(token)

    def stats(self) -> dict[str, float]:
        return {"claims_won": float(self.won), "claims_lost": float(self.lost),
                "claims_unsettled": float(self.unsettled), "claims_ready": float(self.ready)}
