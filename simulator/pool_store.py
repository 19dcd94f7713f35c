"""Mooncake Store client for the simulator's L3 tier, keyed exactly like SGLang's HiCache.

SGLang's ``mooncake_store`` backend stores each page as two objects, K and V, under
``f"{page_hash_hex}_{tp_rank}_k"`` / ``"_v"`` where ``page_hash_hex`` is the page's SHA-256
chain digest (``wire.hashing.page_digests``) in hex. Using the same keys means a simulated
engine and a real one read each other's pool entries by name, and the L3 KV-event patch
(``engine_patches/l3_events.py``) derives the same event hashes from them.

The bytes are real (``page_size x kv_bytes_per_token`` per page, split K/V) so transfers
cost what they cost on this box; each object starts with the page digest (zeros after it),
which lets ``get`` detect a key that came back with someone else's bytes.

Every call here blocks (the Mooncake client is synchronous); async callers run them in a
thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger("simulator.pool_store")

DEFAULT_SEGMENT = 64 << 20  # per worker: the slice of its host memory it lends to the pool
DEFAULT_LOCAL_BUFFER = 16 << 20  # SGLang's DEFAULT_LOCAL_BUFFER_SIZE


def parse_size(value: int | str) -> int:
    """``"4gb"``, ``"512mb"``, ``"1024"`` -> bytes (SGLang accepts the same spellings)."""
    if isinstance(value, int):
        return value
    s = str(value).strip().lower()
    for suffix, mult in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10), ("b", 1)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    master_server_address: str
    metadata_server: str
    global_segment_size: int = DEFAULT_SEGMENT
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"

    @classmethod
    def from_extra_config(cls, extra: str | dict | None) -> StoreConfig:
        """SGLang's ``--hicache-storage-backend-extra-config`` JSON, else the MOONCAKE_* env
        vars its Mooncake backend reads (``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``,
        ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``)."""
        cfg = json.loads(extra) if isinstance(extra, str) else dict(extra or {})
        env = os.environ
        master = cfg.get("master_server_address") or env.get("MOONCAKE_MASTER")
        meta = cfg.get("metadata_server") or env.get("MOONCAKE_TE_META_DATA_SERVER")
        if not master or not meta:
            raise ValueError("mooncake storage needs master_server_address and metadata_server "
                             "(extra config or MOONCAKE_MASTER / MOONCAKE_TE_META_DATA_SERVER)")
        protocol = cfg.get("protocol") or env.get("MOONCAKE_PROTOCOL", "tcp")
        if env.get("MC_FORCE_TCP") == "1":
            protocol = "tcp"
        return cls(
            master_server_address=master, metadata_server=meta,
            global_segment_size=parse_size(cfg.get("global_segment_size")
                                           or env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_SEGMENT)),
            local_buffer_size=parse_size(cfg.get("local_buffer_size")
                                         or env.get("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER)),
            protocol=protocol, device_name=cfg.get("device_name", env.get("MOONCAKE_DEVICE", "")),
            local_hostname=cfg.get("local_hostname", env.get("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")),
        )


def master_reachable(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout).close()
        return True
    except OSError:
        return False


class PageStore:
    """Pages of KV in a Mooncake Store, named by their page-hash digests."""

    def __init__(self, config: StoreConfig, page_bytes: int, tp_rank: int = 0) -> None:
        self.config = config
        self.half = max(1, page_bytes // 2)  # K and V objects per page
        self.suffix = f"_{tp_rank}"
        self._store = None

    def connect(self, wait_s: float = 10.0) -> None:
        """Join the pool (mounting this worker's segment). Mooncake's ``setup`` blocks for
        about 90 s against a master that is not there, so the master's port is checked
        first and a missing one fails fast."""
        from mooncake.store import MooncakeDistributedStore

        c = self.config
        deadline = time.monotonic() + wait_s
        while not master_reachable(c.master_server_address):
            if time.monotonic() > deadline:
                raise ConnectionError(f"mooncake master {c.master_server_address} not reachable")
            time.sleep(0.1)
        store = MooncakeDistributedStore()
        rc = store.setup(c.local_hostname, c.metadata_server, c.global_segment_size, c.local_buffer_size,
                         c.protocol, c.device_name, c.master_server_address)
        if rc != 0:
            raise ConnectionError(f"mooncake store setup failed (rc={rc})")
        self._store = store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # ---- keys and bytes --------------------------------------------------------------------
    def keys(self, digest: bytes) -> tuple[str, str]:
        base = digest.hex() + self.suffix
        return base + "_k", base + "_v"

    def _value(self, digest: bytes) -> bytes:
        return (digest + bytes(max(0, self.half - len(digest))))[: self.half]

    def _intact(self, value: bytes, digest: bytes) -> bool:
        n = min(len(digest), self.half)
        return len(value) == self.half and value[:n] == digest[:n]

    @property
    def page_bytes(self) -> int:
        return 2 * self.half

    # ---- operations ------------------------------------------------------------------------
    def put_pages(self, digests: Sequence[bytes]) -> int:
        """Store pages; returns how many went in (a page already there counts)."""
        if not digests:
            return 0
        keys, values = [], []
        for d in digests:
            k, v = self.keys(d)
            val = self._value(d)
            keys += [k, v]
            values += [val, val]
        rc = self._store.put_batch(keys, values)
        if rc != 0:
            log.warning("mooncake put_batch of %d pages failed (rc=%d)", len(digests), rc)
            return 0
        return len(digests)

    def hit_prefix(self, digests: Sequence[bytes]) -> int:
        """Length of the leading run of pages whose K and V both exist in the pool."""
        if not digests:
            return 0
        keys = [k for d in digests for k in self.keys(d)]
        found = self._store.batch_is_exist(keys)
        return _leading(found[2 * i] == 1 and found[2 * i + 1] == 1 for i in range(len(digests)))

    def get_pages(self, digests: Sequence[bytes]) -> int:
        """Fetch pages into local memory; returns the leading run that came back intact."""
        if not digests:
            return 0
        keys = [k for d in digests for k in self.keys(d)]
        values = self._store.get_batch(keys)
        return _leading(self._intact(values[2 * i], d) and self._intact(values[2 * i + 1], d)
                        for i, d in enumerate(digests))

    def timed(self, fn, *args):
        """``(result, seconds)`` of one call, timed inside the calling thread so that waiting
        for an executor slot is not counted as transfer time."""
        t0 = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t0

    def calibrate(self, pages: int = 64, rounds: int = 3) -> float:
        """Bytes/s of an uncontended ``get_pages`` of ``pages`` pages on this box (median of
        ``rounds``), with throwaway keys removed afterwards."""
        digests = [hashlib.sha256(f"kvgate-calibrate-{os.getpid()}-{id(self)}-{i}".encode()).digest()
                   for i in range(pages)]
        if self.put_pages(digests) != pages:
            raise ConnectionError("mooncake calibration put failed")
        times = []
        for _ in range(rounds):
            n, dt = self.timed(self.get_pages, digests)
            if n != pages:
                raise ConnectionError("mooncake calibration get failed")
            times.append(dt)
        self.remove_pages(digests)
        return pages * self.page_bytes / sorted(times)[len(times) // 2]

    def remove_pages(self, digests: Sequence[bytes]) -> int:
        """Remove pages (forced: a fresh object is under lease, plain remove answers -706)."""
        removed = 0
        for d in digests:
            if all(self._store.remove(k, True) == 0 for k in self.keys(d)):
                removed += 1
        return removed


def _leading(flags) -> int:
    """Length of the leading run of true flags: a hole ends a usable prefix."""
    n = 0
    for ok in flags:
        if not ok:
            break
        n += 1
    return n
