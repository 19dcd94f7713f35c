"""SGLang's non-generative routes: ``/v1/embeddings``, ``/encode``, ``/v1/classify``,
``/classify``, ``/v1/rerank`` and ``/v1/score``, in SGLang's request and response shapes.

Each prompt runs as a prefill through the simulated scheduler (``max_new_tokens`` 0), so it
costs prefill time and uses and fills the radix cache as SGLang's embedding models do. The
numbers are deterministic functions of the token ids (``vectors``). As in SGLang, only an
embedding model (``--is-embedding``) serves embeddings, classification and cross-encoder
rerank; ``/v1/score`` serves both kinds (a generation model scores ``label_token_ids``).
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
import uuid
import zlib
from array import array
from typing import Any

from aiohttp import web

from .engine import Engine
from .items import ApiError, Item, check_client_ids
from .generation import token_logprob
from .http_common import ENGINE, json_object, json_response, native_error, openai_error
from .http_native import apply_faults
from .protocol import SamplingParams
from .runner import Progress, collect
from .vectors import class_logits, cosine, embed, softmax

NOT_EMBEDDING = ("This model does not appear to be an embedding model by default. "
                 "Please add `--is-embedding` when launching the server or try another model.")
LABELS = ("LABEL_0", "LABEL_1")


def _require_embedding(engine: Engine) -> None:
    if not engine.args.is_embedding:
        raise ApiError(400, NOT_EMBEDDING)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def prompts_of(engine: Engine, value: Any, name: str = "Input") -> tuple[list[list[int]], bool]:
    """Text, texts, token ids or lists of them: (token ids per prompt, whether a batch)."""
    if isinstance(value, str):
        if not value.strip():
            raise ApiError(400, f"{name} cannot be empty or whitespace only")
        return [engine.tokenizer.encode(value)], False
    if not isinstance(value, list) or not value:
        raise ApiError(400, f"{name} cannot be empty")
    if all(isinstance(v, str) for v in value):
        for i, v in enumerate(value):
            if not v.strip():
                raise ApiError(400, f"{name} at index {i} cannot be empty or whitespace only")
        return [engine.tokenizer.encode(v) for v in value], True
    if _is_ids(value):
        check_client_ids([value])
        return [list(value)], False
    if all(_is_ids(v) for v in value):
        check_client_ids(value)
        return [list(v) for v in value], True
    raise ApiError(400, f"{name} must be a string, a list of strings, token ids or a list of token id lists")


async def prefill(engine: Engine, prompts: list[list[int]]) -> list[Progress]:
    """Each prompt through the scheduler as a prefill without output."""
    items = [Item(index=i, rid=uuid.uuid4().hex, input_ids=ids, params=SamplingParams(max_new_tokens=0))
             for i, ids in enumerate(prompts)]
    for item in items:
        engine.validate(item)
    await apply_faults(engine)
    return list(await asyncio.gather(*(collect(engine, it) for it in items)))


def _usage(results: list[Progress]) -> dict[str, Any]:
    prompt = sum(p.req.prompt_len for p in results)
    return {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0, "prompt_tokens_details": None,
            "reasoning_tokens": 0, "completion_tokens_details": None}


def _meta(engine: Engine, p: Progress) -> dict[str, Any]:
    return engine.meta_info(p.req, p.item, 0, True)


# --- embeddings -----------------------------------------------------------------------------
def _dimensions(engine: Engine, body: dict[str, Any]) -> int:
    dims = body.get("dimensions")
    if dims is None:
        return engine.args.embedding_dim
    if type(dims) is not int or not 1 <= dims <= engine.args.embedding_dim:
        raise ApiError(400, f"dimensions must be an integer in [1, {engine.args.embedding_dim}], got {dims!r}")
    return dims


def _serialized(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def v1_embeddings(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await json_object(request)
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise ApiError(400, f"encoding_format must be either 'float' or 'base64', got {encoding!r}")
        dims = _dimensions(engine, body)
        prompts, _ = prompts_of(engine, body.get("input"))
        _require_embedding(engine)
        results = await prefill(engine, prompts)
    except ApiError as e:
        return openai_error(e)
    data = [{"embedding": _serialized(embed(p.item.input_ids, engine.args.embedding_dim, dims), encoding),
             "index": i, "object": "embedding"} for i, p in enumerate(results)]
    return json_response({"data": data, "model": engine.model_path, "object": "list", "usage": _usage(results)})


async def _native(request: web.Request, logits: bool) -> web.Response:
    """``/encode`` (the embedding) and ``/classify`` (the class logits): SGLang's EmbeddingReqInput."""
    engine = request.app[ENGINE]
    try:
        body = await json_object(request)
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise ApiError(400, "Either text or input_ids should be provided.")
        prompts, batch = prompts_of(engine, text if text is not None else ids, "text" if text is not None else "input_ids")
        _require_embedding(engine)
        results = await prefill(engine, prompts)
    except ApiError as e:
        return native_error(e)
    dim = engine.args.embedding_dim
    outs = [{"embedding": class_logits(p.item.input_ids, dim) if logits else embed(p.item.input_ids, dim),
             "meta_info": _meta(engine, p)} for p in results]
    return json_response(outs if batch else outs[0])


async def encode(request: web.Request) -> web.Response:
    return await _native(request, logits=False)


async def classify(request: web.Request) -> web.Response:
    return await _native(request, logits=True)


async def v1_classify(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await json_object(request)
        prompts, _ = prompts_of(engine, body.get("input"))
        _require_embedding(engine)
        results = await prefill(engine, prompts)
    except ApiError as e:
        return openai_error(e)
    data = []
    for i, p in enumerate(results):
        probs = softmax(class_logits(p.item.input_ids, engine.args.embedding_dim))
        data.append({"index": i, "label": LABELS[probs.index(max(probs))], "probs": probs, "num_classes": len(probs)})
    return json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                          "model": engine.args.model_name, "data": data, "usage": _usage(results)})


# --- rerank and score -----------------------------------------------------------------------
def _text_of(value: Any) -> str | None:
    """A rerank query or document: a string, or content parts whose text is used."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        return " ".join(p["text"] for p in value if isinstance(p.get("text"), str))
    return None


async def v1_rerank(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await json_object(request)
        query, docs, top_n = _text_of(body.get("query")), body.get("documents"), body.get("top_n")
        if not query or not query.strip():
            raise ApiError(400, "Query cannot be empty or whitespace only")
        if not isinstance(docs, list) or not docs:
            raise ApiError(400, "Documents cannot be empty")
        texts = [_text_of(d) for d in docs]
        if not all(t and t.strip() for t in texts):
            raise ApiError(400, "Each document must be a non-empty string")
        if top_n is not None and (type(top_n) is not int or top_n < 1):
            raise ApiError(400, "Value error, parameter top_n should be larger than 0.")
        _require_embedding(engine)
        q = engine.tokenizer.encode(query)
        results = await prefill(engine, [q + engine.tokenizer.encode(t or "") for t in texts])
    except ApiError as e:
        return openai_error(e)
    dim = engine.args.embedding_dim
    query_vec = embed(q, dim)
    ranked = []
    for i, p in enumerate(results):
        entry: dict[str, Any] = {"score": round(cosine(query_vec, embed(p.item.input_ids[len(q):], dim)), 6),
                                 "index": i, "meta_info": _meta(engine, p)}
        if body.get("return_documents", True) is not False:
            entry["document"] = texts[i]
        ranked.append(entry)
    ranked.sort(key=lambda r: r["score"], reverse=True)
    return json_response(ranked[:top_n] if top_n else ranked)


def _score_inputs(engine: Engine, body: dict[str, Any]) -> tuple[list[list[int]], list[list[int]] | None]:
    """(token ids per query + item pair, label ids per item or None), checked as SGLang checks them."""
    items, labels, query = body.get("items"), body.get("label_token_ids"), body.get("query")
    temperature, soft = body.get("temperature", 1.0), body.get("apply_softmax", False)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 < temperature < math.inf:
        raise ApiError(400, "temperature must be finite and greater than zero")
    if temperature != 1.0 and soft is not True:
        raise ApiError(400, "temperature requires apply_softmax=True")
    if body.get("return_token_logprobs") and engine.args.is_embedding:
        raise ApiError(400, "return_token_logprobs is only supported for CausalLM models")
    generation = not engine.args.is_embedding
    if generation and labels is None:
        raise ApiError(400, "label_token_ids is required for generation (CausalLM) models.")
    if items is None:
        raise ApiError(400, "items must be provided")
    pairs_items, _ = prompts_of(engine, [items] if isinstance(items, str) else items, "items")
    if query is None:
        q: list[int] = []
    elif isinstance(query, str):
        q = engine.tokenizer.encode(query)
    elif _is_ids(query):
        check_client_ids([query])
        q = list(query)
    else:
        raise ApiError(400, "query must be a string or token ids")
    first = body.get("item_first") is True
    pairs = [(ids + q if first else q + ids) for ids in pairs_items]
    if not generation:
        return pairs, None
    if not isinstance(labels, list) or not labels:
        raise ApiError(400, "label_token_ids must be a nonempty list")
    per_item = labels if isinstance(labels[0], list) else [labels] * len(pairs)
    if len(per_item) != len(pairs):
        raise ApiError(400, "label_token_ids must have one list per item")
    for row in per_item:
        if not isinstance(row, list) or not row or any(type(t) is not int or t < 0 for t in row):
            raise ApiError(400, "label_token_ids must contain nonnegative integers")
        if len(set(row)) != len(row):
            raise ApiError(400, "label_token_ids must not contain duplicate tokens")
    return pairs, per_item


async def v1_score(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await json_object(request)
        if body.get("items") == []:
            pairs, labels, results = [], None, []
        else:
            pairs, labels = _score_inputs(engine, body)
            results = await prefill(engine, pairs)
    except ApiError as e:
        return openai_error(e)
    temperature, soft = float(body.get("temperature", 1.0)), body.get("apply_softmax") is True
    scores, token_lps = [], []
    for i, p in enumerate(results):
        ids = p.item.input_ids
        if labels is not None:
            # each label's logprob after this pair: a function of the pair and the label
            lps = [token_logprob(t, zlib.crc32(array("I", [*ids, t]).tobytes()) % 1000) for t in labels[i]]
            token_lps.append(lps)
            scores.append(softmax([lp / temperature for lp in lps]) if soft else [round(math.exp(lp), 6) for lp in lps])
        else:
            logits = class_logits(ids, engine.args.embedding_dim)
            scores.append(softmax([x / temperature for x in logits]) if soft else logits)
    model = body.get("model") if isinstance(body.get("model"), str) else "default"
    return json_response({"scores": scores, "pooled_hidden_states": None,
                          "token_logprobs": token_lps if body.get("return_token_logprobs") else None,
                          "model": model, "usage": _usage(results), "object": "scoring"})


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/embeddings", v1_embeddings)
    r.add_post("/v1/classify", v1_classify)
    r.add_post("/v1/score", v1_score)
    for method in ("POST", "PUT"):
        r.add_route(method, "/v1/rerank", v1_rerank)
        r.add_route(method, "/encode", encode)
        r.add_route(method, "/classify", classify)
