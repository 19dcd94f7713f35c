"""``/metrics`` on a port of its own (``--prometheus-port``, sglang-router's flag), beside the
main port's: a scrape configuration written for sglang-router keeps working, and a network
policy can open the metrics port to the monitoring system alone. Only ``/metrics`` is served
there, with the main port's rules (``--protect-metrics``: the admin keys) and TLS.

In a process group every member listens on it with ``SO_REUSEPORT``; any member answers for
the whole group (``gateway.group_metrics``).
"""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.errors import GatewayError, from_exception

log = logging.getLogger("kvgate")


async def start(main: web.Application, cfg: GatewayConfig, in_group: bool) -> web.AppRunner | None:
    """Serve ``main``'s ``/metrics`` on ``--prometheus-port``, if given: the runner to clean up at exit."""
    from gateway.app import STATE, check_auth, metrics

    if cfg.prometheus_port is None:
        return None
    host, port, state = cfg.prometheus_host or cfg.host, cfg.prometheus_port, main[STATE]

    async def handle(request: web.Request) -> web.Response:
        try:
            check_auth(request, state.cfg)
        except GatewayError as exc:
            return from_exception(exc)
        return await metrics(request)

    app = web.Application()
    app[STATE] = state  # ``metrics`` reads the gateway's state from its app
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_port=in_group or None, ssl_context=state.tls.server).start()
    except OSError:
        await runner.cleanup()
        raise
    log.info("metrics also on %s://%s:%d/metrics", "https" if state.tls.server else "http", host, port)
    return runner
