"""The hot path: pick a worker, forward the original bytes, pass the answer back.

Retries pick another worker only while nothing has reached the client: the first chunk
of a stream is read from upstream *before* the client's headers are sent, so a worker
that dies before its first token costs a retry, not an error. A stream that breaks after
that is finished by another worker (``gateway.migration``, docs/migration.md); one that
may not migrate (migration off, a batch, ``n`` > 1) ends with one valid JSON error event
and ``[DONE]``. The retry loop itself is ``gateway.attempts``,
shared with PD mode (``gateway.pd``); here are what one attempt on one worker does
(``Unified``) and the relay of a response both modes use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from gateway.attempts import RETRYABLE_STATUS, Attempts, Broken, Failure, Target, Tried, failed, refused_hold, select
from gateway.errors import GatewayError, sse_error_frame
from gateway.hold import HoldRoom
from gateway.metrics import GatewayMetrics
from gateway.migration import Migration
from gateway.peers import ALONE, Local
from gateway.workers import Worker, WorkerRegistry
from index.views import Outcome, RequestView
from policies.base import Choice, Hold, NoWorkerAvailable, Policy

log = logging.getLogger("kvgate.proxy")

MALFORMED = "upstream answered with malformed JSON"
_TAIL_BYTES = 16384
__all__ = ["MALFORMED", "RETRYABLE_STATUS", "Proxy", "Unified", "outcome_from_json", "outcome_from_sse_tail",
           "refused_hold", "relay", "select", "upstream_headers"]


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Meta(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


class _Result(msgspec.Struct):
    usage: _Usage | None = None
    meta_info: _Meta | None = None


_result_decoder = msgspec.json.Decoder(_Result | list[_Result])


def outcome_from_json(data: bytes, status: int) -> Outcome:
    """Token accounting from an OpenAI ``usage`` or SGLang ``meta_info`` (summed over a batch)."""
    out = Outcome(ok=status < 400, status=status)
    try:
        decoded = _result_decoder.decode(data)
    except msgspec.DecodeError:
        out.ok, out.error = False, MALFORMED
        return out
    except msgspec.ValidationError:
        return out
    for r in decoded if isinstance(decoded, list) else [decoded]:
        if r.usage is not None:
            u = r.usage
            prompt, completion = u.prompt_tokens, u.completion_tokens
            cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None
        elif r.meta_info is not None:
            prompt, completion, cached = r.meta_info.prompt_tokens, r.meta_info.completion_tokens, r.meta_info.cached_tokens
        else:
            continue
        if prompt is not None:
            out.prompt_tokens = (out.prompt_tokens or 0) + prompt
        if completion is not None:
            out.completion_tokens = (out.completion_tokens or 0) + completion
        if cached is not None:
            out.cached_tokens = (out.cached_tokens or 0) + cached
    return out


_USAGE_KEYS = (b'"usage"', b'"meta_info"')


def outcome_from_sse_tail(tail: bytes, status: int) -> Outcome:
    """The last event carrying usage/meta_info holds the final counts (SGLang's are cumulative).

    Searched from the end with ``rfind`` so that only events naming one of the keys are
    split out and decoded: scanning every event of a 64-chunk stream cost ~10% of the
    gateway's CPU on streams (bench/RESULTS.md).
    """
    end = len(tail)
    while end > 0:
        pos = max(tail.rfind(key, 0, end) for key in _USAGE_KEYS)
        if pos < 0:
            break
        start = tail.rfind(b"\n\n", 0, pos)
        start = 0 if start < 0 else start + 2
        stop = tail.find(b"\n\n", pos)
        event = tail[start:stop if stop >= 0 else len(tail)].strip()
        if event.startswith(b"data: {"):
            out = outcome_from_json(event[6:], status)
            if out.prompt_tokens is not None:
                return out
        end = start
    return Outcome(ok=status < 400, status=status)


def upstream_headers(request: web.Request, request_id: str, worker: Worker) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Request-ID": request_id}
    for name in ("Accept", "traceparent", "tracestate"):
        value = request.headers.get(name)
        if value:
            headers[name] = value
    headers.update(worker.auth_headers())
    return headers


def kind(exc: BaseException, otherwise: str) -> str:
    return "timeout" if isinstance(exc, asyncio.TimeoutError) else otherwise


def count_tokens(metrics: GatewayMetrics, outcome: Outcome, choice: Choice) -> None:
    """Engine-reported prompt and cached tokens, beside what the policy predicted."""
    if outcome.prompt_tokens:
        metrics.prompt_tokens.inc(outcome.prompt_tokens)
        if outcome.cached_tokens is not None:
            metrics.cached_tokens.inc(outcome.cached_tokens)
            if choice.predicted_cached_tokens is not None:
                metrics.predicted_cached.inc(choice.predicted_cached_tokens)


class Proxy:
    """Forwards a client request through the shared retry loop to a ``target``: by default
    one worker per attempt (``Unified``); PD mode passes its pairs (``gateway.pd``)."""

    def __init__(self, registry: WorkerRegistry, policy: Policy, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics, max_retries: int, max_hold_s: float = 0.0, hold_wake: int = 16,
                 target: Callable[[Callable[[], None]], Target] | None = None, peers: Local = ALONE,
                 holds: HoldRoom | None = None, migration: Migration | None = None) -> None:
        """``target(freed)`` builds what is attempted; ``freed`` wakes held requests.
        ``peers`` hears each request's life next to the policy (``gateway.peers``);
        ``holds``: a hold room of another order than the default's (``gateway.qos_queues``);
        ``migration``: finishes streams that break (``gateway.migration``)."""
        self.attempts: Attempts = Attempts(metrics, max_retries, max_hold_s, hold_wake)
        self.attempts.migration = migration
        if holds is not None:
            self.attempts.holds = holds
        make = target or (lambda freed: Unified(registry, policy, session, metrics, freed, peers))
        self.attempts.target = make(self.attempts.freed)
        self.holds = self.attempts.holds

    async def forward(self, request: web.Request, view: RequestView, raw: bytes, body: object = None) -> web.StreamResponse:
        return await self.attempts.run(request, view, raw, body)


class Unified:
    """One unified worker per attempt."""

    def __init__(self, registry: WorkerRegistry, policy: Policy, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics, freed: Callable[[], None], peers: Local = ALONE) -> None:
        self.registry = registry
        self.policy = policy
        self.session = session
        self.metrics = metrics
        self.freed = freed
        self.peers = peers
        # route -> make(worker url, stream): a tap that sees each 2xx body chunk relayed
        # from that worker (``gateway.responses`` learns response owners so)
        self.taps: dict[str, Callable[[str, bool], Callable[[bytes], None]]] = {}

    async def decide(self, view: RequestView, tried: Tried) -> tuple[Worker, Choice] | Hold:
        # Prefer workers not tried yet; when every one was, any available one that did not
        # time out (a fault may be the request's bad luck, not the worker's; the breaker
        # catches the rest). In a group, a first attempt with a choice to make claims its worker
        # (gateway.claims): a peer that claimed it first has been booked here by then, and the
        # policy is asked again.
        tries = self.peers.claim_tries(first=not tried.urls)
        while True:
            workers = self.candidates(view, tried.urls) or (self.candidates(view, tried.timed_out) if tried.urls else [])
            if not workers:
                raise NoWorkerAvailable
            choice = await select(self.policy, view, self.registry.views(workers))
            if isinstance(choice, Hold):
                return choice
            worker = self.registry.workers.get(choice.worker.url)
            if worker is None:
                raise GatewayError(500, f"policy chose unknown worker {choice.worker.url}")
            if not tries or await self.peers.stands(view, worker.view, choice.predicted_cached_tokens, len(workers)):
                return worker, choice
            self.policy.on_withdrawn(view, worker.view)
            tries -= 1

    def candidates(self, view: RequestView, exclude: Sequence[str]) -> list[Worker]:
        """The available workers that may serve ``view``, but those in ``exclude``."""
        return self.registry.candidates(view.model, exclude=exclude)

    @staticmethod
    def urls(pick: tuple[Worker, Choice]) -> tuple[str]:
        return (pick[0].url,)

    def exhausted(self, view: RequestView, tried: Tried) -> GatewayError:
        last = self.registry.workers.get(tried.urls[-1])
        detail = f": {last.last_error}" if last is not None and last.last_error else ""
        return GatewayError(502, f"all upstream attempts failed ({', '.join(tried.urls)}){detail}",
                            code="upstream_unavailable")

    @staticmethod
    def timed_out(view: RequestView, tried: Tried) -> GatewayError:
        return GatewayError(504, f"no upstream answered within the request timeout ({', '.join(tried.urls)})",
                            code="upstream_timeout")

    @staticmethod
    def unavailable(view: RequestView) -> GatewayError:
        return GatewayError(503, "no healthy worker available" + (f" for model {view.model!r}" if view.model else ""),
                            code="no_worker_available")

    async def attempt(self, request: web.Request, view: RequestView, raw: bytes, body: object,
                      pick: tuple[Worker, Choice], n: int, sink: Any = None) -> web.StreamResponse | Failure | Broken:
        """A response for the client, the failure to retry past, or a stream that broke."""
        worker, choice = pick
        metrics = self.metrics
        worker.started()
        worker.breaker.on_attempt()
        metrics.routed_to(worker.url).inc()
        self.policy.on_routed(view, worker.view)
        self.peers.routed(view, worker.view, choice.predicted_cached_tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s -> %s (%s, held %.3fs)", view.request_id, worker.url, choice.reason, view.held_s)
        outcome = Outcome(ok=False, status=0, error="cancelled")
        upstream: aiohttp.ClientResponse | None = None
        started = time.perf_counter()
        try:
            try:
                upstream = await self.session.post(worker.url + view.route, data=raw,
                                                   headers=upstream_headers(request, view.request_id, worker))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                outcome.error = repr(exc)
                return failed(worker, kind(exc, "connect"), repr(exc), metrics)
            ctype = upstream.headers.get("Content-Type", "application/json")
            if upstream.status in RETRYABLE_STATUS:
                try:
                    data = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    data = b""
                outcome = Outcome(ok=False, status=upstream.status, error=data[:200].decode(errors="replace"))
                failed(worker, f"http_{upstream.status}", outcome.error or "", metrics)
                return Failure.answered(upstream.status, data, ctype)
            make_tap = self.taps.get(view.route) if upstream.status < 300 else None
            if ctype.startswith("text/event-stream"):
                response, outcome = await relay(request, view, worker, upstream, started, self.policy, metrics,
                                                self.freed, peers=self.peers,
                                                tap=make_tap(worker.url, True) if make_tap else None, sink=sink)
                return response
            if sink is not None and sink.response is not None:  # a continuation must stream
                outcome = Outcome(ok=False, status=upstream.status, error="continuation answered without a stream")
                return Failure.answered(upstream.status, await upstream.read(), ctype)
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                outcome.error = repr(exc)
                return failed(worker, kind(exc, "read"), repr(exc), metrics)
            outcome = outcome_from_json(data, upstream.status)
            if outcome.error is MALFORMED and upstream.status < 400:
                return failed(worker, "malformed", f"{MALFORMED}: {data[:80]!r}", metrics)
            worker.breaker.record_success()
            if make_tap is not None:
                make_tap(worker.url, False)(data)
            self.policy.on_first_token(view, worker.view)
            self.peers.first_token(view, worker.view)
            self.freed()
            return web.Response(status=upstream.status, body=data, content_type=ctype.split(";")[0],
                                headers={"X-Request-ID": view.request_id})
        finally:
            worker.finished()
            if upstream is not None:
                upstream.close()  # idempotent after a full read; drops the connection otherwise
            count_tokens(metrics, outcome, choice)
            if view.qos is not None:
                view.qos.outcome = outcome
            self.policy.on_complete(view, worker.view, outcome)
            self.peers.completed(view, worker.view, outcome)
            self.freed()


async def relay(request: web.Request, view: RequestView, worker: Worker, upstream: aiohttp.ClientResponse,
                started: float, policy: Policy, metrics: GatewayMetrics, freed: Callable[[], None], *,
                first: bytes | None = None, peers: Local = ALONE, tap: Callable[[bytes], None] | None = None,
                sink: Any = None) -> tuple[web.StreamResponse | Failure | Broken, Outcome]:
    """Relay an SSE body; ``first`` is a chunk the caller already read (PD merges into it);
    ``tap`` sees each chunk just before the client does.
    A failure before the first chunk is answered as a ``Failure`` (nothing reached the
    client: the loop may retry). ``sink`` (a stream that may migrate, ``gateway.migration``)
    passes the chunks to the client, holds the client's response once it is prepared (a
    continuation's was prepared before), and makes a failure after the first chunk a
    ``Broken`` stream; without it, such a failure ends the stream with a JSON error event."""
    chunks = upstream.content.iter_any()
    if first is None:
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return failed(worker, kind(exc, "stream_start"), repr(exc), metrics), Outcome(ok=False, error=repr(exc))
    if sink is not None and sink.response is not None:
        response = sink.response
    else:
        response = web.StreamResponse(status=upstream.status, headers={
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "X-Request-ID": view.request_id,
        })
        await response.prepare(request)
        metrics.ttft_of(view.route).observe(time.perf_counter() - started)
        if view.qos is not None:
            view.qos.first_at = time.perf_counter()
        if sink is not None:
            sink.response = response
    policy.on_first_token(view, worker.view)
    peers.first_token(view, worker.view)
    freed()
    # The last _TAIL_BYTES of the stream, kept as a list trimmed only when it has doubled:
    # re-slicing a 16 KiB tail on every chunk copied ~0.3 MB per 64-chunk stream.
    tail, tail_len = [first], len(first)
    chunk = first
    failure = cause = None
    unwatch = sink.watch(worker.url, upstream) if sink is not None else None
    try:
        while True:
            if chunk:
                out, broke = sink.take(chunk) if sink is not None else (chunk, False)
                if out:
                    if tap is not None:
                        tap(out)
                    try:
                        await response.write(out)
                    except (ConnectionResetError, ConnectionError, RuntimeError):
                        return response, Outcome(ok=False, status=499, error="client disconnected")
                if broke:
                    failure, cause = "the engine sent an error event", "error_event"
                    break
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                failure, cause = repr(exc) or type(exc).__name__, kind(exc, "reset")
                break
            tail.append(chunk)
            tail_len += len(chunk)
            if tail_len > 2 * _TAIL_BYTES:
                tail = [b"".join(tail)[-_TAIL_BYTES:]]
                tail_len = len(tail[0])
    finally:
        if unwatch is not None:
            unwatch()
    if failure is None and sink is not None and not sink.done:
        failure, cause = "the stream ended before [DONE]", "eof"
    if failure is not None:
        failed(worker, "mid_stream", failure, metrics)
        outcome = Outcome(ok=False, status=502, error=failure)
        if sink is not None and sink.resumable:
            cause = "removed" if worker.draining else "health" if not worker.view.healthy else cause or "reset"
            return Broken(response, sink, cause), outcome
        try:
            await response.write(sse_error_frame(f"upstream {worker.url} failed mid-stream: {failure}"))
            await response.write_eof()
        except (ConnectionResetError, ConnectionError, RuntimeError):
            pass
        return response, outcome
    worker.breaker.record_success()
    try:
        await response.write_eof()
    except (ConnectionResetError, ConnectionError, RuntimeError):
        pass
    return response, outcome_from_sse_tail(b"".join(tail)[-_TAIL_BYTES:], upstream.status)
