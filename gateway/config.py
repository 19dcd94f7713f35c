"""Gateway configuration: one dataclass, filled from CLI flags and/or a YAML file.

Flag names follow sglang-router's where it has one, so a deployment can switch routers
by changing the binary name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from gateway.tenants import QosSpec, load_tenants
from gateway.tls import tls_problem
from gateway.worker_policy import normalize_allow


@dataclass(slots=True)
class WorkerSpec:
    url: str
    role: str = "unified"  # unified | prefill | decode
    bootstrap_port: int | None = None
    api_key: str | None = None


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    workers: list[WorkerSpec] = field(default_factory=list)
    policy: str = "cost"  # lowest predicted TTFT; won bench/RESULTS.md "Routing quality"
    policy_options: dict[str, Any] = field(default_factory=dict)
    # PD disaggregation (see gateway.pd)
    pd_disaggregation: bool = False
    prefill_policy: str | None = None
    decode_policy: str | None = None
    # auth
    api_keys: list[str] = field(default_factory=list)
    admin_api_keys: list[str] = field(default_factory=list)
    worker_api_key: str | None = None
    # admission
    max_concurrent_requests: int = 0  # 0: unlimited
    queue_size: int = 100
    queue_timeout_secs: float = 60.0
    max_hold_secs: float = 30.0  # longest a policy may hold a request (late binding); 0: never
    hold_wake: int = 16  # held requests decided again per first token or completion; 0: all
    max_payload_size: int = 256 * 1024 * 1024
    rate_limit_rps: float = 0.0  # per API key (or client IP without auth); 0: off
    rate_limit_burst: float = 0.0  # 0: one second's worth
    # multi-tenant QoS (gateway.qos, docs/qos.md): tenants, priority classes, fair shares, budgets
    tenants_file: str | None = None
    tenant_header: str | None = None  # a header naming the tenant, for requests whose key names none
    qos: QosSpec | None = None  # the tenants file, read once (by __post_init__)
    # upstream
    request_timeout_secs: float = 1800.0
    connect_timeout_secs: float = 5.0
    max_retries: int = 2
    migration_limit: int = 2  # continuations of a stream that breaks mid-way (gateway.migration); 0: off
    max_connections_per_worker: int = 0  # 0: unlimited (aiohttp limit_per_host)
    # health and breaker
    health_check_interval_secs: float = 5.0
    health_check_timeout_secs: float = 5.0
    health_check_endpoint: str = "/health"  # the workers' path that answers 200 when healthy
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    cb_failure_threshold: int = 5
    cb_timeout_secs: float = 10.0
    load_poll_interval_secs: float = 0.5
    # routing inputs
    tokenizer: str | None = None  # "byte" for the simulator, or a model directory / tokenizer.json path
    chat_template: str | None = None  # a .jinja file overriding the model's (as SGLang's --chat-template)
    tokenize_inline_chars: int = 2048  # longer prompts are tokenized on a thread, off the event loop
    tokenize_cache_mb: float = 64.0  # ids of recent prompts kept to encode only what a new one adds; 0: off
    ids_cache_mb: float = 64.0  # id lists clients sent, kept to decode only what a next turn adds; 0: off
    strict_models: bool = True  # unknown model -> 404
    request_id_headers: tuple[str, ...] = ("X-Request-ID",)  # a client's request id: the first of these it sends
    # a group of gateway processes/replicas sharing one routing state (gateway.peers)
    state_url: str | None = None  # nats://host:port; None: this process routes on its own state
    state_subject: str = "kvgate.routing"  # one group per subject on a shared NATS
    state_heartbeat_secs: float = 1.0  # a peer silent for three is gone
    state_claims: bool = True  # decisions one at a time per worker through JetStream (gateway.claims)
    state_claims_max_rps: float = 100.0  # a process routing more a second decides unclaimed (0: always claim)
    state_tls_ca_file: str | None = None  # CAs the bus's certificate is verified against (a tls:// URL)
    state_tls_cert_file: str | None = None  # client certificate shown to a bus that verifies clients
    state_tls_key_file: str | None = None
    shutdown_grace_secs: float = 30.0
    log_level: str = "info"
    log_dir: str | None = None  # also log to kvgate.log in this directory (gateway.log_setup)
    prometheus_port: int | None = None  # /metrics on a port of its own too (gateway.metrics_port)
    prometheus_host: str | None = None  # None: host
    # Kubernetes worker discovery (gateway.discovery; sglang-router's flag names)
    service_discovery: bool = False
    selector: dict[str, str] = field(default_factory=dict)  # pods that are unified workers
    prefill_selector: dict[str, str] = field(default_factory=dict)  # in PD mode
    decode_selector: dict[str, str] = field(default_factory=dict)
    service_discovery_port: int = 80  # the workers' HTTP port, where a pod names none
    service_discovery_port_name: str | None = None  # a container port of this name gives the pod's port
    service_discovery_namespace: str | None = None  # None: every namespace (needs a ClusterRole)
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"  # a prefill pod's bootstrap port
    processes: int = 1  # event-loop processes on the one port (gateway.processes); "auto": one per usable CPU
    # control-plane security (docs/security.md: gateway.posture, gateway.worker_policy, gateway.tls)
    allow_open_admin: bool = False  # admin routes without a key on a bind that is not loopback
    protect_metrics: bool = False  # /metrics takes the admin keys too
    worker_url_allow: list[str] = field(default_factory=list)  # CIDRs and host names runtime adds may use
    tls_cert_file: str | None = None  # serve HTTPS with this certificate (chain) ...
    tls_key_file: str | None = None  # ... and key (default: in the certificate file)
    worker_ca_file: str | None = None  # CAs that https workers' certificates are verified against
    worker_client_cert_file: str | None = None  # shown to workers that ask for a client certificate
    worker_client_key_file: str | None = None

    def __post_init__(self) -> None:
        # Selectors arrive as flags (a list of key=value), YAML (a mapping, a list or one string)
        # or a dict already: parsed here once, so everything after sees a dict.
        self.selector = parse_selector(self.selector)
        self.prefill_selector = parse_selector(self.prefill_selector)
        self.decode_selector = parse_selector(self.decode_selector)
        self.processes = process_count(self.processes)
        self.worker_url_allow = normalize_allow(self.worker_url_allow)
        if self.tenants_file and self.qos is None:
            self.qos = load_tenants(self.tenants_file)
        if self.qos is not None:  # tenants' keys are client keys (auth is on when there are any)
            self.api_keys = list(dict.fromkeys([*self.api_keys, *self.qos.keys]))
        elif self.tenant_header:
            raise ValueError("--tenant-header names tenants of a tenants file: give --tenants-file")
        self.request_id_headers = tuple(self.request_id_headers)
        if not self.health_check_endpoint.startswith("/"):
            raise ValueError(f"--health-check-endpoint must be a path, not {self.health_check_endpoint!r}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be 0 or more, not {self.migration_limit}")
        problem = tls_problem(self)
        if problem:
            raise ValueError(problem)


def parse_selector(value: Any) -> dict[str, str]:
    """A label selector of equality terms: a mapping, or ``key=value`` items given as a list
    and/or separated by spaces or commas (sglang-router takes ``--selector a=b c=d``, kubectl
    ``-l a=b,c=d``)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    items = [value] if isinstance(value, str) else list(value)
    out: dict[str, str] = {}
    for term in (t for item in items for t in str(item).replace(",", " ").split()):
        key, sep, val = term.replace("==", "=").partition("=")
        if not sep or not key or key.endswith("!") or "=" in val:  # only equality terms
            raise ValueError(f"label selector term {term!r}: expected key=value")
        out[key] = val
    return out


def discovery_problem(cfg: GatewayConfig) -> str | None:
    """Why the discovery options cannot work together, or None when they can."""
    if not cfg.service_discovery:
        return None
    if cfg.pd_disaggregation and not (cfg.prefill_selector or cfg.decode_selector):
        return "--service-discovery with --pd-disaggregation needs --prefill-selector and/or --decode-selector"
    if not cfg.pd_disaggregation and not cfg.selector:
        return "--service-discovery needs --selector key=value ..."
    if not 0 < cfg.service_discovery_port < 65536:
        return f"--service-discovery-port {cfg.service_discovery_port} is not a TCP port"
    return None


def process_count(value: int | str) -> int:
    """``--processes``/``processes:``: a positive count, or ``auto`` for the CPUs this process may run on."""
    if value == "auto":
        return len(os.sched_getaffinity(0))
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"processes must be a positive integer or 'auto', not {value!r}")
    return value


def load_yaml(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at top level")
    known = {f.name for f in fields(GatewayConfig)} - {"qos"}  # qos: read from tenants_file
    unknown = set(data) - known - {"worker_urls", "prefill", "decode"}
    if unknown:
        raise ValueError(f"{path}: unknown config keys: {', '.join(sorted(unknown))}")
    return data


def workers_from_mapping(data: dict[str, Any]) -> list[WorkerSpec]:
    """Accept ``worker_urls``/``prefill``/``decode`` shorthands next to full ``workers`` entries."""
    out = [WorkerSpec(**w) if isinstance(w, dict) else WorkerSpec(url=w) for w in data.pop("workers", [])]
    out += [WorkerSpec(url=u) for u in data.pop("worker_urls", [])]
    for p in data.pop("prefill", []):
        url, port = (p, None) if isinstance(p, str) else (p["url"], p.get("bootstrap_port"))
        out.append(WorkerSpec(url=url, role="prefill", bootstrap_port=port))
    out += [WorkerSpec(url=u if isinstance(u, str) else u["url"], role="decode") for u in data.pop("decode", [])]
    return out
