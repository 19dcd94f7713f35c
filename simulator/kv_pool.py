"""A registered host buffer carved into per-request regions (first-fit free list).

Mooncake transfers need registered memory; registering per request is slow, so each
worker registers one pool at start and hands out byte ranges.
"""

from __future__ import annotations

import asyncio
import ctypes


class KVPool:
    def __init__(self, nbytes: int) -> None:
        self.size = nbytes
        self.buf = ctypes.create_string_buffer(nbytes)
        self.base = ctypes.addressof(self.buf)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), sorted
        self._changed = asyncio.Condition()

    def try_alloc(self, n: int) -> int | None:
        for i, (off, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (off + n, length - n)
                return off
        return None

    async def alloc(self, n: int, timeout: float) -> int:
        """Wait (bounded) for a region of ``n`` bytes; returns its offset."""
        if n > self.size:
            raise MemoryError(f"KV region of {n} bytes exceeds the {self.size}-byte pool (raise --kv-pool-mb)")
        async with self._changed:
            off = self.try_alloc(n)
            if off is None:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._fits(n)), timeout)
                off = self.try_alloc(n)
            assert off is not None
            return off

    def _fits(self, n: int) -> bool:
        return any(length >= n for _, length in self._free)

    async def free(self, off: int, n: int) -> None:
        async with self._changed:
            self._free.append((off, n))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for o, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((o, length))
            self._free = merged
            self._changed.notify_all()

    def write(self, off: int, data: bytes) -> None:
        ctypes.memmove(self.base + off, data, len(data))

    def read(self, off: int, n: int) -> bytes:
        return ctypes.string_at(self.base + off, n)
