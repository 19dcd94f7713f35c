"""SGLang's Prometheus metrics (``sglang:*``), read from the scheduler at scrape time.

Gauges are refreshed in ``render`` rather than on every step, so a busy scheduler pays
nothing for them; counters and histograms are fed once per finished request.
"""

from __future__ import annotations


from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LAT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                15.0, 20.0, 25.0, 30.0, 40.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1,
                0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
_MS_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


class Metrics:
    def __init__(self, model_name: str, engine_type: str) -> None:
        self.registry = r = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine_type": engine_type, "tp_rank": "0", "pp_rank": "0"}
        names = list(self.labels)

        def g(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, names, registry=r)

        def c(name: str, doc: str) -> Counter:
            return Counter(f"sglang:{name}", doc, names, registry=r)

        def h(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"sglang:{name}", doc, names, buckets=buckets, registry=r)

        self.gauges = {k: g(k, d).labels(**self.labels) for k, d in {
            "num_running_reqs": "The number of running requests.",
            "num_queue_reqs": "The number of requests in the waiting queue.",
            "num_used_tokens": "The number of used tokens.",
            "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
            "token_usage": "The token usage.",
            "gen_throughput": "The generation throughput (token/s).",
            "cache_hit_rate": "The prefix cache hit rate.",
            "page_size": "The page size of the KV cache.",
            "num_prefill_bootstrap_queue_reqs": "Requests in the prefill bootstrap queue.",
            "num_decode_prealloc_queue_reqs": "Requests in the decode prealloc queue.",
            "num_decode_transfer_queue_reqs": "Requests in the decode transfer queue.",
            "hicache_host_used_tokens": "Tokens held in the HiCache host pool.",
            "hicache_host_total_tokens": "Capacity of the HiCache host pool in tokens.",
        }.items()}
        self.prompt_tokens = c("prompt_tokens", "Number of prefill tokens processed.").labels(**self.labels)
        self.generation_tokens = c("generation_tokens", "Number of generation tokens processed.").labels(**self.labels)
        self.cached_tokens = c("cached_tokens", "Number of cached prompt tokens.").labels(**self.labels)
        self.num_requests = c("num_requests", "Number of requests processed.").labels(**self.labels)
        self.num_aborted = c("num_aborted_requests", "Number of aborted requests.").labels(**self.labels)
        self.transfer_failed = c("num_transfer_failed_reqs", "Failed KV transfers.").labels(**self.labels)
        # Not an SGLang metric: lets a test see which /abort_request calls a router made.
        self.abort_requests = Counter("kvgate_sim_abort_requests", "/abort_request calls by rid, and whether one "
                                      "was found (queued, running or waiting for its KV).", ["found"], registry=r)
        self.ttft = h("time_to_first_token_seconds", "Time to first token.", _LAT_BUCKETS).labels(**self.labels)
        self.itl = h("inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS).labels(**self.labels)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency.", _LAT_BUCKETS).labels(**self.labels)
        self.kv_transfer_ms = h("kv_transfer_latency_ms", "KV transfer latency (ms).", _MS_BUCKETS).labels(**self.labels)
        self.kv_transfer_speed = g("kv_transfer_speed_gb_s", "KV transfer speed (GB/s).").labels(**self.labels)
        self.gen_total = 0
        self.prompt_total = 0
        self.cached_total = 0

    def observe_finish(self, prompt: int, cached: int, generated: int, ttft: float | None, e2e: float,
                       aborted: bool) -> None:
        self.num_requests.inc()
        if aborted:
            self.num_aborted.inc()
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)
        self.prompt_total += prompt
        self.cached_total += cached
        self.gen_total += generated
        if ttft is not None:
            self.ttft.observe(ttft)
            if generated > 1:
                self.itl.observe((e2e - ttft) / (generated - 1))
        self.e2e.observe(e2e)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_total / self.prompt_total if self.prompt_total else 0.0

    def render(self, values: dict[str, float]) -> bytes:
        for k, v in values.items():
            self.gauges[k].set(v)
        self.gauges["cache_hit_rate"].set(self.cache_hit_rate)
        return generate_latest(self.registry)
