"""Workers added or removed through the admin routes are the group's, not one process's.

An admin call lands on one process of a group (``--processes``) or on one replica behind a
Service. That process applies it to its registry, then publishes a ``Member`` record, and
every peer applies it to its own (a runtime add is vetted by each peer's
``--worker-url-allow``, as one made there would be). For each url the latest change wins,
ordered by its origin's clock and then the origin's name, so an add and a remove made at two
places at once settle the same everywhere. Every ``Hello`` (a peer joined, restarted or
reconnected) makes each process send the changes it knows again: a member that replaced a
dead one, or a replica started later, converges on the group's fleet, removals of workers
its own configuration names included. Workers from the configuration or from discovery are
each process's own and are not published.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from gateway.config import WorkerSpec
from gateway.records import Member, encode

log = logging.getLogger("kvgate.membership")


class SharedMembership:
    def __init__(self, registry: Any, publish: Callable[[bytes], None], origin: str) -> None:
        self.registry = registry  # gateway.workers.WorkerRegistry
        self.publish = publish
        self.origin = origin
        self.known: dict[str, Member] = {}  # url -> the latest change made here or heard
        self.applied = 0  # peers' changes that changed this registry
        self._tasks: set[asyncio.Task] = set()

    # -- changes made here (the admin routes, after the registry accepted them) -----------
    def added(self, spec: WorkerSpec) -> None:
        url = spec.url.rstrip("/")
        self._made(Member(self.origin, time.time(), url, True, spec.role, spec.bootstrap_port, spec.api_key))

    def removed(self, url: str) -> None:
        self._made(Member(self.origin, time.time(), url.rstrip("/"), False))

    def _made(self, record: Member) -> None:
        self.known[record.url] = record
        self.publish(encode(record))

    def resend(self) -> None:
        for record in self.known.values():
            self.publish(encode(record))

    # -- peers' changes ------------------------------------------------------------------
    def apply(self, record: Member) -> None:
        last = self.known.get(record.url)
        if last is not None and (last.sent, last.origin) >= (record.sent, record.origin):
            return  # heard before, or older than what this process knows
        self.known[record.url] = record
        here = record.url in self.registry.workers
        if record.present and not here:
            task = asyncio.get_running_loop().create_task(self._add(record))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif not record.present and here:
            self.registry.remove(record.url)
            self.applied += 1
            log.info("worker %s removed by peer %s", record.url, record.origin)

    async def _add(self, record: Member) -> None:
        spec = WorkerSpec(record.url, record.role, record.bootstrap_port, record.api_key)
        try:
            await self.registry.add(spec)
        except ValueError:  # added meanwhile (by an admin call here, or an earlier record)
            return
        except Exception as exc:  # refused by this process's --worker-url-allow, or unreachable
            log.warning("worker %s added by peer %s was not added here: %s", record.url, record.origin, exc)
            return
        self.applied += 1
        log.info("worker %s added by peer %s", record.url, record.origin)
        latest = self.known.get(record.url)
        if latest is not None and not latest.present and record.url in self.registry.workers:
            self.registry.remove(record.url)  # removed somewhere while this add was probing it

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
