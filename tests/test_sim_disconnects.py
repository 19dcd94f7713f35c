"""Clients that hang up mid-stream must not break the streams of everyone else.

Regression: every stream awaited one shared scheduler future; a disconnecting client's
cancelled wait cancelled that future, and every later stream was cut after one chunk.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tests.sim_support import sim_worker


async def _streams(url: str, n: int, hang_up_after: int | None) -> list[bytes]:
    """``n`` concurrent streams; every other one hangs up after ``hang_up_after`` events.

    Hang-ups and whole streams run at the same time: a cancelled shared wait only hurts
    the streams in flight beside it, so two phases one after the other would miss it."""
    async def one(session: aiohttp.ClientSession, i: int) -> bytes | None:
        body = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 40, "stream": True}
        hang_up = hang_up_after is not None and i % 2 == 0
        data = b""
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            async for chunk in resp.content.iter_any():
                data += chunk
                if hang_up and data.count(b"\n\n") >= hang_up_after:
                    return None
        return data

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return await asyncio.gather(*(one(session, i) for i in range(n)))


def test_streams_complete_after_other_clients_hang_up():
    with sim_worker("--time-scale", "20", "--model-name", "m") as (url, _):
        for _ in range(2):
            bodies = [b for b in asyncio.run(_streams(url, 20, hang_up_after=2)) if b is not None]
            assert len(bodies) == 10
            assert all(b.endswith(b"data: [DONE]\n\n") for b in bodies), [b[-80:] for b in bodies]
        bodies = asyncio.run(_streams(url, 20, hang_up_after=None))
        assert all(b.endswith(b"data: [DONE]\n\n") for b in bodies)
