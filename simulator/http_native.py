"""SGLang's native routes: /generate, health, info, load, cache and abort control, metrics."""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
from typing import Any

import msgspec
from aiohttp import web

from .engine import Engine, sleep_forever
from .items import ApiError, Item
from .http_common import DONE, ENGINE, json_response, native_error, open_sse, sse
from .item_stream import merged
from .metrics import CONTENT_TYPE
from .protocol import GenerateReqInput
from .runner import Progress, collect

log = logging.getLogger("simulator")

_gen_decoder = msgspec.json.Decoder(GenerateReqInput)
_any_decoder = msgspec.json.Decoder()


def native_output(engine: Engine, p: Progress, batch: bool, sent: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "text": engine.text_of(p.req, p.n),
        "output_ids": engine.output_ids(p.req, p.n, sent),
        "meta_info": engine.meta_info(p.req, p.item, p.n, p.finished, p.pd_meta),
    }
    if batch:
        out["index"] = p.item.index
    return out


async def apply_faults(engine: Engine) -> None:
    """--fault-* knobs that act on generation requests (raise ApiError or never return)."""
    a = engine.args
    engine.note_request()
    if a.fault_latency_ms:
        await asyncio.sleep(a.fault_latency_ms / 1000)
    if engine.fault_roll(a.fault_hang_rate):
        await sleep_forever()
    if engine.fault_roll(a.fault_fail_rate):
        raise ApiError(500, "Injected failure (--fault-fail-rate)", "InternalServerError")
    if engine.fault_roll(a.fault_garbage_rate):  # a broken engine or a middlebox mangling the body
        raise web.HTTPOk(body=b'{"id": "cmpl-\x00\xff\xfe garbage <html>', content_type="application/json")


async def mid_stream_fault(engine: Engine, resp: web.StreamResponse, p: Progress) -> bool:
    """``--fault-mid-stream``, once a stream has sent ``--fault-mid-stream-after`` tokens and
    is not finished: True when the stream ends here (after an error event and ``[DONE]``)."""
    a = engine.args
    if a.fault_mid_stream is None or p.finished or p.n < a.fault_mid_stream_after:
        return False
    if a.fault_mid_stream == "crash":
        log.error("fault injection: crashing mid-stream after %d tokens", p.n)
        os._exit(17)
    if a.fault_mid_stream == "hang":
        await sleep_forever()
    await resp.write(sse({"error": {"message": "Injected failure (--fault-mid-stream error)",
                                    "type": "InternalServerError", "code": 500}}))
    await resp.write(DONE)
    return True


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = _gen_decoder.decode(await request.read())
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        return native_error(ApiError(400, str(e)))
    try:
        if engine.args.is_embedding:
            raise ApiError(400, "This model is an embedding model (--is-embedding) and does not serve /generate; "
                                "use /encode or /v1/embeddings.")
        tops = body.top_logprobs_num if isinstance(body.top_logprobs_num, list) else [body.top_logprobs_num]
        if any(k is not None and k < 0 for k in tops):
            raise ApiError(400, f"top_logprobs_num must not be negative, got {body.top_logprobs_num!r}")
        items, batch = engine.items_from_generate(body)
        for it in items:
            engine.validate(it)
        await apply_faults(engine)
        if body.stream:
            return await _stream(request, engine, items, batch)
        results = await asyncio.gather(*(collect(engine, it) for it in items))
    except ApiError as e:
        return native_error(e)
    for p in results:
        if p.req.abort_message and p.req.abort_message.startswith("Decode transfer"):
            return native_error(ApiError(500, p.req.abort_message))
    outs = [native_output(engine, p, False) for p in results]
    return json_response(outs if batch else outs[0])


async def _stream(request: web.Request, engine: Engine, items: list[Item], batch: bool) -> web.StreamResponse:
    resp = await open_sse(request)
    sent: dict[int, int] = {}
    try:
        async for p in merged(engine, items):
            if isinstance(p, ApiError):
                await resp.write(sse({"error": {"message": p.message, "type": p.err_type, "code": p.status}}))
                break
            prev = sent.get(p.item.index, 0)
            await resp.write(sse(native_output(engine, p, batch, prev)))
            sent[p.item.index] = p.n
            if await mid_stream_fault(engine, resp, p):
                return resp
        await resp.write(DONE)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    return resp


# ---- health / info ---------------------------------------------------------------------------
def _healthy(engine: Engine) -> bool:
    if not engine.ready:
        return False
    flap = engine.args.fault_health_flap_secs
    if flap and int((time.monotonic() - engine.started) / flap) % 2 == 1:
        return False
    return True


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if _healthy(request.app[ENGINE]) else 503)


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not _healthy(engine):
        return web.Response(status=503)
    if engine.mode == "null":
        from .protocol import SamplingParams

        item = Item(index=0, rid=f"HEALTH_CHECK_{time.monotonic_ns()}", input_ids=[0],
                    params=SamplingParams(max_new_tokens=1))
        req = engine.make_req(item)
        req.use_cache = False
        try:
            await asyncio.wait_for(asyncio.shield(engine.submit(req).done), 20)
        except asyncio.TimeoutError:
            engine.sched_of(req).abort(req.rid)
            return web.Response(status=503)
    return web.Response(status=200)


async def ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return json_response({"status": "ready"} if engine.ready else {"status": "starting"}, 200 if engine.ready else 503)


def scheduler_stats(engine: Engine) -> dict[str, float]:
    """Simulated GPU busy time and how far the scheduler fell behind ``--time-scale``
    (benchmarks check these to tell a loaded GPU from a starved CPU)."""
    scheds = [r.scheduler for r in engine.ranks]
    return {"forward_steps": sum(s.forward_steps for s in scheds), "busy_sim_s": sum(s.busy_sim for s in scheds),
            "lag_max_s": max((s.stats.lag_max_s for s in scheds), default=0.0),
            "lag_sum_s": sum(s.stats.lag_sum_s for s in scheds),
            # > 0 means this process could not keep up with --time-scale (CPU-bound): lower
            # the time scale for faithful latencies (bench.replay reads this name)
            "max_lag_sim_s": max((s.stats.lag_max_s for s in scheds), default=0.0)}


def server_info(engine: Engine) -> dict[str, Any]:
    a, p = engine.args, engine.profile
    info: dict[str, Any] = {
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path,
        "served_model_name": a.model_name,
        "host": a.host,
        "port": a.port,
        "page_size": engine.page_size,
        "dp_size": a.dp_size,
        "tp_size": a.tp_size or p.tp,
        "pp_size": 1,
        "context_length": p.context_length,
        "max_total_num_tokens": p.max_total_num_tokens,
        "max_running_requests": p.max_running_requests,
        "chunked_prefill_size": p.chunked_prefill_size,
        "disable_radix_cache": a.disable_radix_cache,
        "schedule_policy": a.schedule_policy,
        "enable_priority_scheduling": a.enable_priority_scheduling,
        "enable_cache_report": a.enable_cache_report,
        "is_embedding": a.is_embedding,
        "enable_response_store": a.enable_response_store,
        "enable_metrics": a.enable_metrics,
        "enable_hierarchical_cache": engine.host_tokens > 0,
        "hicache_ratio": a.hicache_ratio,
        "hicache_size": a.hicache_size,
        "hicache_write_policy": a.hicache_write_policy,
        "hicache_storage_backend": a.hicache_storage_backend,
        "hicache_storage_prefetch_policy": a.hicache_storage_prefetch_policy,
        "disaggregation_mode": a.disaggregation_mode,
        "disaggregation_bootstrap_port": a.disaggregation_bootstrap_port,
        "disaggregation_transfer_backend": a.disaggregation_transfer_backend,
        "kv_events_config": None,
        "version": engine.version,
        "time_scale": a.time_scale,
        "simulator": {"profile": p.name, "kv_bytes_per_token": a.kv_bytes_per_token,
                      "host_pool_tokens": engine.host_tokens, **scheduler_stats(engine),
                      "pool": engine.pool_stats(), "cached_by_tier": dict(engine.cached_by_tier),
                      "pd_transfer": engine.pd.stats.as_dict() if engine.pd is not None else None},
        "internal_states": [{"last_gen_throughput": sum(r.scheduler.stats.gen_throughput for r in engine.ranks),
                             "memory_usage": {"token_capacity": p.max_total_num_tokens}}],
    }
    if engine.args.kv_events is not None:
        import json

        info["kv_events"] = dict(engine.args.kv_events)
        info["kv_events_config"] = json.dumps(engine.args.kv_events)
    return info


async def get_server_info(request: web.Request) -> web.Response:
    return json_response(server_info(request.app[ENGINE]))


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return json_response({
        "model_path": engine.model_path, "tokenizer_path": engine.model_path,
        "served_model_name": engine.args.model_name, "is_generation": not engine.args.is_embedding,
        "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
        "has_audio_understanding": False, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    })


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return json_response({"object": "list", "data": [{
        "id": engine.args.model_name, "object": "model", "created": int(engine_created(engine)),
        "owned_by": "sglang", "root": engine.model_path, "parent": None,
        "max_model_len": engine.profile.context_length,
    }]})


async def retrieve_model(request: web.Request) -> web.Response:
    """SGLang's ``GET /v1/models/{model}``: the served model's card, else its 404."""
    engine = request.app[ENGINE]
    name = request.match_info["model"]
    if name != engine.args.model_name:
        return json_response({"error": {"message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                                        "param": "model", "code": "model_not_found"}}, 404)
    return json_response({"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                          "root": name, "parent": None, "max_model_len": engine.profile.context_length})


def engine_created(engine: Engine) -> float:
    return time.time() - (time.monotonic() - engine.started)


# ---- load ---------------------------------------------------------------------------------------
async def get_load(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.vt > (0, 5, 20):
        raise web.HTTPNotFound()
    return json_response([{"dp_rank": s["dp_rank"], "num_reqs": s["running"] + s["waiting"],
                           "num_waiting_reqs": s["waiting"], "num_tokens": s["used"], "ts_tic": time.perf_counter()}
                          for s in engine.load_snapshots()])


LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def _load_sections(engine: Engine, s: dict, rank: Any) -> dict[str, Any]:
    """The optional sections of one rank's load record, by their ``include`` names."""
    p, pd = engine.profile, engine.pd.queue_gauges() if engine.pd is not None else {}
    return {
        "memory": {"weight_gb": round(p.weight_bytes_per_gpu / 1e9, 3),
                   "kv_cache_gb": round(s["cap"] * p.kv_bytes_per_token / p.tp / 1e9, 3),
                   "graph_gb": 0.0, "token_capacity": s["cap"]},  # no CUDA graphs are simulated
        "spec": None, "lora": None,  # no speculative decoding, no LoRA
        "disagg": {"mode": engine.mode,
                   "prefill_bootstrap_queue_reqs": pd.get("num_prefill_bootstrap_queue_reqs", 0),
                   "prefill_inflight_queue_reqs": 0,
                   "decode_prealloc_queue_reqs": pd.get("num_decode_prealloc_queue_reqs", 0),
                   "decode_transfer_queue_reqs": pd.get("num_decode_transfer_queue_reqs", 0),
                   "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0},
        "queues": {"waiting": len(rank.scheduler.waiting), "grammar": 0, "paused": 0, "retracted": 0},
    }


async def v1_loads(request: web.Request) -> web.Response:
    """SGLang's ``/v1/loads``: ``{timestamp (ISO 8601), version, loads: [per DP rank]}``, the
    twelve core fields always, the sections ``include`` names (default all; an unknown one
    is a 400), one rank with ``dp_rank``."""
    engine = request.app[ENGINE]
    if engine.vt < (0, 5, 10):
        raise web.HTTPNotFound()
    include = [x.strip() for x in request.query.get("include", "all").split(",") if x.strip()] or ["all"]
    bad = [x for x in include if x not in LOAD_SECTIONS]
    if bad:
        return json_response({"detail": f"Invalid include section(s) {bad}; valid: {', '.join(LOAD_SECTIONS)}"}, 400)
    only = request.query.get("dp_rank")
    keys = {"memory": "memory", "spec": "speculative", "lora": "lora", "disagg": "disaggregation", "queues": "queues"}
    loads = []
    for s, rank in zip(engine.load_snapshots(), engine.ranks):
        if only is not None and str(s["dp_rank"]) != only:
            continue
        load: dict[str, Any] = {
            "dp_rank": s["dp_rank"], "num_running_reqs": s["running"], "num_waiting_reqs": s["waiting"],
            "num_waiting_uncached_tokens": s["waiting_uncached"], "num_used_tokens": s["used"],
            "num_total_tokens": s["total"], "max_total_num_tokens": s["cap"],
            "max_running_requests": rank.scheduler.max_running, "token_usage": round(s["usage"], 4),
            "gen_throughput": round(rank.scheduler.stats.gen_throughput, 2),
            "cache_hit_rate": round(engine.metrics.cache_hit_rate, 4), "utilization": 0.0}
        if engine.host_tokens:
            load["hicache_host_used_tokens"] = rank.cache.tiers[1].used_tokens
            load["hicache_host_total_tokens"] = rank.cache.tiers[1].capacity_tokens
        sections = _load_sections(engine, s, rank)
        load.update({keys[k]: v for k, v in sections.items() if "all" in include or k in include})
        loads.append(load)
    return json_response({"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                          "version": engine.version, "accelerator": None,
                          "num_accelerators": engine.args.tp_size or engine.profile.tp, "loads": loads})


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not engine.args.enable_metrics:
        raise web.HTTPNotFound()
    snaps = engine.load_snapshots()
    used, cap = sum(s["used"] for s in snaps), sum(s["cap"] for s in snaps)
    host_used, host_total = engine.host_tier()
    values = {"num_running_reqs": sum(s["running"] for s in snaps), "num_queue_reqs": sum(s["waiting"] for s in snaps),
              "num_used_tokens": used, "max_total_num_tokens": cap, "token_usage": used / cap if cap else 0.0,
              "page_size": engine.page_size, "hicache_host_used_tokens": host_used,
              "gen_throughput": sum(r.scheduler.stats.gen_throughput for r in engine.ranks),
              "hicache_host_total_tokens": host_total}
    if engine.pd is not None:
        values.update(engine.pd.queue_gauges())
    body = engine.metrics.render(values)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


# ---- control ------------------------------------------------------------------------------------
async def flush_cache(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not engine.flush():
        return web.Response(status=400, text="Cache not flushed. Please check backend logs for more details. "
                                             "(When there are running or waiting requests, the operation will "
                                             "not be performed.)\n")
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                             "or waiting requests, the operation will not be performed.)\n")


async def abort_request(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    raw = await request.read()
    body = _any_decoder.decode(raw) if raw else {}
    if body.get("abort_all"):
        engine.abort(None, "Abort all requests")
    elif body.get("rid"):
        found = engine.abort(body["rid"], "Abort request")
        engine.metrics.abort_requests.labels(str(found > 0).lower()).inc()
        log.info("abort_request rid=%s found=%d", body["rid"], found)
    return web.Response(status=200)


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/generate", generate)
    r.add_put("/generate", generate)
    for path, h in (("/health", health), ("/health_generate", health_generate), ("/ready", ready),
                    ("/server_info", get_server_info), ("/get_server_info", get_server_info),
                    ("/model_info", model_info), ("/get_model_info", model_info), ("/v1/models", models),
                    ("/get_load", get_load), ("/v1/loads", v1_loads), ("/metrics", metrics)):
        r.add_get(path, h)
    r.add_get("/v1/models/{model:.+}", retrieve_model)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
