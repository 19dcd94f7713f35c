"""Mid-stream migration: a stream whose worker fails after the first byte is finished by
another worker, and the client sees one answer (docs/migration.md).

A stream breaks when its upstream connection resets or ends before ``[DONE]``, when the
engine sends an error event, when no byte comes within the request timeout, or when its
worker is found unhealthy (its open streams are closed then). The answer so far
(``gateway.stream_record``) becomes a continuation request: the prompt's ids plus the
output ids so far (``/generate``, completions), or the chat with the text so far as a final
assistant message to continue (``continue_final_message``), asking only for the tokens
left. It is chosen through the policy like any request (so a cache-aware one finds the
prefix), and its events are rewritten into the client's stream: the first answer's id and
``created``, text and ids that carry on, usage that counts the whole answer. At most
``limit`` continuations per request; then the stream ends with one error event and ``[DONE]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from gateway.attempts import Broken, Failure, Tried
from gateway.errors import sse_error_frame
from gateway.metrics import GatewayMetrics
from gateway.request import Body, parse_body, splice_fields
from gateway.stream_record import CHAT, COMPLETIONS, GENERATE, Record, Transcript, error_at, json_events, \
    null_ids, split_events
from index.views import RequestView
from policies.base import NoWorkerAvailable

if TYPE_CHECKING:
    from gateway.attempts import Attempts

log = logging.getLogger("kvgate.migration")
_enc = msgspec.json.encode
_DONE = b"data: [DONE]\n\n"
ROUTES = (CHAT, COMPLETIONS, GENERATE)
COMPLETION_DEFAULT_MAX = 16  # OpenAI's and SGLang's max_tokens for a completion that names none
GENERATE_DEFAULT_MAX = 128  # SGLang's max_new_tokens


def single(body: Body) -> bool:
    """One prompt, one choice: what a continuation can carry on."""
    sp = body.sampling_params
    if isinstance(sp, list) or (sp is not None and (sp.n or 1) > 1) or (body.n or 1) > 1:
        return False
    for value in (body.text, body.input_ids, body.prompt):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return False
    return not isinstance(body.rid, list)


class Resume:
    """A continuation's events, rewritten into the client's stream (the sink of its relay)."""

    __slots__ = ("response", "t", "prior", "strip_ids", "buf", "done", "first", "watch")

    def __init__(self, response: web.StreamResponse, t: Transcript, strip_ids: bool,
                 watch: Callable[[str, Any], Callable[[], None]]) -> None:
        self.watch = watch
        self.response = response
        self.t = t  # the answer so far, kept up to date for a later continuation
        self.prior = t.copy()  # the answer before this continuation
        self.strip_ids = strip_ids
        self.buf = b""
        self.done = False
        self.first = True

    resumable = True

    def transcript(self) -> Transcript:
        return self.t

    def take(self, chunk: bytes) -> tuple[bytes, bool]:
        events, self.buf = split_events(self.buf, chunk)
        if not events:
            return b"", False
        err = error_at(events)
        if err >= 0:
            events = events[:err]
        out = []
        for ev in json_events(events):
            ev = self.rewrite(ev)
            if ev is not None:
                self.t.apply(ev)
                data = _enc(ev)
                out.append(b"data: " + (null_ids(data) if self.strip_ids else data) + b"\n\n")
        if err < 0 and events.rstrip().endswith(b"data: [DONE]"):
            self.done = True
            out.append(_DONE)
        return b"".join(out), err >= 0

    def rewrite(self, ev: dict[str, Any]) -> dict[str, Any] | None:
        """The event as the one answer's (None: an event the client has had already)."""
        p = self.prior
        if self.t.route == GENERATE:
            meta = ev.get("meta_info") or {}
            ids = ev.get("output_ids") or []
            n = meta.get("completion_tokens")
            if n is not None and len(ids) == n:  # cumulative (SGLang >= 0.5.6), else each event's own
                ev["output_ids"] = p.ids + list(ids)
            ev["text"] = p.text + (ev.get("text") or "")
            meta["id"] = p.id if p.id is not None else meta.get("id")
            if n is not None:
                meta["completion_tokens"] = n + p.tokens
            if p.prompt_tokens is not None:
                meta["prompt_tokens"], meta["cached_tokens"] = p.prompt_tokens, p.cached_tokens
            reason = meta.get("finish_reason")
            if isinstance(reason, dict) and reason.get("type") == "length" and "length" in reason:
                reason["length"] += p.tokens
            for key, before in p.logprobs.items():
                if meta.get(key) is not None:
                    meta[key] = before + meta[key]
            return ev
        if p.id is not None:
            ev["id"] = p.id
        if p.created is not None:
            ev["created"] = p.created
        choices = ev.get("choices") or []
        for choice in choices:
            if "prompt_token_ids" in choice:  # the first event had them
                choice["prompt_token_ids"] = None
            delta = choice.get("delta")
            if isinstance(delta, dict) and delta.pop("role", None) is not None and self.first:
                self.first = False
                if not delta.get("content") and choice.get("finish_reason") is None:
                    choice["delta"] = {}
                    if ev.get("usage") is None:
                        return None
        usage = ev.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            prompt = p.prompt_tokens if p.prompt_tokens is not None else (usage.get("prompt_tokens") or 0) - p.tokens
            usage["prompt_tokens"] = prompt
            usage["completion_tokens"] += p.tokens
            usage["total_tokens"] = prompt + usage["completion_tokens"]
        return ev


async def engine_count(session: aiohttp.ClientSession, workers: list[Any], model: str | None, text: str) -> int | None:
    """How many tokens ``text`` is to the engine (SGLang's ``/v1/tokenize``, no special
    tokens: as ``continue_final_message`` appends it), asked of up to two workers."""
    for worker in workers[:2]:
        try:
            async with session.post(worker.url + "/v1/tokenize", headers=worker.auth_headers(),
                                    json={"model": model, "prompt": text, "add_special_tokens": False},
                                    timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    count = (await resp.json()).get("count")
                    if isinstance(count, int):
                        return count
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("token count from %s failed: %r", worker.url, exc)
    return None


def _shorten(params: dict, max_key: str, min_key: str, default: int, used: int) -> bool:
    """Ask ``params`` for what is left of its output budget after ``used`` tokens; False when
    nothing is left."""
    left = (params.get(max_key) or default) - used
    if left <= 0:
        return False
    params[max_key] = left
    if params.get(min_key):
        params[min_key] = max(0, params[min_key] - used)
    return True


def continuation(view: RequestView, raw: bytes, t: Transcript, k: int, encode: Callable[[str], list[int]] | None
                 ) -> tuple[bytes, RequestView] | None:
    """The request that asks for the rest of the answer (``k``: the continuation's number),
    and the view its choice is made on; None when no token is left to ask for. A chat's
    ``t.tokens`` must count its text as the engine does (``Migration.count``)."""
    d = msgspec.json.decode(raw)
    token_ids: list[int] | None = None
    text: str | None = None
    if t.route == GENERATE:
        sp = d.get("sampling_params") if isinstance(d.get("sampling_params"), dict) else {}
        if not _shorten(sp, "max_new_tokens", "min_new_tokens", GENERATE_DEFAULT_MAX, t.tokens):
            return None
        d["sampling_params"] = sp
        prompt = d.get("input_ids") if isinstance(d.get("input_ids"), list) else view.token_ids
        if prompt is not None:
            token_ids = list(prompt) + t.ids
            d.pop("text", None)
            d["input_ids"] = token_ids
        else:
            text = d["text"] = (d.get("text") or "") + t.text
        if d.get("return_logprob"):
            d["logprob_start_len"] = -1  # the prompt's logprobs went out with the first event
    elif t.route == COMPLETIONS:
        if not _shorten(d, "max_tokens", "min_tokens", COMPLETION_DEFAULT_MAX, t.tokens):
            return None
        prompt = d.get("prompt")
        ids = prompt if isinstance(prompt, list) else t.prompt_ids if t.prompt_ids is not None else view.token_ids
        if ids is not None:
            token_ids = d["prompt"] = list(ids) + t.ids
        else:
            text = d["prompt"] = str(prompt) + t.text
        d["echo"] = False
    else:
        for key in ("max_completion_tokens", "max_tokens"):
            if d.get(key) is not None:
                left = d[key] - t.tokens
                if left <= 0:
                    return None
                d[key] = left
        messages = list(d.get("messages") or [])
        last = messages[-1] if messages else {}
        if d.get("continue_final_message") and last.get("role") == "assistant" and isinstance(last.get("content"), str):
            messages[-1] = {**last, "content": last["content"] + t.text}
        else:
            messages.append({"role": "assistant", "content": t.text})
        d["messages"], d["continue_final_message"] = messages, True
        if view.token_ids is not None and encode is not None:
            token_ids = list(view.token_ids) + encode(t.text)
        text = view.text + t.text if view.text is not None else None
    if isinstance(d.get("rid"), str):  # the first worker may still hold the first rid
        d["rid"] = f"{d['rid']}-m{k}"
    left_tokens = d.get("max_tokens") or d.get("max_completion_tokens") or (
        d.get("sampling_params") or {}).get("max_new_tokens")
    cont = RequestView(view.request_id, view.route, view.model, text, token_ids, None, view.session_key, True,
                       left_tokens, view.cache_salt, view.headers, qos=view.qos)
    return _enc(d), cont


class Migration:
    """``--migration-limit`` continuations per broken stream. A chat's text so far is
    counted in tokens with ``encode`` where the gateway holds the engine's tokenizer, else
    by a worker's ``/v1/tokenize`` (``registry``'s, over ``session``), else by its events."""

    def __init__(self, limit: int, metrics: GatewayMetrics, encode: Callable[[str], list[int]] | None = None,
                 registry: Any = None, session: aiohttp.ClientSession | None = None) -> None:
        self.limit = limit
        self.metrics = metrics
        self.encode = encode
        self.registry, self.session = registry, session
        self.open: dict[str, set[aiohttp.ClientResponse]] = {}  # worker url -> its recorded streams' upstreams

    def prepare(self, view: RequestView, body: object, raw: bytes) -> tuple[bool, bool, bytes]:
        """(whether the request's stream may migrate, whether the gateway asked for ids the
        client did not, the bytes to send): a completion asks for ``return_token_ids``."""
        if self.limit <= 0 or not view.stream or view.route not in ROUTES or not isinstance(body, Body) \
                or not single(body):
            return False, False, raw
        if view.route == COMPLETIONS and not body.return_token_ids:
            return True, True, splice_fields(raw, {"return_token_ids": True})
        return True, False, raw

    def watch(self, url: str, upstream: aiohttp.ClientResponse) -> Callable[[], None]:
        """Track a migratable stream's upstream until the returned callable is called."""
        streams = self.open.setdefault(url, set())
        streams.add(upstream)
        return lambda: streams.discard(upstream)

    def on_worker_event(self, event: str, worker: Any) -> None:
        """A worker found unhealthy or removed: its streams are cut, so they migrate now."""
        if event == "removed" or (event == "health" and not worker.view.healthy):
            for upstream in list(self.open.get(worker.url, ())):
                upstream.close()

    async def count(self, model: str | None, t: Transcript) -> int:
        """A chat's text so far in the engine's tokens (its events, where nothing can say)."""
        if self.encode is not None:
            return len(self.encode(t.text))
        if self.registry is not None and self.session is not None:
            workers = [w for w in self.registry.workers.values() if w.available]
            count = await engine_count(self.session, workers, model, t.text)
            if count is not None:
                return count
        return t.tokens

    async def resume(self, attempts: Attempts, request: web.Request, view: RequestView, raw: bytes,
                     broken: Broken, tried: Tried, strip_ids: bool) -> web.StreamResponse:
        """Finish the broken stream on other workers, at most ``limit`` continuations."""
        target, response = attempts.target, broken.response
        t, cause = broken.sink.transcript(), broken.cause
        problem = f"upstream failed mid-stream ({cause})"
        for k in range(self.limit):
            if not t.usable:
                problem += "; a tool call or reasoning part cannot be continued"
                break
            if t.route == COMPLETIONS and t.text and not t.ids:  # an engine without return_token_ids
                problem += "; the engine sent no token ids to continue from"
                break
            self.metrics.migrations.labels(cause).inc()
            if t.route == CHAT:
                t.tokens = await self.count(view.model, t)
            made = continuation(view, raw, t, k, self.encode)
            if made is None:  # the answer was complete but for its end
                await _end(response, _DONE)
                return response
            cont_raw, cont_view = made
            try:
                pick, cont_view = await attempts.choose(cont_view, lambda v: target.decide(v, tried), first=False)
            except NoWorkerAvailable:
                problem += "; no other worker to continue on"
                break
            urls = target.urls(pick)
            tried.urls.extend(urls)
            started = time.perf_counter()
            sink = Resume(response, t, strip_ids, self.watch)
            result = await target.attempt(request, cont_view, cont_raw, parse_body(cont_raw, view.route), pick,
                                          1000 + k, sink=sink)
            if isinstance(result, Broken):
                cause = result.cause
                continue
            if isinstance(result, Failure):
                if result.timed_out:
                    tried.timed_out.extend(urls)
                cause = result.cause or f"http_{result.status}"
                if not result.retryable:
                    problem += f"; the continuation was refused ({result.status}: {result.body[:200]!r})"
                    break
                continue
            self.metrics.migration_resume.observe(time.perf_counter() - started)
            log.info("request %s continued on %s after %d tokens", view.request_id, ", ".join(urls), sink.prior.tokens)
            return result
        else:
            problem += f"; migration limit ({self.limit}) reached"
        self.metrics.migrations_failed.inc()
        await _end(response, sse_error_frame(problem))
        return response


async def _end(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
        await response.write_eof()
    except (ConnectionResetError, ConnectionError, RuntimeError):
        pass


__all__ = ["Migration", "Record", "Resume", "continuation", "single"]
