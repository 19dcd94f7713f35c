"""What a gateway process needs to know when it is one of a group (``kvgate serve --processes N``).

The supervisor (``gateway.processes``) starts each member with these environment variables:

- ``KVGATE_PROCESS_INDEX``: the member's slot, 0..N-1; a replacement takes the slot of the
  process it replaces, so two processes share an index for the moment a reload overlaps them.
- ``KVGATE_PROCESSES``: N.
- ``KVGATE_LISTEN_FD``: the inherited listening socket of its slot (``gateway.listeners``);
  without it the member binds the port itself with ``SO_REUSEPORT``.
- ``KVGATE_READY_FD``: the write end of a pipe; one byte on it tells the supervisor that this
  member is listening with its workers registered.
- ``PROMETHEUS_MULTIPROC_DIR``: where prometheus-client keeps every member's metric values,
  so that any member's ``/metrics`` answers for the group (``gateway.group_metrics``).

A process started without ``KVGATE_PROCESS_INDEX`` is alone: index 0, nothing here changes it.

Signals a member handles besides SIGTERM/SIGINT (drain, as a lone gateway does):
``RETIRE_SIGNAL`` stops accepting at once (``stop_accepting``), lets in-flight requests
finish within the grace period and exits (the supervisor's rolling reload); SIGHUP is ignored (it is the
supervisor's, and a hang-up of the terminal must not take members down one by one).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
from collections.abc import Callable

from aiohttp import web

from gateway.drain import Drain

INDEX_ENV = "KVGATE_PROCESS_INDEX"
SIZE_ENV = "KVGATE_PROCESSES"
LISTEN_FD_ENV = "KVGATE_LISTEN_FD"
READY_FD_ENV = "KVGATE_READY_FD"
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
RETIRE_SIGNAL = signal.SIGUSR1
ORPHAN_CHECK_SECS = 1.0
RETIRE_LINGER_SECS = 1.0  # a retiring member's open connections get this long to see a Connection: close


def process_index() -> int:
    """This process's slot in its group; 0 for a gateway that runs alone."""
    return int(os.environ.get(INDEX_ENV, "0"))


def in_group() -> bool:
    return INDEX_ENV in os.environ


def share(total: int) -> int:
    """This member's part of a limit the configuration gives the whole group (admission's
    concurrency and queue): the kernel spreads connections evenly over the members, so equal
    parts that add up to ``total`` hold it. 0 (no limit) stays 0; each part is at least 1."""
    size = int(os.environ.get(SIZE_ENV, "1"))
    if total <= 0 or size <= 1:
        return total
    return max(total // size + (1 if process_index() < total % size else 0), 1)


def metrics_dir() -> str | None:
    """The group's prometheus-client multiprocess directory, when this process is a member."""
    return os.environ.get(METRICS_DIR_ENV) if in_group() else None


def site(runner: web.AppRunner, host: str, port: int, backlog: int,
         ssl_context: ssl.SSLContext | None = None) -> web.BaseSite:
    """The member's listening site: the inherited socket, or its own ``SO_REUSEPORT`` one."""
    fd = os.environ.get(LISTEN_FD_ENV)
    if fd is not None:
        return web.SockSite(runner, socket.socket(fileno=int(fd)), ssl_context=ssl_context)
    return web.TCPSite(runner, host, port, backlog=backlog, reuse_port=True, ssl_context=ssl_context)


def on_signals(loop: asyncio.AbstractEventLoop, retire: Callable[[], None]) -> None:
    loop.add_signal_handler(RETIRE_SIGNAL, retire)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


async def until_orphaned(supervisor: int) -> None:
    """Returns once the supervisor is gone (killed with no chance to stop its members), so
    that the member drains and exits rather than serve on unsupervised."""
    while os.getppid() == supervisor:
        await asyncio.sleep(ORPHAN_CHECK_SECS)


def notify_ready() -> None:
    """Tell the supervisor this member serves (once; later calls do nothing)."""
    fd = os.environ.pop(READY_FD_ENV, None)
    if fd is not None:
        try:
            os.write(int(fd), b"1")
        finally:
            os.close(int(fd))


async def stop_accepting(runner: web.AppRunner, listening: web.BaseSite, drain: Drain) -> None:
    """Leave new connections to the other members and move the clients of open ones over.

    Requests that come on open keep-alive connections are still served, each answer with
    ``Connection: close`` (a busy client reconnects after its next answer, to another
    member). After ``RETIRE_LINGER_SECS`` what is still open is either busy, and closes after
    its current request, or idle, and is closed now (a client that sends on it at that
    very moment sees the connection close, as with any server closing idle keep-alive
    connections). In-flight requests go on; ``Drain.drain`` waits for them."""
    await listening.stop()
    drain.retiring = True
    server = runner.server
    if server is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETIRE_LINGER_SECS
    while server.connections and loop.time() < deadline:
        await asyncio.sleep(0.05)
    server.pre_shutdown()
