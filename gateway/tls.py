"""TLS on both sides of the gateway, from ``ssl`` contexts built once at start.

- Clients to the gateway: ``--tls-cert-file`` (and ``--tls-key-file`` when the key is not in
  the same PEM). ``reload()`` (SIGHUP) loads the files again into the *same* server context:
  the listener stays up, connections already open keep the certificate they shook hands with,
  and every new handshake gets the new one. Files that do not load leave the old ones in
  place (each is first loaded into a scratch context).
- The gateway to workers: ``--worker-ca-file`` is the CA bundle https workers are verified
  against (default: the system's), ``--worker-client-cert-file``/``--worker-client-key-file``
  the certificate shown to workers that ask for one (mTLS); SIGHUP reloads that pair too.
  The worker's certificate must name the host of its URL (hostname checking stays on).
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

import aiohttp

log = logging.getLogger("kvgate.security")


def tls_problem(cfg: Any) -> str | None:
    """Why the TLS options cannot work together, or None when they can (files are read at start)."""
    if cfg.tls_key_file and not cfg.tls_cert_file:
        return "--tls-key-file needs --tls-cert-file"
    if cfg.worker_client_key_file and not cfg.worker_client_cert_file:
        return "--worker-client-key-file needs --worker-client-cert-file"
    if cfg.state_tls_key_file and not cfg.state_tls_cert_file:
        return "--state-tls-key-file needs --state-tls-cert-file"
    if (cfg.state_tls_ca_file or cfg.state_tls_cert_file) and not cfg.state_url:
        return "--state-tls-* options need --state-url"
    return None


def state_bus_context(cfg: Any) -> ssl.SSLContext | None:
    """The client context for the state bus (None: nats-py's default, the system CAs, when the
    server asks for TLS). Its hostname checking stays on: the bus's certificate names its host."""
    if not (cfg.state_tls_ca_file or cfg.state_tls_cert_file):
        return None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.state_tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load --state-tls-ca-file {cfg.state_tls_ca_file}: {exc}") from None
    if cfg.state_tls_cert_file:
        _load_pair(ctx, cfg.state_tls_cert_file, cfg.state_tls_key_file)
    return ctx


def _load_pair(ctx: ssl.SSLContext, cert: str, key: str | None) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load certificate {cert}" + (f" with key {key}" if key else "") + f": {exc}") from None


class TlsContexts:
    """The server context (None: plain HTTP) and the worker-side client context (None: aiohttp's
    default, the system CAs and no client certificate)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.server: ssl.SSLContext | None = None
        self.worker: ssl.SSLContext | None = None
        if cfg.tls_cert_file:
            self.server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            _load_pair(self.server, cfg.tls_cert_file, cfg.tls_key_file)
        if cfg.worker_ca_file or cfg.worker_client_cert_file:
            try:
                self.worker = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.worker_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"cannot load --worker-ca-file {cfg.worker_ca_file}: {exc}") from None
            if cfg.worker_client_cert_file:
                _load_pair(self.worker, cfg.worker_client_cert_file, cfg.worker_client_key_file)

    @property
    def worker_mode(self) -> str:
        """For the posture line: ``off`` (system CAs), ``verify`` (own CA), ``mtls`` (client certificate)."""
        if self.cfg.worker_client_cert_file:
            return "mtls"
        return "verify" if self.cfg.worker_ca_file else "off"

    def reload(self) -> bool:
        """Load the certificate files again (SIGHUP); True when every pair loaded."""
        ok = True
        pairs = [(self.server, self.cfg.tls_cert_file, self.cfg.tls_key_file, "server"),
                 (self.worker, self.cfg.worker_client_cert_file, self.cfg.worker_client_key_file, "worker client")]
        for ctx, cert, key, what in pairs:
            if ctx is None or not cert:
                continue
            purpose = ssl.Purpose.CLIENT_AUTH if what == "server" else ssl.Purpose.SERVER_AUTH
            try:
                _load_pair(ssl.create_default_context(purpose), cert, key)  # refuse what would not load
                _load_pair(ctx, cert, key)
                log.info("TLS %s certificate reloaded from %s", what, cert)
            except ValueError as exc:
                ok = False
                log.error("TLS %s certificate not reloaded, the previous one stays: %s", what, exc)
        return ok


def explain(exc: BaseException, url: str = "", client_cert: str | None = None) -> str:
    """A worker connection error in words an operator can act on (``GET /workers`` last_error).

    A worker that requires a client certificate refuses a missing or untrusted one after the
    TLS 1.3 handshake, so the client sees only a closed connection: on an https worker that
    is named as the likely cause."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return (f"TLS: the worker's certificate was rejected ({exc.certificate_error}); it must be signed by "
                f"a CA in --worker-ca-file and name the URL's host")
    if isinstance(exc, aiohttp.ClientSSLError):
        return f"TLS handshake failed ({exc})" + _client_cert_hint(client_cert)
    if isinstance(exc, aiohttp.ClientConnectorError):  # no connection at all (refused, unreachable, DNS)
        return repr(exc)
    if url.startswith("https://") and isinstance(exc, (aiohttp.ServerDisconnectedError, ConnectionResetError,
                                                       aiohttp.ClientOSError)):
        return f"TLS: the worker closed the connection ({exc!r})" + _client_cert_hint(client_cert)
    return repr(exc)


def _client_cert_hint(client_cert: str | None) -> str:
    if client_cert:
        return f"; a worker requiring client certificates may not trust {client_cert} (--worker-client-cert-file)"
    return "; a worker requiring client certificates does this when none is shown: set --worker-client-cert-file"
