"""Everything a request handler needs, built once per gateway process: the policies, the
worker registry, the proxy, admission, the rate limiter and, when the process is one of a
group, its peers on the state bus (``gateway.peers``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp

from gateway import group, tokenizer_check
from gateway.admission import Admission
from gateway.config import GatewayConfig
from gateway.drain import Drain
from gateway.encoding import PromptEncoder
from gateway.membership import SharedMembership
from gateway.metrics import GatewayMetrics
from gateway.migration import Migration
from gateway.pd import Pairs, pd_policies
from gateway.peers import ALONE, Local, Peers
from gateway.posture import Posture
from gateway.process_metrics import ProcessCollector
from gateway.proxy import Proxy
from gateway.ratelimit import RateLimiter
from gateway.tls import TlsContexts, state_bus_context
from gateway.upstream import make_session
from gateway.worker_policy import WorkerGate, WorkerUrlPolicy
from gateway.workers import WorkerRegistry
from policies.base import Policy
from policies.loader import load_policy, options_for
from wire.prefix_ids import RecentIds
from wire.tokenizer import load_tokenizer

OPEN_PATHS = ("/health", "/readiness", "/liveness", "/metrics", "/openapi.json")


class GatewayState:
    """Everything a handler needs, built once at startup."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.process_index = group.process_index()  # slot in a process group (gateway.group); 0 alone
        self.metrics = GatewayMetrics()
        self.qos = _qos(cfg, self.metrics)  # multi-tenant QoS (gateway.qos); None without a tenants file
        limits = replace(cfg, max_concurrent_requests=group.share(cfg.max_concurrent_requests),
                         queue_size=group.share(cfg.queue_size))  # the group's, split over its members
        self.admission = Admission(limits.max_concurrent_requests, limits.queue_size, cfg.queue_timeout_secs) \
            if self.qos is None else self.qos.admission(limits)
        tokenizer = load_tokenizer(cfg.tokenizer, cfg.chat_template, int(cfg.tokenize_cache_mb * (1 << 20)))
        self.encoder = PromptEncoder(tokenizer, cfg.tokenize_inline_chars) if tokenizer is not None else None
        # One policy per worker role: unified workers use the main policy; in PD mode the
        # prefill side defaults to it (prefix hits live on prefill) and decode to least load.
        # ``policy_options`` serve the main and the prefill policy: where those differ, each
        # takes the options it declares, and an option neither declares is an error.
        shared = cfg.pd_disaggregation and cfg.prefill_policy not in (None, cfg.policy)
        load = options_for(cfg.policy_options, [cfg.policy, cfg.prefill_policy]) if shared else load_policy
        self.policy = load(cfg.policy, **cfg.policy_options)
        self.policies: dict[str, Policy] = {"unified": self.policy}
        if cfg.pd_disaggregation:
            self.policies["prefill"], self.policies["decode"] = pd_policies(cfg, self.policy, load)
        self.needs_prompt = any(p.needs_prompt for p in self.policies.values())
        # ids that clients send, kept to decode only what a next turn adds (wire.prefix_ids)
        self.recent_ids = RecentIds(int(cfg.ids_cache_mb * (1 << 20))) \
            if self.needs_prompt and cfg.ids_cache_mb > 0 else None
        sources = [s.stats for s in (self.encoder, self.recent_ids) if s is not None]
        if sources:
            self.metrics.tokenizer_stats = lambda: {k: v for f in sources for k, v in f().items()}
        self.drain = Drain(OPEN_PATHS)
        self.limiter = RateLimiter(cfg.rate_limit_rps, cfg.rate_limit_burst or cfg.rate_limit_rps) \
            if cfg.rate_limit_rps > 0 else None
        self.tls = TlsContexts(cfg)  # certificate files load here: a bad one stops the start
        self.gate = WorkerGate(WorkerUrlPolicy(cfg.worker_url_allow),
                               lambda stage, reason: self.metrics.worker_url_refused.labels(stage, reason).inc())
        self.posture = Posture.of(cfg, self.tls.worker_mode, self.gate.policy.describe())
        self.metrics.security_posture.info(self.posture.labels())
        self.admin_refused = self.posture.refuses_admin  # read per request: a plain attribute
        self.session = None  # created on startup, inside the running loop
        self._checks: dict[str, asyncio.Task] = {}  # tokenizer checks in flight, by worker url
        self.peers: Peers | None = None
        self.membership: SharedMembership | None = None  # with peers: admin changes to the fleet are the group's
        self.routing_peers: Local = ALONE
        self.discovery: Any = None  # gateway.discovery.PodDiscovery with --service-discovery
        self.registry: WorkerRegistry
        self.proxy: Proxy

    @property
    def draining(self) -> bool:
        return self.drain.draining

    def _scrape_gauges(self) -> None:
        for worker in self.registry.workers.values():
            self.metrics.in_flight.labels(worker.url).set(worker.view.in_flight)
        self.metrics.queue_depth.set(self.admission.queued)
        self.metrics.held_now.set(self.proxy.holds.held)
        if self.encoder is not None:
            self.metrics.tokenized_off_loop.set(self.encoder.offloaded)

    async def start(self) -> None:
        cfg = self.cfg
        self.metrics.add_local(ProcessCollector(asyncio.get_running_loop()))
        self.posture.announce()
        self.session = make_session(connect_timeout=cfg.connect_timeout_secs, read_timeout=cfg.request_timeout_secs,
                                    limit_per_host=cfg.max_connections_per_worker, gate=self.gate,
                                    ssl_context=self.tls.worker)
        self.registry = WorkerRegistry(cfg, self.session)
        self.registry.vet = self.gate.vet  # runtime adds; the configuration's own are added as given
        peers: Local = ALONE
        if cfg.state_url:  # one of a group: share routing records on the bus
            self.peers = Peers(cfg.state_url, cfg.state_subject, self.policies, self.registry.workers,
                               cfg.state_heartbeat_secs, tls=state_bus_context(cfg), claims=cfg.state_claims,
                               claims_max_rps=cfg.state_claims_max_rps)
            if any(p.shares_routing for p in self.policies.values()):
                peers = self.peers
            self.metrics.watch_peers(self.peers)
            if self.limiter is not None:
                self.limiter.on_spent, self.peers.charge = self.peers.spent, self.limiter.charge
            budgets = self.qos.budgets if self.qos is not None else None
            if budgets is not None:  # a tenant's budget is the group's
                budgets.on_used, self.peers.use = self.peers.used, budgets.charge
        self.routing_peers = peers  # who hears each routed request's life (ALONE: nobody)
        unique = list({id(p): p for p in self.policies.values()}.values())
        self.registry.poll_load = any(p.needs_engine_load for p in unique)
        self.registry.listeners.append(self._on_worker_event)
        pairs: Callable[[Callable[[], None]], Pairs] | None = None
        if cfg.pd_disaggregation:  # each attempt is a prefill/decode pair, not one worker
            def pairs(freed: Callable[[], None]) -> Pairs:
                return Pairs(self.registry, self.policy, self.session, self.metrics, freed,
                             prefill_policy=self.policies["prefill"], decode_policy=self.policies["decode"],
                             peers=peers)
        migration = None
        if cfg.migration_limit > 0:
            tokenizer = self.encoder.tokenizer if self.encoder is not None else None
            migration = Migration(cfg.migration_limit, self.metrics, (lambda text: tokenizer.encode(
                text, add_special_tokens=False)) if tokenizer is not None else None, self.registry, self.session)
            self.registry.listeners.append(migration.on_worker_event)
        self.proxy = Proxy(self.registry, self.policy, self.session, self.metrics, cfg.max_retries,
                           cfg.max_hold_secs, cfg.hold_wake, target=pairs, peers=peers,
                           holds=self.qos.hold_room(cfg) if self.qos is not None else None, migration=migration)
        if self.qos is not None:
            self.qos.watch(self.proxy.holds, self.policies.get("prefill", self.policy),
                           lambda model: self.registry.candidates(model, role="prefill" if cfg.pd_disaggregation
                                                                  else "unified"))
        for role, policy in self.policies.items():
            self.metrics.policy_sources.append((f"{role}:{policy.name}", policy.stats))
        for policy in unique:
            await policy.start()
        await asyncio.gather(*(self.registry.add(spec, configured=True) for spec in cfg.workers))
        self.registry.start()
        self.metrics.before_scrape = self._scrape_gauges
        if self.metrics.group is not None:
            self.metrics.group.start(self._scrape_gauges)
        if cfg.service_discovery:
            self.discovery = _discovery(cfg, self.registry, self.metrics)
            await self.discovery.start()
        if self.peers is not None:  # after the workers: a peer's records name them
            self.peers.freed = self.proxy.attempts.freed
            self.membership = self.peers.membership = SharedMembership(self.registry, self.peers.bus.publish,
                                                                       self.peers.origin)
            await self.peers.start()

    async def stop(self) -> None:
        if self.metrics.group is not None:
            self.metrics.group.stop()
        if self.peers is not None:
            await self.peers.stop()
        if self.membership is not None:
            await self.membership.stop()
        for task in list(self._checks.values()):
            task.cancel()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.registry.stop()
        for policy in {id(p): p for p in self.policies.values()}.values():
            await policy.stop()
        if self.session is not None:
            await self.session.close()
        if self.encoder is not None:
            self.encoder.close()

    def _on_worker_event(self, event: str, worker: Any) -> None:
        self.metrics.healthy.labels(worker.url, worker.view.role).set(1 if worker.view.healthy else 0)
        if (self.encoder is not None and event in ("added", "health") and worker.view.healthy
                and worker.tokenizer_match is None and worker.url not in self._checks):
            task = asyncio.get_running_loop().create_task(self._check_tokenizer(worker))
            self._checks[worker.url] = task
            task.add_done_callback(lambda _t, url=worker.url: self._checks.pop(url, None))
        if event == "removed":
            for kind in (worker.tokenizer_match or {}):
                self.metrics.tokenizer_match.remove(worker.url, kind)
        policy = self.policies.get(worker.view.role)
        if policy is None:
            return
        if event == "added":
            policy.on_worker_added(worker.view)
        elif event == "updated":
            policy.on_worker_updated(worker.view)
        elif event == "removed":
            policy.on_worker_removed(worker.view)
            self.metrics.healthy.remove(worker.url, worker.view.role)

    async def _check_tokenizer(self, worker: Any) -> None:
        """Ask a worker that just became healthy how it tokenizes the probes (``gateway.tokenizer_check``)."""
        found = await tokenizer_check.check(self.session, worker.url, worker.auth_headers(), self.encoder.tokenizer,
                                            aiohttp.ClientTimeout(total=self.cfg.health_check_timeout_secs))
        worker.tokenizer_match = found
        if worker.url in self.registry.workers:
            for kind, same in found.items():
                self.metrics.tokenizer_match.labels(worker.url, kind).set(1 if same else 0)


def _qos(cfg: GatewayConfig, metrics: GatewayMetrics) -> Any:
    """Imported here: a gateway without a tenants file loads none of it."""
    if cfg.qos is None:
        return None
    from gateway.qos import Qos

    return Qos(cfg.qos, cfg.tenant_header, metrics)


def _discovery(cfg: GatewayConfig, registry: WorkerRegistry, metrics: GatewayMetrics) -> Any:
    """Imported here: the Kubernetes client is an optional extra, loaded only when asked for."""
    try:
        from gateway.discovery import PodDiscovery
    except ImportError as exc:
        raise RuntimeError(f"--service-discovery needs the Kubernetes client: pip install 'kvgate[k8s]' ({exc})") \
            from None
    return PodDiscovery(cfg, registry, metrics)
