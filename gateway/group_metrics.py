"""``/metrics`` of a process group (``gateway.processes``): whichever member answers, it answers for all.

prometheus-client's multiprocess mode keeps every member's values in files under the
group's directory. Counters and histograms are summed over members, those that have
exited included, so a group's totals never go back when a member is replaced; each gauge
declares how members combine (``multiprocess_mode`` in ``gateway.metrics``), and the
supervisor drops a member's gauges when it exits.

The numbers a lone gateway reads at scrape time (``kvgate_policy_stat``,
``kvgate_tokenizer_stat``, the ``gateway.process_metrics`` gauges) describe one process.
In a group each member copies them into gauges of the same name with one more label,
``process`` (its index), every ``PUBLISH_SECS`` and whenever it answers ``/metrics``; with
them goes ``kvgate_process_requests``, the requests that member answered. The group's page
therefore shows every member's, at most ``PUBLISH_SECS`` old. The scrape-time gauges of
``gateway.metrics`` (in-flight, queue depth, ...) are refreshed on the same beat.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

log = logging.getLogger("kvgate.metrics")

PUBLISH_SECS = 1.0


class GroupMetrics:
    def __init__(self, path: str, index: int, local: Sequence[Collector], requests: Counter) -> None:
        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path)
        self.index = str(index)
        self.local = local  # read at each publish: collectors added later are included
        self.requests = requests
        self.gauges: dict[str, Gauge] = {}
        self._task: asyncio.Task | None = None

    def publish(self) -> None:
        for collector in self.local:
            for family in collector.collect():
                for sample in family.samples:
                    gauge = self._gauge(sample.name, family.documentation, tuple(sample.labels))
                    gauge.labels(*sample.labels.values(), self.index).set(sample.value)
        answered = sum(s.value for f in self.requests.collect() for s in f.samples if s.name == "kvgate_requests_total")
        self._gauge("kvgate_process_requests", "Requests this process answered since it started", ()) \
            .labels(self.index).set(answered)

    def render(self) -> bytes:
        self.publish()
        return generate_latest(self.registry)

    def start(self, refresh: Callable[[], None]) -> None:
        """Refresh and publish this member's numbers every ``PUBLISH_SECS`` until ``stop``."""
        async def beat() -> None:
            while True:
                try:
                    refresh()
                    self.publish()
                except Exception:  # a policy's stats(): the next beat tries again
                    log.exception("publishing this process's metrics failed")
                await asyncio.sleep(PUBLISH_SECS)

        self._task = asyncio.get_running_loop().create_task(beat())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _gauge(self, name: str, documentation: str, labels: tuple[str, ...]) -> Gauge:
        gauge = self.gauges.get(name)
        if gauge is None:  # registered nowhere: the group's page reads it back from the files
            gauge = self.gauges[name] = Gauge(name, documentation, [*labels, "process"], registry=None,
                                              multiprocess_mode="livemostrecent")
        return gauge
