"""Does the gateway tokenize as each worker does? Asked of the engine itself, once per worker.

A precise KV index is useless, silently, when the gateway's ids differ from the engine's
(another tokenizer, another chat template, a missing BOS): predictions then never match
what the engines cache, and only a statistic shows it, after traffic. SGLang answers
``/v1/tokenize`` for a text ``prompt`` and, in newer versions, for chat ``messages`` rendered
as for a chat completion; so when a worker joins, the gateway sends it probes of each (a
third carries a tool definition) and compares the ids with its own. A mismatch is logged
with the first differing position and exported (``kvgate_worker_tokenizer_match{worker,kind}``:
1 same, 0 different); a worker that cannot answer (no such endpoint, no chat form) is not
judged.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import msgspec

from wire.chat_template import sglang_tools
from wire.tokenizer import Tokenizer

log = logging.getLogger("kvgate.tokenizer_check")

PROBE_TEXT = "kvgate tokenizer check: Hello, world! 1234 naïve café\n\tthe end."
PROBE_CHAT = [{"role": "system", "content": "You answer briefly."},
              {"role": "user", "content": "Hello, world! 1234 naïve café"}]
PROBE_TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                                 "parameters": {"type": "object",
                                                                "properties": {"zone": {"type": "string"}}}}}]
_decode = msgspec.json.decode


async def check(session: aiohttp.ClientSession, url: str, headers: dict[str, str], tokenizer: Tokenizer,
                timeout: aiohttp.ClientTimeout) -> dict[str, bool]:
    """``{"text": same?, "chat": same?, "tools": same?}`` for the forms the worker could answer."""
    ours = {"text": tokenizer.encode(PROBE_TEXT),
            "chat": tokenizer.encode_chat(tokenizer.render_chat(PROBE_CHAT)),
            "tools": tokenizer.encode_chat(tokenizer.render_chat(PROBE_CHAT, sglang_tools(PROBE_TOOLS)))}
    asks = {"text": {"prompt": PROBE_TEXT}, "chat": {"messages": PROBE_CHAT},
            "tools": {"messages": PROBE_CHAT, "tools": PROBE_TOOLS}}
    found: dict[str, bool] = {}
    for kind, body in asks.items():
        theirs = await _tokenize(session, url, headers, body, timeout)
        if theirs is None:
            continue
        found[kind] = theirs == ours[kind]
        if not found[kind]:
            at = next((i for i, (a, b) in enumerate(zip(ours[kind], theirs)) if a != b),
                      min(len(ours[kind]), len(theirs)))
            log.warning("worker %s tokenizes a %s prompt differently from this gateway (%d vs %d ids, first "
                        "difference at id %d: %s vs %s): the precise index will not match its cache; give the "
                        "gateway the engine's model directory (--tokenizer) and chat template (--chat-template)",
                        url, kind, len(theirs), len(ours[kind]), at, theirs[at:at + 4], ours[kind][at:at + 4])
    if found and all(found.values()):
        log.info("worker %s tokenizes as this gateway does (%s)", url, ", ".join(sorted(found)))
    return found


async def _tokenize(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any],
                    timeout: aiohttp.ClientTimeout) -> list[int] | None:
    try:
        async with session.post(url + "/v1/tokenize", json=body, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:  # no such endpoint, or no chat form in this SGLang
                await resp.read()
                return None
            tokens = _decode(await resp.read()).get("tokens")
    except Exception as exc:
        log.debug("tokenizer check of %s: %r", url, exc)
        return None
    return tokens if isinstance(tokens, list) and all(type(t) is int for t in tokens) else None
