"""KV events for HiCache's L3 tier (Mooncake Store), which SGLang defines but never emits.

SGLang publishes ``BlockStored``/``BlockRemoved`` for the GPU tier and the host tier
(``CPU_PINNED``); its ``StorageMedium`` enum also names ``DISK`` and ``EXTERNAL``, but no
code path emits them, so a router cannot know which prefixes sit in the shared Mooncake
pool and credits a cold engine with nothing. This patch closes that gap without touching
SGLang's wire: events go out through SGLang's own ZMQ publisher (same socket, sequence
numbers and replay buffer), as ``medium="EXTERNAL"``.

Hook points (read in SGLang 0.5.7 .. 0.5.23; run-tested against 0.5.23 on CPU):

* ``HiCacheController._page_backup(operation)``: the storage backup thread's per-operation
  write; pages ``hash_value[:completed_tokens // page_size]`` reached L3. -> BlockStored.
* ``HiCacheController._storage_hit_query(operation)``: the prefetch thread's existence
  query; it returns the hit prefix and (0.5.2x) leaves the queried chain in
  ``operation.all_hash_values``. Pages we announced that are now missing were evicted by
  the master -> BlockRemoved; hits we never announced (another engine wrote them to the
  shared pool) -> BlockStored.
* ``EventPublisherFactory.create``: remembers the publisher the scheduler creates, so the
  storage threads can hand it batches (``publish`` only enqueues; it is thread-safe).

Before 0.5.7 SGLang's event hashes were Python ``hash()`` values that cannot be derived
from L3 keys, so the patch refuses older releases; newer ones are refused until someone
re-reads the hook points. Storage keys are the page SHA-256 chain in hex; an event hash is
its first 8 bytes as a signed int64, exactly as SGLang converts them.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any
from weakref import WeakSet

from engine_patches.versions import Version, check_range, fmt, installed_sglang
from wire.hashing import digest_to_int64

log = logging.getLogger("kvgate.engine_patches.l3_events")

TESTED_RANGE: tuple[Version, Version] = ((0, 5, 7), (0, 5, 23))
MEDIUM = "EXTERNAL"
# Hashes this process announced as L3-resident: only these can be retracted. Bounded,
# because the pool outlives any number of requests.
ANNOUNCED_CAP = 1 << 20

_lock = threading.Lock()
_installed = False
_publishers: "WeakSet[Any]" = WeakSet()
_announced: OrderedDict[str, None] = OrderedDict()
_kv: Any = None  # sglang.srt.disaggregation.kv_events, bound by install()


def event_hash(hash_str: str) -> int:
    return digest_to_int64(bytes.fromhex(hash_str[:16]))


def _tokens(token_ids: Any) -> list[int]:
    # 0.5.2x passes a RadixKey (token_ids + extra_key); older releases a plain list.
    return [int(t) for t in getattr(token_ids, "token_ids", token_ids)]


def _publish(events: list[Any]) -> None:
    if not events:
        return
    for pub in list(_publishers):
        try:
            pub.publish(_kv.KVEventBatch(ts=time.time(), events=events))
        except Exception:  # a publisher closing at shutdown must not break the storage thread
            log.debug("L3 event publish failed", exc_info=True)


def _stored(hashes: Sequence[str], tokens: list[int], parent: str | None, page: int) -> Any:
    return _kv.BlockStored(
        block_hashes=[event_hash(h) for h in hashes],
        parent_block_hash=event_hash(parent) if parent else None,
        token_ids=tokens[: len(hashes) * page],
        block_size=page,
        lora_id=None,
        medium=MEDIUM,
    )


def _remember(hashes: Sequence[str]) -> list[str]:
    """Mark hashes announced; return those that were not yet."""
    fresh = []
    with _lock:
        for h in hashes:
            if h in _announced:
                _announced.move_to_end(h)
            else:
                _announced[h] = None
                fresh.append(h)
        while len(_announced) > ANNOUNCED_CAP:
            _announced.popitem(last=False)
    return fresh


def _forget(hashes: Sequence[str]) -> list[str]:
    """Unmark hashes; return those that had been announced."""
    gone = []
    with _lock:
        for h in hashes:
            if h in _announced:
                del _announced[h]
                gone.append(h)
    return gone


def after_backup(controller: Any, operation: Any, done_before: int) -> None:
    page = controller.page_size
    first, last = done_before // page, operation.completed_tokens // page
    hashes = list(operation.hash_value[first:last])
    if not hashes:
        return
    _remember(hashes)
    prefix = getattr(operation, "prefix_keys", None)
    parent = operation.hash_value[first - 1] if first else (prefix[-1] if prefix else None)
    tokens = _tokens(operation.token_ids)[first * page:]
    _publish([_stored(hashes, tokens, parent, page)])


def after_hit_query(controller: Any, operation: Any, hits: Sequence[str]) -> None:
    page = controller.page_size
    queried = getattr(operation, "all_hash_values", None)
    events = []
    fresh = set(_remember(hits))
    if fresh:
        # Announce the hit prefix from the first page this process had not announced.
        start = next(i for i, h in enumerate(hits) if h in fresh)
        prefix = getattr(operation, "prefix_keys", None)
        parent = hits[start - 1] if start else (
            getattr(operation, "last_hash", None) or (prefix[-1] if prefix else None))
        tokens = _tokens(operation.token_ids)[start * page:]
        events.append(_stored(hits[start:], tokens, parent, page))
    if queried is not None:
        gone = _forget(queried[len(hits):])
        if gone:
            events.append(_kv.BlockRemoved(block_hashes=[event_hash(h) for h in gone], medium=MEDIUM))
    _publish(events)


def _wrap_backup(orig: Callable) -> Callable:
    def _page_backup(self: Any, operation: Any) -> Any:
        done_before = operation.completed_tokens
        try:
            return orig(self, operation)
        finally:
            try:
                after_backup(self, operation, done_before)
            except Exception:
                log.exception("kvgate L3 BlockStored emission failed")

    _page_backup.__kvgate_orig__ = orig  # type: ignore[attr-defined]
    return _page_backup


def _wrap_hit_query(orig: Callable) -> Callable:
    def _storage_hit_query(self: Any, operation: Any) -> Any:
        result = orig(self, operation)
        try:
            after_hit_query(self, operation, list(result[0]))
        except Exception:
            log.exception("kvgate L3 hit-query event emission failed")
        return result

    _storage_hit_query.__kvgate_orig__ = orig  # type: ignore[attr-defined]
    return _storage_hit_query


def _wrap_factory(factory: type) -> None:
    static = inspect.getattr_static(factory, "create")
    orig = static.__func__ if isinstance(static, (classmethod, staticmethod)) else static

    def remember(pub: Any) -> Any:
        if hasattr(pub, "publish") and type(pub).__name__ != "NullEventPublisher":
            _publishers.add(pub)
        return pub

    if isinstance(static, staticmethod):
        def create(*a: Any, **kw: Any) -> Any:
            return remember(orig(*a, **kw))
        new: Any = staticmethod(create)
    else:
        def create(cls: type, *a: Any, **kw: Any) -> Any:  # type: ignore[misc]
            return remember(orig(cls, *a, **kw))
        new = classmethod(create)
    create.__kvgate_orig__ = static  # type: ignore[attr-defined]
    setattr(factory, "create", new)


def install(version: Version | None = None) -> bool:
    """Apply once per process; False (and one log line) when the SGLang release is not covered."""
    global _installed, _kv
    version = version or installed_sglang()
    if not check_range("kvgate L3 KV events", version, *TESTED_RANGE):
        return False
    with _lock:
        if _installed:
            return True
        try:
            from sglang.srt.disaggregation import kv_events
            from sglang.srt.managers.cache_controller import HiCacheController
        except ImportError as exc:  # SGLang itself will report this one properly
            log.warning("kvgate L3 KV events: sglang does not import (%s); patch not applied", exc)
            return False

        for name in ("_page_backup", "_storage_hit_query"):
            if not callable(getattr(HiCacheController, name, None)):
                log.warning("kvgate L3 KV events: HiCacheController.%s missing; patch not applied", name)
                return False
        _kv = kv_events
        HiCacheController._page_backup = _wrap_backup(HiCacheController._page_backup)
        HiCacheController._storage_hit_query = _wrap_hit_query(HiCacheController._storage_hit_query)
        _wrap_factory(kv_events.EventPublisherFactory)
        _installed = True
    log.info("kvgate L3 KV events patch applied (sglang %s, medium %s)", fmt(version), MEDIUM)
    return True


def sglang_plugin() -> None:
    """Entry point for SGLang's general plugin group (``sglang.srt.plugins``, 0.5.2x)."""
    install()
