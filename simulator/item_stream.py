"""Interleave the progress streams of several items (a batch / n>1) into one stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from .engine import Engine
from .items import ApiError, Item
from .runner import Progress, run_item


async def merged(engine: Engine, items: list[Item]) -> AsyncIterator[Progress | ApiError]:
    if len(items) == 1:
        try:
            async for p in run_item(engine, items[0], stream=True):
                yield p
        except ApiError as e:
            yield e
        return
    queue: asyncio.Queue[Progress | ApiError | None] = asyncio.Queue()

    async def pump(item: Item) -> None:
        try:
            async for p in run_item(engine, item, stream=True):
                await queue.put(p)
        except ApiError as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(it)) for it in items]
    try:
        live = len(tasks)
        while live:
            p = await queue.get()
            if p is None:
                live -= 1
                continue
            yield p
    finally:
        for t in tasks:
            t.cancel()
