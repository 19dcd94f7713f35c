"""Prometheus metrics for the gateway, in a registry of its own (several apps per process in tests).

In a process group (``gateway.group``) ``/metrics`` is the group's (``gateway.group_metrics``):
each gauge's ``multiprocess_mode`` says how the members' values combine there, and is
ignored by a gateway that runs alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway import group

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _PolicyCollector:
    """Exports whatever numbers the policies report through ``Policy.stats()`` at scrape time."""

    def __init__(self, sources: Callable[[], Iterable[tuple[str, Mapping[str, float]]]]) -> None:
        self.sources = sources

    def collect(self):
        fam = GaugeMetricFamily("kvgate_policy_stat", "Numbers reported by routing policies", labels=["policy", "stat"])
        for policy, stats in self.sources():
            for name, value in stats.items():
                fam.add_metric([policy, name], float(value))
        yield fam


class _TokenizerCollector:
    """The numbers of the gateway's prompt reading (``PromptEncoder.stats``, ``RecentIds.stats``),
    read at scrape time."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        fam = GaugeMetricFamily("kvgate_tokenizer_stat", "Numbers reported by the gateway's tokenizer and id "
                                "reader (prefix reuse: wire.prefix_tokens, wire.prefix_ids)", labels=["stat"])
        source = self.metrics.tokenizer_stats
        for name, value in (source() if source is not None else {}).items():
            fam.add_metric([name], float(value))
        yield fam


class _PeersCollector:
    """The state bus's numbers (``gateway.peers.Peers.stats``), read at scrape time."""

    def __init__(self, peers) -> None:
        self.peers = peers

    def collect(self):
        stats = self.peers.stats()
        yield GaugeMetricFamily("kvgate_state_connected", "1 while this process is connected to the state bus",
                                value=stats["connected"])
        yield GaugeMetricFamily("kvgate_state_peers", "Peer gateway processes heard within three heartbeats",
                                value=stats["peers"])
        yield GaugeMetricFamily("kvgate_state_peer_requests_in_flight", "Peers' requests in flight, as applied here",
                                value=stats["peer_requests_in_flight"])
        records = CounterMetricFamily("kvgate_state_records", "State-bus records, by what became of them",
                                      labels=["outcome"])
        for outcome in ("published", "dropped", "applied", "ignored", "released", "charged"):
            records.add_metric([outcome], stats[outcome])
        yield records
        if "claims_won" in stats:
            claims = CounterMetricFamily("kvgate_state_claims", "Claims on a worker for a routed request "
                                         "(won; lost to a peer's, then decided again; unsettled: went unclaimed)",
                                         labels=["outcome"])
            for outcome in ("won", "lost", "unsettled"):
                claims.add_metric([outcome], stats["claims_" + outcome])
            yield claims
            yield GaugeMetricFamily("kvgate_state_claims_ready", "1 while claims work (a JetStream stream and consumer)",
                                    value=stats["claims_ready"])


class _Children:
    """``metric.labels(...)`` validates, takes a lock and looks the child up on every call;
    the hot path uses a handful of label sets, so their children are kept here."""

    __slots__ = ("metric", "cache")

    def __init__(self, metric) -> None:
        self.metric = metric
        self.cache: dict[tuple, object] = {}

    def __call__(self, *labels):
        try:
            return self.cache[labels]
        except KeyError:
            child = self.cache[labels] = self.metric.labels(*labels)
            return child


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.before_scrape: Callable[[], None] | None = None  # sets the gauges read at scrape time
        self.requests = Counter("kvgate_requests_total", "Requests answered, by route and status", ["route", "status"], registry=r)
        self.routed = Counter("kvgate_routed_total", "Upstream attempts, by worker", ["worker"], registry=r)
        self.upstream_errors = Counter("kvgate_upstream_errors_total", "Upstream failures", ["worker", "kind"], registry=r)
        self.retries = Counter("kvgate_retries_total", "Requests re-sent to another worker before the first byte", registry=r)
        self.migrations = Counter("kvgate_migrations_total", "Continuations of streams that broke after their first "
                                  "byte, by what broke them (reset, eof, timeout, error_event, health, removed, ...)",
                                  ["cause"], registry=r)
        self.migrations_failed = Counter("kvgate_migrations_failed_total", "Broken streams that could not be "
                                         "finished (limit reached, no worker, refused): they end in an error event",
                                         registry=r)
        self.migration_resume = Histogram("kvgate_migration_resume_seconds", "From choosing a continuation's worker "
                                          "to the end of its answer", buckets=_LATENCY, registry=r)
        self.latency = Histogram("kvgate_request_duration_seconds", "Time to the last byte", ["route"], buckets=_LATENCY, registry=r)
        self.ttft = Histogram("kvgate_time_to_first_byte_seconds", "Time to the first streamed byte", ["route"], buckets=_LATENCY, registry=r)
        # in a group each member's count includes its peers' (gateway.peers): the largest is the group's
        self.in_flight = Gauge("kvgate_worker_in_flight", "Requests in flight per worker", ["worker"], registry=r,
                               multiprocess_mode="livemax")
        # in a group: 1 only while every member routes to the worker
        self.healthy = Gauge("kvgate_worker_healthy", "1 when the worker passes health checks", ["worker", "role"],
                             registry=r, multiprocess_mode="livemin")
        self.tokenizer_match = Gauge("kvgate_worker_tokenizer_match",
                                     "1 when the worker's /v1/tokenize gives the gateway's ids for a probe, 0 when not",
                                     ["worker", "kind"], registry=r, multiprocess_mode="livemin")
        self.tokenized_off_loop = Gauge("kvgate_prompts_tokenized_off_loop",
                                        "Prompts tokenized on the thread pool since start (longer than "
                                        "--tokenize-inline-chars)", registry=r, multiprocess_mode="livesum")
        self.queue_depth = Gauge("kvgate_queue_depth", "Requests waiting for admission", registry=r,
                                 multiprocess_mode="livesum")
        self.held_now = Gauge("kvgate_held_requests", "Requests the policy is holding until a worker can start them",
                              registry=r, multiprocess_mode="livesum")
        self.held = Counter("kvgate_held_total", "Requests the policy held before choosing a worker", registry=r)
        self.hold_seconds = Histogram("kvgate_hold_seconds", "Time held requests spent in the gateway before routing",
                                      buckets=_LATENCY, registry=r)
        self.rejected = Counter("kvgate_rejected_total", "Requests refused by admission or validation", ["reason"], registry=r)
        self.prompt_tokens = Counter("kvgate_prompt_tokens_total", "Prompt tokens reported by engines", registry=r)
        self.cached_tokens = Counter("kvgate_cached_tokens_total", "Cached prompt tokens reported by engines", registry=r)
        self.predicted_cached = Counter("kvgate_predicted_cached_tokens_total", "Cached tokens the policy predicted", registry=r)
        # Kubernetes discovery (gateway.discovery); zero and unchanging without --service-discovery
        self.discovery_connected = Gauge("kvgate_discovery_connected",
                                         "1 while the last Kubernetes API call for pods succeeded, 0 while "
                                         "the API is unreachable (the workers found before are kept)", registry=r)
        self.discovery_events = Counter("kvgate_discovery_events_total", "Pod watch events received, by type",
                                        ["type"], registry=r)
        self.discovery_relists = Counter("kvgate_discovery_relists_total",
                                         "Full pod lists taken (at start, and after a 410 Gone)", registry=r)
        self.discovery_workers = Gauge("kvgate_discovery_workers", "Workers registered from ready pods", registry=r)
        # control-plane security (gateway.posture, gateway.worker_policy)
        self.security_posture = Info("kvgate_security_posture", "What answers without a credential, the bind "
                                     "(loopback or exposed) and TLS, as at start-up (gateway.posture)", registry=r)
        self.worker_url_refused = Counter("kvgate_worker_url_refused_total", "Worker URLs or connections refused by "
                                          "the worker URL policy, by stage (add, connect) and reason",
                                          ["stage", "reason"], registry=r)
        # per-request children (label values are str()-ed by prometheus-client, so a status may be an int)
        self.requests_by = _Children(self.requests)
        self.routed_to = _Children(self.routed)
        self.latency_of = _Children(self.latency)
        self.ttft_of = _Children(self.ttft)
        self.policy_sources: list[tuple[str, Callable[[], Mapping[str, float]]]] = []
        self.tokenizer_stats: Callable[[], Mapping[str, float]] | None = None
        self.local: list[Collector] = []  # collectors whose numbers are this process's alone
        self.add_local(_PolicyCollector(lambda: [(n, f()) for n, f in self.policy_sources]))
        self.add_local(_TokenizerCollector(self))
        path = group.metrics_dir()
        self.group = None
        if path is not None:
            from gateway.group_metrics import GroupMetrics

            self.group = GroupMetrics(path, group.process_index(), self.local, self.requests)

    def add_local(self, collector: Collector) -> None:
        self.registry.register(collector)
        self.local.append(collector)

    def watch_peers(self, peers) -> None:
        """Export the state bus's figures and the lag from a peer's record to its application here."""
        self.add_local(_PeersCollector(peers))
        lag = Histogram("kvgate_state_lag_seconds", "From a peer publishing a record to applying it here (clocks "
                        "of different hosts included)", buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                                 0.1, 0.25, 0.5, 1, 5), registry=self.registry)
        peers.lag_observe = lag.observe

    def render(self) -> bytes:
        if self.before_scrape is not None:
            self.before_scrape()
        return generate_latest(self.registry) if self.group is None else self.group.render()
