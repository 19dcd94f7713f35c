"""SGLang's ``/v1/tokenize`` and ``/v1/detokenize`` (also without ``/v1``).

A gateway that tokenizes for a precise KV index can ask the engine itself whether their ids
agree: a text ``prompt`` is encoded with ``add_special_tokens`` (default true), and
``messages`` are rendered as for a chat completion (template, ``chat_template_kwargs``,
``tools``), exactly one of the two. The answer is ``{"tokens", "count", "max_model_len"}``,
lists for a list of prompts.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .items import ApiError
from .http_common import ENGINE, json_object, json_response, openai_error
from .http_openai import chat_ids

async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await json_object(request)
        prompt, messages = body.get("prompt"), body.get("messages")
        if (prompt is None) == (messages is None):
            raise ApiError(400, "exactly one of 'prompt' or 'messages' is required")
        if messages is not None:
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "messages must be a non-empty list")
            tokens: Any = chat_ids(engine, body, messages)
            count: Any = len(tokens)
        else:
            specials = body.get("add_special_tokens", True) is not False
            texts = prompt if isinstance(prompt, list) else [prompt]
            if not all(isinstance(t, str) for t in texts):
                raise ApiError(400, "prompt must be a string or a list of strings")
            ids = [engine.tokenizer.encode(t, add_special_tokens=specials) for t in texts]
            tokens = ids if isinstance(prompt, list) else ids[0]
            count = [len(i) for i in ids] if isinstance(prompt, list) else len(ids[0])
    except ApiError as e:
        return openai_error(e)
    return json_response({"tokens": tokens, "count": count, "max_model_len": engine.profile.context_length})


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await json_object(request)
        tokens = body.get("tokens")
        batch = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
        seqs = tokens if batch else [tokens]
        if not all(isinstance(s, list) and all(isinstance(t, int) for t in s) for s in seqs):
            raise ApiError(400, "tokens must be a list of ints or a list of such lists")
    except ApiError as e:
        return openai_error(e)
    texts = [engine.tokenizer.decode(s) for s in seqs]
    return json_response({"text": texts if batch else texts[0]})


def add_routes(app: web.Application) -> None:
    for prefix in ("/v1", ""):
        app.router.add_post(prefix + "/tokenize", tokenize)
        app.router.add_post(prefix + "/detokenize", detokenize)
