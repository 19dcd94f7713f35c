"""The hot path: pick a worker, forward the original bytes, pass the answer back.

Retries pick another worker only while nothing has reached the client: the first chunk
of a stream is read from upstream *before* the client's headers are sent, so a worker
that dies before its first token costs a retry, not an error. After that, an upstream
failure ends the stream with one valid JSON error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import aiohttp
import msgspec
from aiohttp import web

from gateway.errors import GatewayError, sse_error_frame
from gateway.hold import HoldRoom
from gateway.metrics import GatewayMetrics
from gateway.workers import Worker, WorkerRegistry
from index.views import Outcome, RequestView, WorkerView
from policies.base import Choice, Hold, NoWorkerAvailable, Policy

log = logging.getLogger("kvgate.proxy")

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
MALFORMED = "upstream answered with malformed JSON"
_TAIL_BYTES = 16384
T = TypeVar("T")


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


def _kind(exc: BaseException, otherwise: str) -> str:
    return "timeout" if isinstance(exc, asyncio.TimeoutError) else otherwise


def refused_hold(policy: Policy) -> GatewayError:
    """A policy answered ``Hold`` to a request that may not be held: a plugin bug."""
    return GatewayError(500, f"policy {policy.name!r} held a request it was told not to hold", code="policy_error")


async def select(policy: Policy, view: RequestView, workers: Sequence[WorkerView]) -> Choice | Hold:
    """``Policy.select`` may be plain or async; a plain ``Choice`` skips ``inspect.isawaitable``."""
    choice = policy.select(view, workers)
    if type(choice) is not Choice and inspect.isawaitable(choice):
        choice = await choice
    return choice  # type: ignore[return-value]


class Proxy:
    def __init__(self, registry: WorkerRegistry, policy: Policy, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics, max_retries: int, max_hold_s: float = 0.0, hold_wake: int = 16) -> None:
        self.registry = registry
        self.policy = policy
        self.session = session
        self.metrics = metrics
        self.max_retries = max_retries
        self.holds = HoldRoom(max_hold_s, hold_wake)

    async def choose(self, view: RequestView, decide: Callable[[], Awaitable[T | Hold]], first: bool) -> T:
        """``decide()``, holding the request while it answers ``Hold``. Only a first attempt
        may be held: a retry has waited already."""
        view.may_hold = first and self.holds.max_hold_s > 0
        result = await decide()
        if isinstance(result, Hold):
            return await self.hold(view, result, decide)
        view.may_hold = False
        return result

    async def hold(self, view: RequestView, held: Hold, decide: Callable[[], Awaitable[T | Hold]]) -> T:
        """Keep a held request until ``decide()`` answers something other than ``Hold``.

        It is asked again when a routed request reaches its first token or ends (some
        held requests are, see ``HoldRoom``), or after the policy's ``retry_s`` (backing
        off while those retries find no room); past ``max_hold_s`` the request no longer
        ``may_hold`` and the policy must choose."""
        if not view.may_hold:
            raise refused_hold(self.policy)
        room, start = self.holds, time.monotonic()
        self.metrics.held.inc()
        timeout = held.retry_s
        try:
            while True:
                left = room.max_hold_s - (time.monotonic() - start)
                woken = left > 0 and await room.wait(min(timeout, left))
                view.held_s = time.monotonic() - start
                view.may_hold = view.held_s < room.max_hold_s
                result = await decide()
                if not isinstance(result, Hold):
                    if woken:
                        room.committed()
                    return result
                if not view.may_hold:
                    raise GatewayError(500, f"policy {self.policy.name!r} held a request past max_hold_secs",
                                       code="policy_error")
                held = result
                # Held again after its own retry time: the room it was predicted did not come,
                # so it backs off (doubling, to 1 s). Held requests book nothing, so every one
                # is predicted to start soon, and fixed retries of a few ms would cost a
                # decision per held request every few ms; events still wake some at once.
                timeout = held.retry_s if woken else max(held.retry_s, min(2 * timeout, 1.0))
        finally:
            view.may_hold = False
            self.metrics.hold_seconds.observe(time.monotonic() - start)

    def freed(self) -> None:
        """A request reached its first token or ended: some held requests are decided again (``HoldRoom``)."""
        if self.holds.held:
            self.holds.notify()

    async def forward(self, request: web.Request, view: RequestView, raw: bytes, body: object = None) -> web.StreamResponse:
        tried: list[str] = []
        timed_out: list[str] = []  # never worth a second try: the engine is stuck, not unlucky
        last_failure: tuple[int, bytes, str] | None = None

        def candidates() -> list[Worker]:
            # Prefer workers not tried yet; when every one was, any available one (a fault
            # may be the request's bad luck, not the worker's; the breaker catches the rest).
            return self.registry.candidates(view.model, exclude=tried) or (
                self.registry.candidates(view.model, exclude=timed_out) if tried else [])

        async def decide() -> Choice | Hold:
            workers = candidates()
            if not workers:
                raise NoWorkerAvailable
            return await select(self.policy, view, [w.view for w in workers])

        for attempt in range(self.max_retries + 1):
            try:
                choice = await self.choose(view, decide, first=not attempt)
            except NoWorkerAvailable:
                break
            worker = self.registry.workers.get(choice.worker.url)
            if worker is None:
                raise GatewayError(500, f"policy chose unknown worker {choice.worker.url}")
            tried.append(worker.url)
            if attempt:
                self.metrics.retries.inc()
            result = await self._attempt(request, view, raw, worker, choice)
            if isinstance(result, web.StreamResponse):
                return result
            if result[0] == 0 and result[2] == "timeout":
                timed_out.append(worker.url)
            last_failure = result
        if last_failure is not None and last_failure[0] >= 400:
            status, body, ctype = last_failure
            return web.Response(status=status, body=body, content_type=ctype,
                                headers={"X-Request-ID": view.request_id})
        if tried and len(timed_out) == len(tried):
            raise GatewayError(504, f"no upstream answered within the request timeout ({', '.join(tried)})",
                               code="upstream_timeout")
        if tried:
            last = self.registry.workers.get(tried[-1])
            detail = f": {last.last_error}" if last is not None and last.last_error else ""
            raise GatewayError(502, f"all upstream attempts failed ({', '.join(tried)}){detail}", code="upstream_unavailable")
        raise GatewayError(503, "no healthy worker available" + (f" for model {view.model!r}" if view.model else ""),
                           code="no_worker_available")

    def _failed(self, worker: Worker, kind: str, detail: str) -> tuple[int, bytes, str]:
        worker.breaker.record_failure()
        worker.last_error = detail
        self.metrics.upstream_errors.labels(worker.url, kind).inc()
        log.warning("upstream %s failed (%s): %s", worker.url, kind, detail)
        return (0, b"", kind)  # no response: the third field names the failure, not a content type

    async def _attempt(self, request: web.Request, view: RequestView, raw: bytes, worker: Worker,
                       choice: Choice) -> web.StreamResponse | tuple[int, bytes, str]:
        """A response for the client, or the failure (status, body, type) to retry past."""
        worker.started()
        worker.breaker.on_attempt()
        self.metrics.routed_to(worker.url).inc()
        self.policy.on_routed(view, worker.view)
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
                return self._failed(worker, _kind(exc, "connect"), repr(exc))
            ctype = upstream.headers.get("Content-Type", "application/json")
            if upstream.status in RETRYABLE_STATUS:
                try:
                    body = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    body = b""
                outcome = Outcome(ok=False, status=upstream.status, error=body[:200].decode(errors="replace"))
                self._failed(worker, f"http_{upstream.status}", outcome.error or "")
                return (upstream.status, body, ctype.split(";")[0])
            if ctype.startswith("text/event-stream"):
                response, outcome = await self._stream(request, view, worker, upstream, started)
                return response
            try:
                body = await upstream.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                outcome.error = repr(exc)
                return self._failed(worker, _kind(exc, "read"), repr(exc))
            outcome = outcome_from_json(body, upstream.status)
            if outcome.error is MALFORMED and upstream.status < 400:
                return self._failed(worker, "malformed", f"{MALFORMED}: {body[:80]!r}")
            worker.breaker.record_success()
            self.policy.on_first_token(view, worker.view)
            self.freed()
            return web.Response(status=upstream.status, body=body, content_type=ctype.split(";")[0],
                                headers={"X-Request-ID": view.request_id})
        finally:
            worker.finished()
            if upstream is not None:
                upstream.close()  # idempotent after a full read; drops the connection otherwise
            self.count_tokens(outcome, choice)
            self.policy.on_complete(view, worker.view, outcome)
            self.freed()

    def count_tokens(self, outcome: Outcome, choice: Choice) -> None:
        """Engine-reported prompt and cached tokens, beside what the policy predicted."""
        if outcome.prompt_tokens:
            self.metrics.prompt_tokens.inc(outcome.prompt_tokens)
            if outcome.cached_tokens is not None:
                self.metrics.cached_tokens.inc(outcome.cached_tokens)
                if choice.predicted_cached_tokens is not None:
                    self.metrics.predicted_cached.inc(choice.predicted_cached_tokens)

    async def _stream(self, request: web.Request, view: RequestView, worker: Worker,
                      upstream: aiohttp.ClientResponse, started: float, *, first: bytes | None = None,
                      policy: Policy | None = None) -> tuple[web.StreamResponse | tuple, Outcome]:
        """Relay an SSE body; ``first`` is a chunk the caller already read (PD merges into it)."""
        policy = policy or self.policy
        chunks = upstream.content.iter_any()
        if first is None:
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return self._failed(worker, _kind(exc, "stream_start"), repr(exc)), Outcome(ok=False, error=repr(exc))
        response = web.StreamResponse(status=upstream.status, headers={
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "X-Request-ID": view.request_id,
        })
        await response.prepare(request)
        self.metrics.ttft_of(view.route).observe(time.perf_counter() - started)
        policy.on_first_token(view, worker.view)
        self.freed()
        # The last _TAIL_BYTES of the stream, kept as a list trimmed only when it has doubled:
        # re-slicing a 16 KiB tail on every chunk copied ~0.3 MB per 64-chunk stream.
        tail, tail_len = [first], len(first)
        chunk = first
        failure: str | None = None
        while True:
            if chunk:
                try:
                    await response.write(chunk)
                except (ConnectionResetError, ConnectionError, RuntimeError):
                    return response, Outcome(ok=False, status=499, error="client disconnected")
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                failure = repr(exc) or type(exc).__name__
                break
            tail.append(chunk)
            tail_len += len(chunk)
            if tail_len > 2 * _TAIL_BYTES:
                tail = [b"".join(tail)[-_TAIL_BYTES:]]
                tail_len = len(tail[0])
        if failure is not None:
            self._failed(worker, "mid_stream", failure)
            try:
                await response.write(sse_error_frame(f"upstream {worker.url} failed mid-stream: {failure}"))
                await response.write_eof()
            except (ConnectionResetError, ConnectionError, RuntimeError):
                pass
            return response, Outcome(ok=False, status=502, error=failure)
        worker.breaker.record_success()
        try:
            await response.write_eof()
        except (ConnectionResetError, ConnectionError, RuntimeError):
            pass
        return response, outcome_from_sse_tail(b"".join(tail)[-_TAIL_BYTES:], upstream.status)
