"""The security posture: which surfaces answer without a credential, said once at start-up
(a log line and the ``kvgate_security_posture`` info metric), and the safe default off loopback.

Surfaces and their states:

- ``data``: the generation and info routes; ``key`` with ``--api-key``, else ``open``.
- ``admin``: ``GET /workers``, ``/flush_cache``, ``/abort_request``; ``membership``: adding and
  removing workers (``POST/DELETE /workers``, ``/add_worker``, ``/remove_worker``). Both take the
  admin keys (``--admin-api-key``, else ``--api-key``): ``key``. Without any key they are ``open``
  on a loopback bind, and ``refused`` (403) on any other bind unless ``--allow-open-admin``:
  membership makes the gateway connect where it is told, ``/flush_cache`` empties every
  engine's cache, SGLang's ``/abort_request`` can abort every request (``abort_all``), and the
  worker list shows the internal addresses and their errors.
- ``metrics``: ``/metrics``; ``open`` unless ``--protect-metrics`` with a key configured.
- ``state_bus``: the NATS bus a group shares routing state on: ``off`` (none), ``loopback``,
  ``tls``, ``mtls`` (a client certificate too), or ``plain``: on another host without TLS,
  where routing records and rate-limit spends travel readable and anyone who reaches the bus
  can forge them. ``plain`` raises the line to a WARNING.

The line is a WARNING when the bind is not loopback and any surface is ``open``; else INFO.
TLS is named but does not raise the level: it is often ended in front of the gateway.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.errors import GatewayError

log = logging.getLogger("kvgate.security")


def is_loopback_host(host: str | None) -> bool:
    """True when binding ``host`` listens on loopback only: a loopback address, or a name whose
    every address is loopback. All interfaces (``""``, ``0.0.0.0``, ``::``) and a name that does
    not resolve count as exposed."""
    if not host:
        return False
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return False
        addrs = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
        return bool(addrs) and all(_loopback(a) for a in addrs)
    return _loopback(addr)


def state_bus_mode(cfg: Any) -> str:
    """``state_bus`` of the posture, from ``--state-url`` and the ``--state-tls-*`` options."""
    if not getattr(cfg, "state_url", None):
        return "off"
    url = urlsplit(cfg.state_url.split(",")[0])
    if cfg.state_tls_cert_file:
        return "mtls"
    if url.scheme == "tls" or cfg.state_tls_ca_file:
        return "tls"
    return "loopback" if is_loopback_host(url.hostname) else "plain"


def _loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


@dataclass(frozen=True, slots=True)
class Posture:
    bind: str
    exposed: bool
    tls: bool
    data: str
    admin: str
    membership: str
    metrics: str
    worker_tls: str  # off | verify | mtls
    worker_allow: str  # "any" or "N entries"
    state_bus: str = "off"  # off | loopback | tls | mtls | plain

    @classmethod
    def of(cls, cfg: Any, worker_tls: str = "off", worker_allow: str = "any",
           exposed: bool | None = None) -> Posture:
        """``exposed``: None asks ``is_loopback_host(cfg.host)``."""
        exposed = not is_loopback_host(cfg.host) if exposed is None else exposed
        admin_keys = bool(cfg.admin_api_keys or cfg.api_keys)
        admin = "key" if admin_keys else ("refused" if exposed and not cfg.allow_open_admin else "open")
        return cls(bind=cfg.host or "*", exposed=exposed, tls=bool(cfg.tls_cert_file),
                   data="key" if cfg.api_keys else "open", admin=admin, membership=admin,
                   metrics="key" if cfg.protect_metrics and admin_keys else "open",
                   worker_tls=worker_tls, worker_allow=worker_allow, state_bus=state_bus_mode(cfg))

    @property
    def open_surfaces(self) -> list[str]:
        return [name for name in ("data", "admin", "membership", "metrics") if getattr(self, name) == "open"]

    @property
    def refuses_admin(self) -> bool:
        return self.admin == "refused"

    @property
    def level(self) -> int:
        if self.state_bus == "plain":
            return logging.WARNING
        return logging.WARNING if self.exposed and self.open_surfaces else logging.INFO

    def labels(self) -> dict[str, str]:
        return {"bind": "exposed" if self.exposed else "loopback", "tls": "on" if self.tls else "off",
                "data": self.data, "admin": self.admin, "membership": self.membership, "metrics": self.metrics,
                "worker_tls": self.worker_tls, "worker_allow": self.worker_allow, "state_bus": self.state_bus}

    def line(self) -> str:
        open_ = ",".join(self.open_surfaces) or "none"
        text = (f"security posture: bind={self.bind} ({'exposed' if self.exposed else 'loopback'}) "
                f"tls={'on' if self.tls else 'off'} data={self.data} admin={self.admin} "
                f"membership={self.membership} metrics={self.metrics} worker_tls={self.worker_tls} "
                f"worker_allow={self.worker_allow.replace(' ', '_')} state_bus={self.state_bus} "
                f"open_without_credential={open_}")
        if self.refuses_admin:
            text += " (admin routes answer 403: set --admin-api-key, or --allow-open-admin)"
        if self.state_bus == "plain":
            text += " (the state bus is on another host without TLS: give a tls:// --state-url)"
        return text

    def announce(self) -> None:
        log.log(self.level, "%s", self.line())


def refuse_open_admin(bind: str) -> GatewayError:
    """The 403 for an admin route on an exposed bind with no admin key."""
    return GatewayError(403, f"admin routes are off: the gateway listens on {bind}, which is not loopback, and no "
                             "admin key is set; start it with --admin-api-key KEY (or --allow-open-admin to "
                             "serve them without a key)", code="admin_routes_disabled")
