"""OpenAI-compatible routes (/v1/chat/completions, /v1/completions) in SGLang's shapes.

Both accept SGLang's extras (top_k, min_p, regex, rid, cache_salt, priority, the PD
``bootstrap_*`` fields, ...) and report ``usage.prompt_tokens_details.cached_tokens``
when cache reporting is on (SGLang's ``--enable-cache-report``). A completion asked with
``return_token_ids`` carries its choices' ``token_ids`` (a stream's: each chunk's new ones)
and ``prompt_token_ids`` (a stream's: on its first chunk), as SGLang's do.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web


from wire.chat_template import sglang_tools, template_kwargs

from . import logprobs
from .engine import Engine
from .items import ApiError, Item, check_client_ids
from .http_common import DONE, ENGINE, json_object, json_response, open_sse, openai_error, sse
from .http_native import apply_faults, mid_stream_fault
from .item_stream import merged
from .protocol import SamplingParams
from .runner import Progress, collect


_SAMPLING_FROM_OPENAI = {  # OpenAI/SGLang request field -> SGLang sampling param
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "regex": "regex", "ebnf": "ebnf",
    "json_schema": "json_schema", "no_stop_trim": "no_stop_trim", "skip_special_tokens": "skip_special_tokens",
    "seed": "sampling_seed", "logit_bias": "logit_bias", "n": "n",
}


def _params(body: dict[str, Any]) -> SamplingParams:
    raw: dict[str, Any] = {}
    for k, v in _SAMPLING_FROM_OPENAI.items():
        if body.get(k) is not None:
            raw[v] = body[k]
    mx = body.get("max_completion_tokens", body.get("max_tokens"))
    if mx is not None:
        raw["max_new_tokens"] = mx
    if isinstance(raw.get("logit_bias"), dict):
        raw["logit_bias"] = {str(k): float(v) for k, v in raw["logit_bias"].items()}
    try:
        return msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as e:
        raise ApiError(400, str(e)) from None


def _logprob_request(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """(return logprobs, top candidates per token), as SGLang reads them: chat's ``logprobs``
    (bool) and ``top_logprobs``; a completion's ``logprobs`` (its top count; 0 is tokens only)."""
    value, top = body.get("logprobs"), body.get("top_logprobs") if chat else body.get("logprobs")
    if value is not None and (type(value) is not bool if chat else type(value) is not int or value < 0):
        raise ApiError(400, "logprobs must be a boolean" if chat else "logprobs must be a non-negative integer")
    if top is not None and (type(top) is not int or top < 0):
        raise ApiError(400, "top_logprobs must be a non-negative integer")
    return (bool(value) if chat else value is not None), top or 0


def refuse_if_embedding(engine: Engine) -> None:
    """An embedding model serves no generation (SGLang's model has no LM head to sample from)."""
    if engine.args.is_embedding:
        raise ApiError(400, "This model is an embedding model (--is-embedding); it serves /v1/embeddings, /encode, "
                            "/v1/classify, /classify, /v1/rerank and /v1/score, not generation.")


def _items(engine: Engine, body: dict[str, Any], prompts: list[list[int]], stream: bool,
           chat: bool = True) -> list[Item]:
    params = _params(body)
    return_logprob, top = _logprob_request(body, chat)
    rid = body.get("rid")
    items = []
    idx = 0
    n = max(params.n, 1)
    for i, ids in enumerate(prompts):
        for j in range(n):
            r = rid if isinstance(rid, str) and len(prompts) * n == 1 else (
                f"{rid}_{idx}" if isinstance(rid, str) else uuid.uuid4().hex)
            items.append(Item(
                index=idx, rid=r, input_ids=ids, params=params, stream=stream,
                bootstrap_host=_pick(body.get("bootstrap_host"), idx), bootstrap_port=_pick(body.get("bootstrap_port"), idx),
                bootstrap_room=_pick(body.get("bootstrap_room"), idx), cache_salt=body.get("cache_salt"),
                priority=body.get("priority"), seed_offset=j,
                dp_rank=body.get("routed_dp_rank", body.get("data_parallel_rank")),
                return_logprob=return_logprob, top_logprobs_num=top,
            ))
            idx += 1
    for it in items:
        engine.validate(it)
    return items


def _pick(v: Any, i: int) -> Any:
    return (v[i] if i < len(v) else None) if isinstance(v, list) else v


def _finish(engine: Engine, p: Progress) -> tuple[str | None, Any]:
    fr = engine.finish_reason(p.req, p.n) if p.finished else None
    if fr is None:
        return None, None
    if fr["type"] == "stop":
        return "stop", fr.get("matched")
    if fr["type"] == "abort":
        return "abort", None
    return "length", None


def _usage(engine: Engine, ps: list[Progress]) -> dict[str, Any]:
    prompt = sum(p.req.prompt_len for p in ps if p.item.seed_offset == 0)
    completion = sum(p.n for p in ps)
    u: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                         "prompt_tokens_details": None, "reasoning_tokens": 0}
    if engine.args.enable_cache_report:
        u["prompt_tokens_details"] = {"cached_tokens": sum(p.req.cached_tokens for p in ps if p.item.seed_offset == 0)}
    return u


async def _common(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await json_object(request)
    except ApiError as e:
        return openai_error(e)
    try:
        refuse_if_embedding(engine)
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "messages must be a non-empty list")
            prompts = [chat_ids(engine, body, msgs)]
        else:
            prompts = _prompts(engine, body.get("prompt"))
        stream = bool(body.get("stream"))
        items = _items(engine, body, prompts, stream, chat)
        await apply_faults(engine)
        if stream:
            return await _stream(request, engine, body, items, chat)
        results = await asyncio.gather(*(collect(engine, it) for it in items))
    except ApiError as e:
        return openai_error(e)
    for p in results:
        if p.req.abort_message and p.req.abort_message.startswith("Decode transfer"):
            return openai_error(ApiError(500, p.req.abort_message, "InternalServerError"))
    choices = []
    for p in results:
        reason, matched = _finish(engine, p)
        text = engine.text_of(p.req, p.n)
        lps = _choice_logprobs(p, 0, chat)
        if chat:
            choices.append({"index": p.item.index, "message": {"role": "assistant", "content": text,
                            "reasoning_content": None, "tool_calls": None}, "logprobs": lps,
                            "finish_reason": reason, "matched_stop": matched})
        else:
            choices.append({"index": p.item.index, "text": text, "logprobs": lps, "finish_reason": reason,
                            "matched_stop": matched, **_token_ids(body, p, 0, True)})
    return json_response({
        "id": results[0].req.rid, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": body.get("model") or engine.args.model_name, "choices": choices,
        "usage": _usage(engine, results), "metadata": {"weight_version": "default"},
    })


def _token_ids(body: dict[str, Any], p: Progress, first: int, with_prompt: bool) -> dict[str, Any]:
    """A completion choice's ``token_ids`` from output token ``first`` on (and the prompt's),
    where the request asked ``return_token_ids``."""
    if not body.get("return_token_ids"):
        return {}
    return {"token_ids": list(p.req.planned.out[first:p.n]),
            "prompt_token_ids": list(p.item.input_ids) if with_prompt else None}


def _choice_logprobs(p: Progress, first: int, chat: bool) -> dict[str, Any] | None:
    """A choice's logprobs for its output tokens ``first`` .. ``p.n`` (None: not asked for)."""
    if not p.item.return_logprob:
        return None
    out = p.req.planned.out[:p.n]
    k = p.item.top_logprobs_num
    return logprobs.chat(out, first, k) if chat else logprobs.completion(out, first, k)


def chat_ids(engine: Engine, body: dict[str, Any], messages: list[Any]) -> list[int]:
    """As SGLang: the model's chat template, ``reasoning_effort`` and ``chat_template_kwargs``
    as its variables, the text encoded without adding special tokens (``wire.tokenizer``);
    a template that fails is the client's error."""
    if not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "each message must be an object")
    kwargs = template_kwargs(body.get("reasoning_effort"), body.get("chat_template_kwargs"))
    try:
        tools = sglang_tools(body.get("tools"), body.get("tool_choice"))
        chat = engine.tokenizer.render_chat(messages, tools, kwargs, bool(body.get("continue_final_message")))
    except Exception as exc:
        raise ApiError(400, f"chat template failed: {exc}") from None
    return engine.tokenizer.encode_chat(chat)


def _prompts(engine: Engine, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [engine.tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, str) for x in prompt):
            return [engine.tokenizer.encode(x) for x in prompt]
        if all(isinstance(x, int) for x in prompt):
            check_client_ids([prompt])
            return [list(prompt)]
        if all(isinstance(x, list) for x in prompt):
            check_client_ids(prompt)
            return [list(x) for x in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings or token ids")


async def _stream(request: web.Request, engine: Engine, body: dict[str, Any], items: list[Item],
                  chat: bool) -> web.StreamResponse:
    resp = await open_sse(request)
    obj = "chat.completion.chunk" if chat else "text_completion"
    model = body.get("model") or engine.args.model_name
    created = int(time.time())
    cid = items[0].rid
    opts = body.get("stream_options") or {}
    include_usage = bool(opts.get("include_usage"))
    continuous_usage = bool(opts.get("continuous_usage_stats"))
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    last: dict[int, Progress] = {}

    def chunk(choice: dict[str, Any], usage: Any = None) -> bytes:
        return sse({"id": cid, "object": obj, "created": created, "model": model, "choices": [choice],
                    "usage": usage})

    if chat:
        for it in items:
            await resp.write(chunk({"index": it.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None, "matched_stop": None}))
    async for p in merged(engine, items):
        if isinstance(p, ApiError):
            await resp.write(sse({"error": {"message": p.message, "type": p.err_type, "code": p.status}}))
            break
        last[p.item.index] = p
        text = engine.text_of(p.req, p.n)
        prev = sent_chars.get(p.item.index, 0)
        delta = text[prev:]
        sent_chars[p.item.index] = len(text)
        reason, matched = _finish(engine, p)
        if not delta and reason is None:
            continue
        usage = _usage(engine, [p]) if continuous_usage else None
        sent_tokens_before = sent_tokens.get(p.item.index, 0)
        lps = _choice_logprobs(p, sent_tokens_before, chat)
        sent_tokens[p.item.index] = p.n
        if chat:
            await resp.write(chunk({"index": p.item.index, "delta": {"content": delta} if delta else {},
                                    "logprobs": lps, "finish_reason": reason, "matched_stop": matched}, usage))
        else:
            ids = _token_ids(body, p, sent_tokens_before, sent_tokens_before == 0)
            await resp.write(chunk({"index": p.item.index, "text": delta, "logprobs": lps,
                                    "finish_reason": reason, "matched_stop": matched, **ids}, usage))
        if await mid_stream_fault(engine, resp, p):
            return resp
    if include_usage and last:
        await resp.write(sse({"id": cid, "object": obj, "created": created, "model": model, "choices": [],
                              "usage": _usage(engine, list(last.values()))}))
    await resp.write(DONE)
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _common(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _common(request, chat=False)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
