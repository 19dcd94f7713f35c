"""Run one ``Item`` through the engine, including the PD hand-off, as an async stream of
progress snapshots that both the native and the OpenAI routes turn into responses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .engine import Engine
from .items import Item
from .scheduler import FINISHED, Req


@dataclass(slots=True)
class Progress:
    item: Item
    req: Req
    n: int  # tokens generated so far
    finished: bool
    pd_meta: dict | None = None


async def run_item(engine: Engine, item: Item, stream: bool) -> AsyncIterator[Progress]:
    """Yields progress (only the final one when not streaming). Raises ApiError."""
    if engine.mode == "decode":
        req = await engine.pd.receive(item, engine.make_req(item, prefilled=True))
        pd_meta = None
    else:
        req = engine.submit(engine.make_req(item), item.dp_rank)
        pd_meta = None
    try:
        if stream and engine.mode != "prefill":
            async for n in engine.stream_progress(req):
                yield Progress(item, req, n, req.state == FINISHED)
            return
        await asyncio.shield(req.done)
        if engine.mode == "prefill" and req.abort_message is None:
            pd_meta = await engine.pd.send(item, req)
        yield Progress(item, req, engine.sched_of(req).generated(req), True, pd_meta)
    finally:
        if req.state != FINISHED:  # client went away or the task was cancelled
            engine.sched_of(req).abort(req.rid, "The client disconnected.")


async def collect(engine: Engine, item: Item) -> Progress:
    last = None
    async for p in run_item(engine, item, stream=False):
        last = p
    assert last is not None
    return last
