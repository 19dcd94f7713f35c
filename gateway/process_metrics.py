"""Process gauges read at scrape time: event-loop tasks, open fds, resident memory.

They exist to catch leaks (a task per request that never ends, a socket never closed), so
they are computed when Prometheus asks, never kept up to date on the hot path.
"""

from __future__ import annotations

import asyncio
import os

from prometheus_client.core import GaugeMetricFamily


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        return -1


def rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


class ProcessCollector:
    """Registered in the gateway's own registry; ``loop`` is the one serving requests."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def collect(self):
        yield GaugeMetricFamily("kvgate_event_loop_tasks", "asyncio tasks alive on the serving loop",
                                value=len(asyncio.all_tasks(self.loop)))
        yield GaugeMetricFamily("kvgate_open_fds", "File descriptors open in the gateway process", value=open_fds())
        yield GaugeMetricFamily("kvgate_resident_memory_bytes", "Resident set size (VmRSS)", value=rss_bytes())
