"""The audit trail of the control plane: one line on logger ``kvgate.audit`` per admin action
(adding or removing a worker, flushing caches, aborting requests), answered or refused, and per
membership change that Kubernetes discovery makes.

Each line says when (UTC, ISO 8601), who (which configured key: ``admin_api_key[i]`` or
``api_key[i]``, the position in the list as given, never the key; ``none`` when no key is
configured, ``invalid`` for a key that matched none), from where (the peer address of the
connection; forwarding headers are not trusted), the action, its target (a JSON string, so a
URL cannot forge a line) and the HTTP status.
"""

from __future__ import annotations

import datetime
import hmac
import json
import logging
from typing import Any

from aiohttp import web

from gateway.auth import bearer_token

log = logging.getLogger("kvgate.audit")

TARGET = "kvgate.audit_target"  # request key a handler sets to what it acted on


def key_name(header: str | None, cfg: Any) -> str:
    """Which configured key ``header`` carries, by list and position (every key is compared)."""
    if not (cfg.admin_api_keys or cfg.api_keys):
        return "none"
    presented = bearer_token(header)
    if presented is None:
        return "missing"
    found = "invalid"
    p = presented.encode()
    for kind, keys in (("api_key", cfg.api_keys), ("admin_api_key", cfg.admin_api_keys)):
        for i, key in enumerate(keys):
            if hmac.compare_digest(p, key.encode()):
                found = f"{kind}[{i}]"  # the admin list wins when a key is in both
    return found


def _action(method: str, path: str) -> str:
    if path.startswith(("/workers", "/add_worker", "/remove_worker")):
        if path == "/add_worker" or (path == "/workers" and method == "POST"):
            return "add_worker"
        return "remove_worker"
    return path.strip("/")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _write(level: int, action: str, target: str, who: str, source: str, status: int | str) -> None:
    log.log(level, "time=%s action=%s target=%s key=%s source=%s status=%s", _now(), action, json.dumps(target),
            who, source, status)


def record(request: web.Request, status: int, cfg: Any) -> None:
    """One admin request, after its answer (refusals included)."""
    target = request.get(TARGET) or request.query.get("url") or request.match_info.get("url") or "*"
    level = logging.WARNING if status in (401, 403) else logging.INFO
    _write(level, _action(request.method, request.path), str(target),
           key_name(request.headers.get("Authorization"), cfg), request.remote or "-", status)


def membership(actor: str, action: str, target: str, outcome: str) -> None:
    """A membership change made by the gateway itself (``actor``: ``discovery``)."""
    _write(logging.INFO, action, target, actor, actor, outcome)
