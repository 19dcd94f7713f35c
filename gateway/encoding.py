"""Tokenizing prompts for precise routing without stalling the event loop.

A Hugging Face tokenizer encodes ~0.1-0.3 us per character: a 100k-token prompt holds the
thread for tens of milliseconds, and on the event loop that is tens of milliseconds in
which no other request is proxied and no stream moves. ``encode_batch`` releases the GIL
(``wire.tokenizer``), so prompts longer than ``inline_chars`` are encoded on a small thread
pool while the loop goes on; shorter ones are cheaper to encode in place than the ~0.1 ms
a thread hop costs. The simulator's byte tokenizer is only a ``list(bytes)``: always inline.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from wire.tokenizer import ByteTokenizer, ChatPrompt, Encoded, Tokenizer


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, inline_chars: int = 2048, threads: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.inline_chars = inline_chars if not isinstance(tokenizer, ByteTokenizer) else 1 << 62
        self.threads = threads or min(4, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self.offloaded = 0  # prompts encoded on the pool (stat)

    async def text(self, text: str) -> Encoded:
        """Ids of a text prompt, special tokens added as the engine adds them (and packed, where
        the tokenizer had them so)."""
        return await self._run(self.tokenizer.encode_packed, text, len(text))

    async def chat(self, prompt: ChatPrompt) -> Encoded:
        """Ids of a rendered chat (its template wrote the special tokens), and packed likewise."""
        return await self._run(self.tokenizer.encode_chat_packed, prompt, len(prompt.text))

    async def _run(self, fn: Callable, arg: object, size: int) -> Encoded:
        if size <= self.inline_chars:
            return fn(arg)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvgate-tokenize")
        self.offloaded += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, arg)

    def stats(self) -> dict[str, float]:
        reuse = getattr(self.tokenizer, "reuse", None)
        return {"prompts_off_loop_total": float(self.offloaded), **(reuse.stats() if reuse is not None else {})}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
