"""Per-tenant and per-class QoS metrics. Label values are tenant and class names from the
tenants file only (a client naming an unknown tenant is ``default``), so their number is
bounded by the file however many clients there are."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from gateway.metrics import _LATENCY, _Children

# per queue ("admission", "hold"): waiters per (tenant, class rank)
QueueCounts = Callable[[], dict[tuple[str, int], int]]


class _QueuedCollector:
    """``kvgate_qos_queued``, read from the queues at scrape time."""

    def __init__(self, classes: list[str], sources: list[tuple[str, QueueCounts]]) -> None:
        self.classes = classes
        self.sources = sources

    def collect(self) -> Iterable[GaugeMetricFamily]:
        fam = GaugeMetricFamily("kvgate_qos_queued", "Requests waiting in a gateway queue (admission, hold), by "
                                "tenant and priority class", labels=["tenant", "class", "queue"])
        for queue, counts in self.sources:
            for (tenant, rank), n in sorted(counts().items()):
                fam.add_metric([tenant, self.classes[rank], queue], float(n))
        yield fam


class QosMetrics:
    def __init__(self, registry: CollectorRegistry, classes: list[str],
                 add_local: Callable[[object], None]) -> None:
        r = registry
        self.admitted = Counter("kvgate_qos_admitted_total", "Requests that went to a worker, by tenant and class",
                                ["tenant", "class"], registry=r)
        self.rejected = Counter("kvgate_qos_rejected_total", "Requests refused by QoS (budgets, queue, SLO, class), "
                                "by tenant, class and reason", ["tenant", "class", "reason"], registry=r)
        self.ttft = Histogram("kvgate_qos_ttft_seconds", "From arrival at the gateway (queues included) to the "
                              "first byte of a stream or the whole of an answer that is not streamed",
                              ["tenant", "class"], buckets=_LATENCY, registry=r)
        self.used = Counter("kvgate_qos_tokens_total", "Tokens the engines reported, by tenant and kind "
                            "(prompt, completion)", ["tenant", "kind"], registry=r)
        self.admitted_by = _Children(self.admitted)
        self.rejected_by = _Children(self.rejected)
        self.ttft_of = _Children(self.ttft)
        self.used_by = _Children(self.used)
        self.queues: list[tuple[str, QueueCounts]] = []
        add_local(_QueuedCollector(classes, self.queues))

    def tokens(self, ticket: object, prompt: int, completion: int) -> None:
        tenant = ticket.tenant  # type: ignore[attr-defined]
        if prompt:
            self.used_by(tenant, "prompt").inc(prompt)
        if completion:
            self.used_by(tenant, "completion").inc(completion)
