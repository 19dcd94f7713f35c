"""sglang-router 0.3.2's flags, so a launch command written for it runs with the binary's name
changed (SMG's ``launch`` takes them too, beside many of its own that kvgate does not know).

- Flags kvgate names differently are second names of its own (``gateway.cli``:
  ``--shutdown-grace-period-secs``, ``--retry-max-retries``, ``--tls-cert-path``, ...).
- ``TUNING``: cache_aware's thresholds and tree settings become options of the policy that
  declares them (``cache_aware``, ``kv_events``); with a policy that does not (``cost`` decides
  by predicted TTFT, not thresholds) they are ignored, with a warning that says so.
- ``IGNORED``: knobs of mechanisms kvgate has but drives otherwise (retry back-off, the breaker's
  window, the tokenizer's caches, ...): accepted, with a warning.
- ``UNSUPPORTED``: features kvgate does not have. Ignoring them would change what clients or
  operators get (CORS headers a browser needs, JWT auth that is not checked), so the
  start stops with what to do instead.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

log = logging.getLogger("kvgate.cli")

TUNING: dict[str, tuple[str, type]] = {
    "--cache-threshold": ("cache_threshold", float),
    "--balance-abs-threshold": ("balance_abs_threshold", float),
    "--balance-rel-threshold": ("balance_rel_threshold", float),
    "--eviction-interval-secs": ("eviction_interval_s", float),
    "--max-tree-size": ("max_tree_size", int),
}

_RETRY = "a failed attempt is retried at once, on a worker not tried yet where there is one"
IGNORED: dict[str, str] = {
    "--retry-initial-backoff-ms": _RETRY,
    "--retry-max-backoff-ms": _RETRY,
    "--retry-backoff-multiplier": _RETRY,
    "--retry-jitter-factor": _RETRY,
    "--cb-success-threshold": "the breaker closes on its first successful trial",
    "--cb-window-duration-secs": "the breaker counts consecutive failures (--cb-failure-threshold)",
    "--worker-startup-timeout-secs": "workers join when healthy and the gateway serves meanwhile (/readiness)",
    "--worker-startup-check-interval": "workers are polled every --health-check-interval-secs",
    "--bucket-adjust-interval-secs": "the bucket policy is not built in",
    "--tokenizer-cache-enable-l0": "prompt ids are cached by --tokenize-cache-mb",
    "--tokenizer-cache-l0-max-entries": "prompt ids are cached by --tokenize-cache-mb",
    "--tokenizer-cache-enable-l1": "prompt ids are cached by --tokenize-cache-mb",
    "--tokenizer-cache-l1-max-memory": "prompt ids are cached by --tokenize-cache-mb",
    "--rate-limit-tokens-per-second": "admission queues past --max-concurrent-requests; --rate-limit-rps limits "
                                      "each client",
    "--prometheus-duration-buckets": "the latency histograms keep kvgate's buckets",
}

_HISTORY = "stored responses live on the workers that made them (/v1/responses is proxied)"
_AUTH = "give --api-key / --admin-api-key (docs/security.md)"
UNSUPPORTED: dict[str, str] = {
    "--cors-allowed-origins": "no CORS headers are sent: serve browsers through a proxy that adds them",
    "--dp-aware": "route to each data-parallel rank's own URL",
    "--enable-igw": "one gateway serves every model its workers report (/v1/models)",
    "--mini-lb": "PD is paired by the gateway itself (--pd-disaggregation)",
    "--assignment-mode": "the manual policy is not built in (consistent_hash keeps a session's worker)",
    "--max-idle-secs": "the manual policy is not built in (consistent_hash keeps a session's worker)",
    "--disable-health-check": "workers must answer their health checks to be routed to",
    "--reasoning-parser": "responses are passed through as the workers produce them",
    "--tool-call-parser": "responses are passed through as the workers produce them",
    "--mcp-config-path": "MCP is not supported",
    "--backend": "workers are SGLang servers",
    "--history-backend": _HISTORY,
    **{f"--oracle-{k}": _HISTORY for k in ("wallet-path", "tns-alias", "connect-descriptor", "username", "password",
                                           "pool-min", "pool-max", "pool-timeout-secs")},
    "--postgres-db-url": _HISTORY,
    "--postgres-pool-max": _HISTORY,
    "--redis-url": _HISTORY + "; several replicas share routing state with --state-url",
    "--redis-pool-max": _HISTORY,
    "--redis-retention-days": _HISTORY,
    "--enable-trace": "trace context (traceparent) is passed to the workers; spans are not exported",
    "--otlp-traces-endpoint": "trace context (traceparent) is passed to the workers; spans are not exported",
    "--control-plane-api-keys": _AUTH,
    "--control-plane-audit-enabled": "admin changes are always audited in the log (docs/security.md)",
    "--jwt-issuer": _AUTH,
    "--jwt-audience": _AUTH,
    "--jwt-jwks-uri": _AUTH,
    "--jwt-role-mapping": _AUTH,
}


def _dest(flag: str) -> str:
    return "router_" + flag[2:].replace("-", "_")


def add_router_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sglang-router's flags", "cache_aware's settings (as policy options: kvgate "
                             "policies cache_aware); other sglang-router flags are accepted where kvgate has the "
                             "mechanism, or refused with what to use instead")
    g.add_argument("--prometheus-port", type=int, help="also serve /metrics alone on this port")
    g.add_argument("--prometheus-host", help="address for --prometheus-port (default: --host)")
    g.add_argument("--request-id-headers", nargs="+", metavar="NAME",
                   help="headers a client's request id is read from, first found wins (default X-Request-ID)")
    g.add_argument("--health-check-endpoint", metavar="PATH", help="the workers' health path (default /health)")
    g.add_argument("--log-dir", help="also log to kvgate.log in this directory")
    for flag, (_, kind) in TUNING.items():
        g.add_argument(flag, type=kind, dest=_dest(flag), metavar="N")
    g.add_argument("--ca-cert-paths", nargs="+", dest="router_ca_cert_paths", help=argparse.SUPPRESS)
    g.add_argument("--disable-retries", action="store_const", const=0, dest="max_retries", help=argparse.SUPPRESS)
    g.add_argument("--disable-circuit-breaker", action="store_const", const=1 << 30, dest="cb_failure_threshold",
                   help=argparse.SUPPRESS)
    for flag in (*IGNORED, *UNSUPPORTED):  # values, one or several, or none (a switch)
        g.add_argument(flag, nargs="*", dest=_dest(flag), help=argparse.SUPPRESS)


def apply_router_args(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Fold the sglang-router flags given into ``data`` (GatewayConfig's fields, the YAML's and
    the flags' so far): ``SystemExit`` for one kvgate does not support."""
    refused = [f"{flag}: {why}" for flag, why in UNSUPPORTED.items() if getattr(args, _dest(flag), None) is not None]
    if refused:
        raise SystemExit("kvgate: error: sglang-router flags kvgate does not support:\n  " + "\n  ".join(refused))
    for flag, why in IGNORED.items():
        if getattr(args, _dest(flag), None) is not None:
            log.warning("%s ignored: %s", flag, why)
    cas = getattr(args, "router_ca_cert_paths", None)
    if cas:
        if len(cas) > 1:
            raise SystemExit("kvgate: error: --ca-cert-paths: kvgate takes one CA bundle (--worker-ca-file); "
                             "concatenate the PEM files")
        data.setdefault("worker_ca_file", cas[0])
    given = {flag: getattr(args, _dest(flag), None) for flag in TUNING}
    given = {flag: v for flag, v in given.items() if v is not None}
    if not given:
        return
    from policies.loader import load_policy_class, option_names

    specs = [s for s in (data.get("policy", "cost"), data.get("prefill_policy")) if s]
    declared: set[str] = set()
    for spec in specs:
        cls = load_policy_class(spec)
        declared |= option_names(cls.Options) if cls.Options is not None else set()
    options = data.setdefault("policy_options", {})
    for flag, value in given.items():
        name = TUNING[flag][0]
        if name in declared:
            options.setdefault(name, value)  # an explicit --policy-option wins
        else:
            log.warning("%s ignored: policy %s has no option %s (cache_aware and kv_events do)", flag,
                        " / ".join(specs), name)
