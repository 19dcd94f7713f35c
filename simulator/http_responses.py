"""SGLang's Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``, and OpenAI's ``GET /v1/responses/{id}/input_items`` and
``DELETE /v1/responses/{id}``, which SGLang 0.5.23 does not serve.

As in SGLang (non-harmony models, no tools): the conversation is ``instructions`` as a
system message, then the stored conversation of ``previous_response_id``, then ``input``,
rendered with the chat template; the answer is one assistant message. A stream is SGLang's
typed events (``event: <type>`` and ``data: {...}`` lines, ``sequence_number`` counting,
no ``[DONE]``). Storage needs ``--enable-response-store`` (SGLang's rule), and
``background`` requests run detached until done or cancelled. Errors use the nested
``{"error": {...}}`` shape SGLang gives this API.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from .engine import Engine
from .items import ApiError, Item
from .http_common import ENGINE, json_object, json_response, open_sse
from .http_native import apply_faults
from .http_openai import chat_ids, refuse_if_embedding
from .protocol import SamplingParams
from .response_store import (ResponseStore, Stored, chat_messages, input_items, output_message, output_text,
                             response_object, status_of, usage)
from .runner import Progress, collect, run_item

STORE: web.AppKey[ResponseStore] = web.AppKey("responses", ResponseStore)
_enc = msgspec.json.Encoder()


class ResponsesRequest(msgspec.Struct):
    """The fields this simulator acts on, typed as SGLang types them; others are accepted."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    background: bool | None = False
    stream: bool | None = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    request_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _error(message: str, status: int = 400, param: str | None = None) -> web.Response:
    return json_response({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                    "code": status}}, status)


def _disabled(param: str) -> web.Response:
    return _error("Response store is disabled. Stateful Responses require --enable-response-store on a standalone "
                  "server; response storage is unavailable in PD mode.", param=param)


def _lookup(request: web.Request) -> tuple[str, Stored | None, web.Response | None]:
    """The path's response id and its stored response, or the error SGLang answers."""
    rid = request.match_info["response_id"]
    if not request.app[ENGINE].args.enable_response_store:
        return rid, None, _disabled("response_id")
    if not rid.startswith("resp_"):
        return rid, None, _error(f"Invalid 'response_id': '{rid}'. Expected an ID that begins with 'resp'.",
                                 param="response_id")
    stored = request.app[STORE].get(rid)
    if stored is None:
        return rid, None, _error(f"Response with id '{rid}' not found.", 404, "response_id")
    return rid, stored, None


def _sampling(req: ResponsesRequest) -> SamplingParams:
    raw = {k: v for k, v in (("max_new_tokens", req.max_output_tokens), ("temperature", req.temperature),
                             ("top_p", req.top_p), ("top_k", req.top_k), ("min_p", req.min_p), ("stop", req.stop))
           if v is not None}
    try:
        return msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as e:
        raise ApiError(400, str(e)) from None


def _final(engine: Engine, p: Progress, rid: str, body: dict[str, Any], model: str, created: int,
           item_id: str | None = None) -> dict[str, Any]:
    finish = engine.finish_reason(p.req, p.n)
    status = status_of(finish)
    text = engine.text_of(p.req, p.n)
    error = {"code": "server_error", "message": finish.get("message") or "Generation aborted"} \
        if status == "failed" and finish else None
    cached = p.req.cached_tokens if engine.args.enable_cache_report else 0
    return response_object(rid, body, model, status, [output_message(text, item_id=item_id)] if text else [],
                           usage(p.req.prompt_len, p.n, cached), created, error)


def _save(store: ResponseStore, rid: str, response: dict[str, Any], history: list[dict[str, Any]],
          inputs: list[dict[str, Any]]) -> None:
    """Keep a finished response and its conversation, unless it was cancelled meanwhile."""
    stored = store.get(rid)
    if stored is not None and stored.response.get("status") == "cancelled":
        return
    store.put(rid, Stored(response, history + response["output"], inputs))


async def create(request: web.Request) -> web.StreamResponse:
    engine, store = request.app[ENGINE], request.app[STORE]
    try:
        body = await json_object(request)
        req = msgspec.convert(body, ResponsesRequest)
    except (ApiError, msgspec.ValidationError) as e:
        return _error(e.message if isinstance(e, ApiError) else str(e))
    keep = engine.args.enable_response_store
    if not keep and (req.previous_response_id is not None or req.background):
        return _disabled("previous_response_id" if req.previous_response_id is not None else "background")
    if req.background and not req.store:
        return _error("background=true requires store=true.", param="store")
    if req.model is not None and req.model != engine.args.model_name:
        return _error(f"The model '{req.model}' does not exist", 404, "model")
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        if not req.previous_response_id.startswith("resp_"):
            return _error(f"Invalid 'response_id': '{req.previous_response_id}'. Expected an ID that begins with "
                          "'resp'.", param="response_id")
        prev = store.get(req.previous_response_id)
        if prev is None:
            return _error(f"Response with id '{req.previous_response_id}' not found.", 404, "response_id")
        history = list(prev.history)
    rid = req.request_id or f"resp_{uuid.uuid4().hex}"
    inputs = input_items(req.input)
    history += inputs
    model = req.model or engine.args.model_name
    try:
        refuse_if_embedding(engine)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + \
            chat_messages(history)
        ids = chat_ids(engine, {"chat_template_kwargs": req.chat_template_kwargs}, messages)
        item = Item(index=0, rid=rid, input_ids=ids, params=_sampling(req), stream=bool(req.stream))
        engine.validate(item)
        await apply_faults(engine)
    except ApiError as e:
        return _error(e.message, e.status)
    persist = keep and req.store is not False
    if req.stream:
        return await _stream(request, engine, item, body, model, history if persist else None, inputs)
    if req.background:
        queued = response_object(rid, body, model, "queued", [], None)
        stored = Stored(queued, history, inputs)
        store.put(rid, stored)
        stored.task = asyncio.get_running_loop().create_task(_background(engine, store, item, body, model, stored))
        return json_response(queued)
    try:
        p = await collect(engine, item)
    except ApiError as e:
        return _error(e.message, e.status)
    response = _final(engine, p, rid, body, model, int(time.time()))
    if persist:
        _save(store, rid, response, history, inputs)
    return json_response(response)


async def _background(engine: Engine, store: ResponseStore, item: Item, body: dict[str, Any], model: str,
                      stored: Stored) -> None:
    stored.response["status"] = "in_progress"
    created = stored.response["created_at"]
    try:
        p = await collect(engine, item)
    except ApiError as e:
        response = response_object(item.rid, body, model, "failed", [], None, created,
                                   {"code": "server_error", "message": e.message})
    else:
        response = _final(engine, p, item.rid, body, model, created)
    if stored.response["status"] != "cancelled":
        stored.response = response
        stored.history = stored.history + response["output"]
    stored.task = None


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _enc.encode({"type": kind, **fields, "sequence_number": seq}) \
        + b"\n\n"


async def _stream(request: web.Request, engine: Engine, item: Item, body: dict[str, Any], model: str,
                  history: list[dict[str, Any]] | None, inputs: list[dict[str, Any]]) -> web.StreamResponse:
    """SGLang's event sequence for a plain-text answer; ``history`` None: not stored."""
    resp = await open_sse(request)
    created, rid, msg_id = int(time.time()), item.rid, f"msg_{uuid.uuid4().hex}"
    seq = 0

    async def send(kind: str, **fields: Any) -> None:
        nonlocal seq
        await resp.write(_event(kind, seq, **fields))
        seq += 1

    initial = response_object(rid, body, model, "in_progress", [], None, created)
    await send("response.created", response=initial)
    await send("response.in_progress", response=initial)
    sent, last = "", None
    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    try:
        async for p in run_item(engine, item, stream=True):
            last = p
            text = engine.text_of(p.req, p.n)
            if len(text) <= len(sent):
                continue
            if not sent:
                await send("response.output_item.added", output_index=0,
                           item=output_message("", "in_progress", msg_id))
                await send("response.content_part.added", **where, part=output_text(""))
            await send("response.output_text.delta", **where, delta=text[len(sent):], logprobs=[])
            sent = text
    except ApiError as e:
        failed = response_object(rid, body, model, "failed", [], None, created,
                                 {"code": "server_error", "message": e.message})
        await send("response.failed", response=failed)
        return resp
    if sent:
        await send("response.output_text.done", **where, text=sent, logprobs=[])
        await send("response.content_part.done", **where, part=output_text(sent))
        await send("response.output_item.done", output_index=0, item=output_message(sent, item_id=msg_id))
    assert last is not None
    final = _final(engine, last, rid, body, model, created, msg_id)
    if history is not None:
        _save(request.app[STORE], rid, final, history, inputs)
    await send(f"response.{final['status']}", response=final)
    return resp


async def retrieve(request: web.Request) -> web.Response:
    _, stored, error = _lookup(request)
    return error or json_response(stored.response)  # type: ignore[union-attr]


async def cancel(request: web.Request) -> web.Response:
    rid, stored, error = _lookup(request)
    if error is not None or stored is None:
        return error  # type: ignore[return-value]
    if stored.response["status"] in ("queued", "in_progress"):
        stored.response["status"] = "cancelled"
        request.app[ENGINE].abort(rid, "Abort request")
        task, stored.task = stored.task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return json_response(stored.response)


async def list_input_items(request: web.Request) -> web.Response:
    """OpenAI's cursor page of this response's input items (``order`` desc by default)."""
    _, stored, error = _lookup(request)
    if error is not None or stored is None:
        return error  # type: ignore[return-value]
    q = request.query
    order, after = q.get("order", "desc"), q.get("after")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if order not in ("asc", "desc") or not 1 <= limit <= 100:
        return _error("order must be 'asc' or 'desc' and limit an integer in [1, 100]", param="order")
    items = stored.inputs if order == "asc" else stored.inputs[::-1]
    if after is not None:
        ids = [i.get("id") for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


async def delete(request: web.Request) -> web.Response:
    rid, stored, error = _lookup(request)
    if error is not None or stored is None:
        return error  # type: ignore[return-value]
    if stored.task is not None:
        stored.task.cancel()
    request.app[STORE].pop(rid)
    return json_response({"id": rid, "object": "response", "deleted": True})


def add_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore(app[ENGINE].args.response_store_size)
    r = app.router
    r.add_post("/v1/responses", create)
    r.add_get("/v1/responses/{response_id}", retrieve)
    r.add_delete("/v1/responses/{response_id}", delete)
    r.add_post("/v1/responses/{response_id}/cancel", cancel)
    r.add_get("/v1/responses/{response_id}/input_items", list_input_items)
