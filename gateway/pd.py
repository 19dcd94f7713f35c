"""Prefill/decode disaggregation: one client request, two engine requests, one answer.

The same body goes to a prefill and a decode worker at once, with ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` spliced into the original bytes (the rest is
never re-serialised). The engines pair up through the room and move KV over Mooncake;
the client gets decode's answer, streamed as soon as decode sends it.

Failure rule, stricter than the anchor: whichever leg fails first, the other is aborted
at once (its HTTP call cancelled and ``/abort_request`` sent with its rid), so decode is
never left waiting for a room that will not come. Before the first byte reaches the
client, a failure picks a new pair and a new room; after it, a decode that fails is
followed by a continuation on a new pair and room (``gateway.migration``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from gateway.attempts import RETRYABLE_STATUS, Broken, Failure, Reply, Tried, failed, refused_hold
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.peers import ALONE, Local
from gateway.proxy import count_tokens, kind, outcome_from_json, outcome_from_sse_tail, relay, upstream_headers
from gateway.request import Body, splice_fields
from gateway.workers import Worker, WorkerRegistry
from index.views import Outcome, RequestView
from policies.base import Choice, Hold, NoWorkerAvailable, Policy, select_each, selects_pairs

log = logging.getLogger("kvgate.pd")
_enc = msgspec.json.encode
_dec = msgspec.json.decode


def batch_size(body: Body) -> int | None:
    """Items the engine will expand the request into, or None for a single request."""
    sp = body.sampling_params
    n = body.n or (sp.n if sp is not None and not isinstance(sp, list) else None) or 1
    for field in (body.text, body.input_ids, body.prompt):
        if isinstance(field, list) and field and isinstance(field[0], (str, list)):
            return len(field) * n
    return n if n > 1 else None


def wants_logprobs(body: Body) -> bool:
    rl = body.return_logprob
    return bool(rl if not isinstance(rl, list) else any(rl))


def merge_input_logprobs(decode_obj: Any, prefill_obj: Any) -> Any:
    """Prefill computed the prompt's logprobs; put them in front of decode's (per batch item)."""
    if isinstance(decode_obj, list) and isinstance(prefill_obj, list):
        return [merge_input_logprobs(d, p) for d, p in zip(decode_obj, prefill_obj)]
    if isinstance(decode_obj, dict) and isinstance(prefill_obj, dict):
        d_meta, p_meta = decode_obj.get("meta_info"), prefill_obj.get("meta_info")
        if isinstance(d_meta, dict) and isinstance(p_meta, dict):
            for key in ("input_token_logprobs", "input_top_logprobs"):
                if p_meta.get(key):
                    d_meta[key] = list(p_meta[key]) + list(d_meta.get(key) or [])
    return decode_obj


def last_sse_json(data: bytes) -> Any:
    """The last JSON event of an SSE body (prefill streams when the client asked to)."""
    for event in reversed(data.split(b"\n\n")):
        event = event.strip()
        if event.startswith(b"data: {") or event.startswith(b"data: ["):
            try:
                return _dec(event[6:])
            except msgspec.DecodeError:
                continue
    return None


def prefill_outcome(reply: Reply) -> Outcome:
    """Prompt and cached tokens as the prefill engine reported them (JSON or its SSE body)."""
    if reply.content_type.startswith("text/event-stream"):
        return outcome_from_sse_tail(reply.body[-16384:], reply.status)
    return outcome_from_json(reply.body, reply.status)


@dataclass(frozen=True, slots=True)
class _Pick:
    """One attempt's pair: the workers and the policies' choices of them."""

    prefill: Worker
    decode: Worker
    p_choice: Choice
    d_choice: Choice


def _merge_first_event(first: bytes, prefill_data: bytes) -> bytes:
    head, sep, rest = first.partition(b"\n\n")
    if not sep or not head.startswith(b"data: {"):
        return first
    prefill_obj = last_sse_json(prefill_data) if prefill_data.lstrip().startswith(b"data:") else _dec(prefill_data)
    merged = merge_input_logprobs(_dec(head[6:]), prefill_obj)
    return b"data: " + _enc(merged) + b"\n\n" + rest



class Pairs:
    """What PD mode attempts: a prefill and a decode worker, asked at once (the target of
    the shared retry loop, ``gateway.attempts``)."""

    def __init__(self, registry: WorkerRegistry, policy: Policy, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics, freed: Callable[[], None], *, prefill_policy: Policy,
                 decode_policy: Policy, peers: Local = ALONE) -> None:
        self.registry = registry
        self.peers = peers
        self.policy = policy  # the main policy: named when a hold goes wrong
        self.session = session
        self.metrics = metrics
        self.freed = freed
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.joint = selects_pairs(prefill_policy, decode_policy)

    async def decide(self, view: RequestView, tried: Tried) -> _Pick | Hold:
        def pool(role: str) -> list[Worker]:  # untried first, as in unified mode
            return (self.registry.candidates(view.model, role=role, exclude=tried.urls)
                    or (self.registry.candidates(view.model, role=role) if tried.urls else []))

        # In a group, a first attempt claims its prefill worker, as in unified mode (gateway.claims).
        tries = self.peers.claim_tries(first=not tried.urls)
        while True:
            prefills, decodes = pool("prefill"), pool("decode")
            if not prefills or not decodes:
                raise NoWorkerAvailable
            p_views, d_views = self.registry.views(prefills), self.registry.views(decodes)
            if self.joint:
                chosen: Any = self.prefill_policy.select_pair(view, p_views, d_views)
                if inspect.isawaitable(chosen):
                    chosen = await chosen
            else:
                chosen = await select_each(self.prefill_policy, self.decode_policy, view, p_views, d_views)
            if isinstance(chosen, Hold):
                return chosen
            p_choice, d_choice = chosen
            if isinstance(d_choice, Hold):
                raise refused_hold(self.decode_policy)
            pick = _Pick(self.registry.workers[p_choice.worker.url], self.registry.workers[d_choice.worker.url],
                         p_choice, d_choice)
            if not tries or await self.peers.stands(view, pick.prefill.view, p_choice.predicted_cached_tokens,
                                                    len(prefills)):
                return pick
            self.prefill_policy.on_withdrawn(view, pick.prefill.view)
            self.decode_policy.on_withdrawn(view, pick.decode.view)
            tries -= 1

    @staticmethod
    def urls(pick: _Pick) -> tuple[str, str]:
        return pick.prefill.url, pick.decode.url

    @staticmethod
    def exhausted(view: RequestView, tried: Tried) -> GatewayError:
        return GatewayError(502, "all prefill/decode attempts failed", code="upstream_unavailable")

    @staticmethod
    def timed_out(view: RequestView, tried: Tried) -> GatewayError:
        return GatewayError(504, "no prefill/decode pair answered within the request timeout",
                            code="upstream_timeout")

    @staticmethod
    def unavailable(view: RequestView) -> GatewayError:
        return GatewayError(503, "PD mode needs a healthy prefill and a healthy decode worker",
                            code="no_worker_available")

    async def attempt(self, request: web.Request, view: RequestView, raw: bytes, body: object, pick: _Pick,
                      n: int, sink: Any = None) -> web.StreamResponse | Failure | Broken:
        """Attempt ``n``: a new room (and, where the client named none, a new rid) each time;
        a continuation (``sink``, ``gateway.migration``) is one too, so a decode that dies
        mid-stream is followed by a fresh pair and room."""
        assert isinstance(body, Body)
        prefill = pick.prefill
        items = batch_size(body)
        rooms: int | list[int] = random.getrandbits(63) if items is None else [random.getrandbits(63) for _ in range(items)]
        fields: dict[str, Any] = {
            "bootstrap_host": prefill.view.host if items is None else [prefill.view.host] * items,
            "bootstrap_port": prefill.view.bootstrap_port if items is None else [prefill.view.bootstrap_port] * items,
            "bootstrap_room": rooms,
        }
        rid = body.rid
        if rid is None:  # the partner leg can only be aborted by rid
            rid = f"{view.request_id}-{n}"
            fields["rid"] = rid if items is None else [f"{rid}-{i}" for i in range(items)]
            rid = fields["rid"]
        return await self._attempt_pair(request, view, splice_fields(raw, fields), body, pick, rid, sink)

    async def _abort(self, worker: Worker, rid: str | list[str]) -> None:
        """Best effort: the engine drops a queued or waiting request by rid."""
        for one in rid if isinstance(rid, list) else [rid]:
            try:
                async with self.session.post(worker.url + "/abort_request", json={"rid": one},
                                             headers=worker.auth_headers(),
                                             timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    await resp.read()
            except Exception as exc:  # the leg may be dead already: that is why we abort
                log.debug("abort of %s on %s failed: %r", one, worker.url, exc)

    async def _call_prefill(self, request: web.Request, view: RequestView, raw: bytes, worker: Worker) -> Reply:
        async with self.session.post(worker.url + view.route, data=raw,
                                     headers=upstream_headers(request, view.request_id, worker)) as resp:
            return Reply(resp.status, await resp.read(), resp.headers.get("Content-Type", "application/json"))

    async def _open_decode(self, request: web.Request, view: RequestView, raw: bytes, worker: Worker
                           ) -> tuple[aiohttp.ClientResponse, bytes | None]:
        """Decode's response and, for streams, its first chunk (None when the body is JSON)."""
        resp = await self.session.post(worker.url + view.route, data=raw,
                                       headers=upstream_headers(request, view.request_id, worker))
        try:
            if resp.status >= 400 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                await resp.read()
                return resp, None
            first = await resp.content.readany()
            return resp, first
        except BaseException:
            resp.close()
            raise

    async def _attempt_pair(self, request: web.Request, view: RequestView, raw: bytes, body: Body, pick: _Pick,
                            rid: str | list[str], sink: Any = None) -> web.StreamResponse | Failure | Broken:
        prefill, decode, metrics = pick.prefill, pick.decode, self.metrics
        peers = self.peers
        for w, policy, choice in ((prefill, self.prefill_policy, pick.p_choice),
                                  (decode, self.decode_policy, pick.d_choice)):
            w.started()
            w.breaker.on_attempt()
            metrics.routed.labels(w.url).inc()
            policy.on_routed(view, w.view)
            peers.routed(view, w.view, choice.predicted_cached_tokens)
        p_task = asyncio.create_task(self._call_prefill(request, view, raw, prefill))
        d_task = asyncio.create_task(self._open_decode(request, view, raw, decode))
        started = time.perf_counter()
        p_outcome = d_outcome = Outcome(ok=False, error="cancelled")
        upstream: aiohttp.ClientResponse | None = None
        try:
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done:
                failure = self._leg_failure(prefill, p_task)
                if failure is not None:
                    p_outcome = Outcome(ok=False, status=failure.status, error=failure.body[:200].decode(errors="replace"))
                    d_task.cancel()
                    await self._abort(decode, rid)
                    return failure
            try:
                upstream, first = await d_task
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                failure = failed(decode, kind(exc, "connect"), repr(exc), metrics)
                p_task.cancel()
                await self._abort(prefill, rid)
                return failure
            if upstream.status >= 400:
                data = await upstream.read()
                if upstream.status in RETRYABLE_STATUS:
                    failed(decode, f"http_{upstream.status}", data[:200].decode(errors="replace"), metrics)
                p_task.cancel()
                await self._abort(prefill, rid)
                d_outcome = Outcome(ok=False, status=upstream.status)
                return Failure.answered(upstream.status, data, upstream.headers.get("Content-Type", "application/json"))
            need_prefill = wants_logprobs(body)
            if need_prefill or first is None:
                # Decode answered, so prefill has (or is about to have) finished; its errors still count.
                reply = await p_task
                if reply.status >= 400:
                    return Failure.answered(reply.status, reply.body, "application/json")
            prefill.breaker.record_success()
            p_outcome = Outcome(ok=True, status=200)
            self.prefill_policy.on_first_token(view, prefill.view)
            peers.first_token(view, prefill.view)
            self.freed()
            if first is None:  # non-stream JSON
                data = await upstream.read()
                if sink is not None and sink.response is not None:  # a continuation must stream
                    return Failure.answered(upstream.status, data, upstream.headers.get("Content-Type", ""))
                if need_prefill:
                    data = _enc(merge_input_logprobs(_dec(data), _dec(p_task.result().body)))
                decode.breaker.record_success()
                d_outcome = outcome_from_json(data, upstream.status)
                self.decode_policy.on_first_token(view, decode.view)
                peers.first_token(view, decode.view)
                return web.Response(status=upstream.status, body=data,
                                    content_type=upstream.headers.get("Content-Type", "application/json").split(";")[0],
                                    headers={"X-Request-ID": view.request_id})
            if need_prefill:
                first = _merge_first_event(first, p_task.result().body)
            response, d_outcome = await relay(request, view, decode, upstream, started, self.decode_policy,
                                              metrics, self.freed, first=first, peers=peers, sink=sink)
            return response
        finally:
            for task in (p_task, d_task):
                if not task.done():
                    task.cancel()
            if upstream is not None:
                upstream.close()
            prefill.finished()
            decode.finished()
            if p_outcome.ok and p_task.done() and not p_task.cancelled() and p_task.exception() is None:
                p_outcome = prefill_outcome(p_task.result())  # the prefix hit happens on prefill
            count_tokens(metrics, p_outcome, pick.p_choice)
            self.prefill_policy.on_complete(view, prefill.view, p_outcome)
            self.decode_policy.on_complete(view, decode.view, d_outcome)
            if view.qos is not None:
                view.qos.outcome = d_outcome
            peers.completed(view, prefill.view, p_outcome)
            peers.completed(view, decode.view, d_outcome)
            self.freed()

    def _leg_failure(self, worker: Worker, task: asyncio.Task) -> Failure | None:
        exc = task.exception()
        if exc is not None:
            return failed(worker, kind(exc, "connect"), repr(exc), self.metrics)
        reply: Reply = task.result()
        if reply.status >= 400:
            if reply.status in RETRYABLE_STATUS:
                failed(worker, f"http_{reply.status}", reply.body[:200].decode(errors="replace"), self.metrics)
            return Failure.answered(reply.status, reply.body, reply.content_type)
        return None


def pd_policies(cfg: Any, default: Policy, load: Any) -> tuple[Policy, Policy]:
    prefill = load(cfg.prefill_policy, **cfg.policy_options) if cfg.prefill_policy else default
    decode = load(cfg.decode_policy or "least_load")
    return prefill, decode


__all__: Sequence[str] = ["Pairs", "splice_fields", "batch_size", "merge_input_logprobs", "pd_policies"]
