"""``kvgate``: one command for the gateway, the simulator and both together.

- ``kvgate serve``: the gateway in front of ``--worker-urls`` (sglang-router's flags).
- ``kvgate sim``: simulated SGLang workers as real processes.
- ``kvgate up``: simulated workers plus the gateway in front of them (the default demo).
- ``kvgate policies``: list the routing policies this install can load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from gateway import log_setup
from gateway.config import GatewayConfig, WorkerSpec, discovery_problem, load_yaml, process_count, workers_from_mapping
from gateway.router_flags import add_router_args, apply_router_args
from wire.options import OptionError

log = logging.getLogger("kvgate")


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    import yaml

    return key.strip().replace("-", "_"), yaml.safe_load(value)


def _processes(text: str) -> int:
    try:
        return process_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_gateway_args(p: argparse.ArgumentParser, *, with_workers: bool = True) -> None:
    g = p.add_argument_group("gateway")
    g.add_argument("--config", help="YAML file with any of the options below (flags override it)")
    g.add_argument("--host")
    g.add_argument("--port", type=int)
    if with_workers:
        g.add_argument("--worker-urls", nargs="*", default=None, metavar="URL")
    g.add_argument("--policy", help="built-in name, entry point in 'kvgate.policies', or module:Class")
    g.add_argument("--pd-disaggregation", action="store_true", default=None,
                   help="pair prefill and decode workers (sglang-router's PD mode)")
    g.add_argument("--prefill", action="append", nargs="+", metavar=("URL", "BOOTSTRAP_PORT"),
                   help="prefill worker URL and optional bootstrap port or 'none' (repeatable)")
    g.add_argument("--decode", action="append", nargs=1, metavar="URL", help="decode worker URL (repeatable)")
    g.add_argument("--prefill-policy", help="policy for the prefill leg (default: --policy)")
    g.add_argument("--decode-policy", help="policy for the decode leg (default: least_load)")
    g.add_argument("--policy-option", action="append", type=_option, default=[], metavar="KEY=VALUE",
                   help="option passed to the policy's constructor (repeatable)")
    g.add_argument("--api-key", action="append", default=None, help="client API key (repeatable)")
    g.add_argument("--api-key-file", help="file with one client API key per line")
    g.add_argument("--admin-api-key", action="append", default=None, help="key for admin routes (defaults to --api-key)")
    g.add_argument("--worker-api-key", help="Bearer key sent to workers")
    g.add_argument("--max-concurrent-requests", type=int)
    g.add_argument("--queue-size", type=int)
    g.add_argument("--queue-timeout-secs", type=float)
    g.add_argument("--max-hold-secs", type=float,
                   help="longest a policy may hold a request until a worker can start it (late binding); 0: never")
    g.add_argument("--hold-wake", type=int,
                   help="held requests (least recently decided first) decided again at each first token or "
                        "completion, plus one per request that then goes (default 16); 0: every held request")
    g.add_argument("--rate-limit-rps", type=float, help="requests/s per API key (client IP without auth)")
    g.add_argument("--rate-limit-burst", type=float, help="bucket size for --rate-limit-rps (default: one second's)")
    g.add_argument("--tenants-file", help="YAML file of tenants (keys, weights, priority classes, token and "
                                          "request budgets): turns on multi-tenant QoS (docs/qos.md)")
    g.add_argument("--tenant-header", metavar="NAME",
                   help="request header that names the tenant (from the tenants file) when the API key names none")
    g.add_argument("--request-timeout-secs", type=float, help="upstream silence (no byte) that fails an attempt")
    g.add_argument("--max-payload-size", type=int)
    g.add_argument("--max-retries", "--retry-max-retries", type=int)
    g.add_argument("--migration-limit", type=int,
                   help="times a stream whose worker fails after its first byte is continued on another worker, "
                        "the client seeing one answer (default 2; 0: it ends with an error event; docs/migration.md)")
    g.add_argument("--health-check-interval-secs", type=float)
    g.add_argument("--health-check-timeout-secs", type=float)
    g.add_argument("--health-failure-threshold", type=int)
    g.add_argument("--health-success-threshold", type=int)
    g.add_argument("--cb-failure-threshold", type=int)
    g.add_argument("--cb-timeout-secs", "--cb-timeout-duration-secs", type=float)
    g.add_argument("--load-poll-interval-secs", type=float)
    g.add_argument("--tokenizer", "--tokenizer-path", "--model-path", dest="tokenizer",
                   help="for precise routing: 'byte' (the simulator's), or the model's directory (tokenizer.json + "
                        "tokenizer_config.json with its chat template) or tokenizer.json")
    g.add_argument("--chat-template", help="a .jinja chat template overriding the model's, as given to SGLang's "
                                           "--chat-template")
    g.add_argument("--tokenize-inline-chars", type=int,
                   help="prompts longer than this are tokenized on a thread pool, off the event loop (default 2048)")
    g.add_argument("--tokenize-cache-mb", type=float,
                   help="memory for the ids of recent prompts, so a prompt that extends one (a chat's next turn) is "
                        "encoded only past the last special token they share (default 64; 0: off)")
    g.add_argument("--ids-cache-mb", type=float,
                   help="memory for the token-id lists clients send (/generate input_ids, a completion's prompt "
                        "ids), so a list that extends a recent one (an RL rollout's next turn) is decoded only past "
                        "it (default 64; 0: off)")
    g.add_argument("--state-url", help="nats://HOST:PORT of the bus the gateway processes and replicas of one "
                                       "group share routing state on (default: none, this process routes alone)")
    g.add_argument("--state-subject", help="NATS subject of the group (default kvgate.routing)")
    g.add_argument("--state-heartbeat-secs", type=float,
                   help="how often each process says what it has in flight; a peer silent for three is gone")
    g.add_argument("--state-claims", action=argparse.BooleanOptionalAction, default=None,
                   help="claim each routed request's worker on the bus's JetStream first, so that processes "
                        "deciding at once do not herd onto one worker (default on; docs/shared-state.md)")
    g.add_argument("--state-claims-max-rps", type=float, metavar="N",
                   help="a process routing more requests a second than this decides without claims, which "
                        "cost ~0.35 ms of CPU each (default 100; 0: claim every decision)")
    g.add_argument("--shutdown-grace-secs", "--shutdown-grace-period-secs", type=float)
    g.add_argument("--processes", type=_processes, metavar="N|auto",
                   help="event-loop processes serving the one port (default 1; auto: one per usable CPU); "
                        "SIGHUP reloads them one at a time (docs/processes.md)")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   type=lambda v: "warning" if v == "warn" else v)  # "warn": sglang-router's
    s = p.add_argument_group("control-plane security (docs/security.md)")
    s.add_argument("--allow-open-admin", action="store_true", default=None,
                   help="serve the admin routes without a key on a bind that is not loopback (refused by default)")
    s.add_argument("--protect-metrics", action="store_true", default=None,
                   help="/metrics answers only with an admin key (default: open to scrapers)")
    s.add_argument("--worker-url-allow", action="append", metavar="CIDR|HOST",
                   help="networks and host names ('*.suffix' for every name under it) that workers added at "
                        "runtime may be at (repeatable); link-local and metadata addresses need an entry inside them")
    s.add_argument("--tls-cert-file", "--tls-cert-path", help="serve HTTPS with this PEM chain (SIGHUP reloads it)")
    s.add_argument("--tls-key-file", "--tls-key-path", help="its private key (default: in --tls-cert-file)")
    s.add_argument("--worker-ca-file", help="CA bundle that https workers' certificates are verified against")
    s.add_argument("--worker-client-cert-file", "--client-cert-path",
                   help="client certificate shown to workers that require one (mTLS)")
    s.add_argument("--worker-client-key-file", "--client-key-path", help="its key (default: in the certificate file)")
    s.add_argument("--state-tls-ca-file", help="CA bundle the state bus's certificate is verified against "
                                               "(a tls:// --state-url; default: the system's)")
    s.add_argument("--state-tls-cert-file", help="client certificate shown to a state bus that verifies clients")
    s.add_argument("--state-tls-key-file", help="its private key (default: in --state-tls-cert-file)")
    k = p.add_argument_group("service discovery (Kubernetes; needs the 'k8s' extra)")
    k.add_argument("--service-discovery", action="store_true", default=None,
                   help="add and remove workers as pods matching the selectors become ready and go away")
    k.add_argument("--selector", nargs="+", metavar="KEY=VALUE", help="labels of the worker pods")
    k.add_argument("--prefill-selector", nargs="+", metavar="KEY=VALUE", help="labels of prefill pods (PD mode)")
    k.add_argument("--decode-selector", nargs="+", metavar="KEY=VALUE", help="labels of decode pods (PD mode)")
    k.add_argument("--service-discovery-port", type=int, help="the workers' HTTP port (default 80)")
    k.add_argument("--service-discovery-port-name", metavar="NAME",
                   help="take each pod's port from its container port of this name (else --service-discovery-port)")
    k.add_argument("--service-discovery-namespace", help="namespace to watch (default: all, which needs a ClusterRole)")
    k.add_argument("--bootstrap-port-annotation", metavar="KEY",
                   help="pod annotation with a prefill worker's bootstrap port (default sglang.ai/bootstrap-port)")
    add_router_args(p)


def config_from_args(args: argparse.Namespace, extra_workers: list[WorkerSpec] | None = None) -> GatewayConfig:
    data: dict[str, Any] = load_yaml(args.config) if getattr(args, "config", None) else {}
    workers = workers_from_mapping(data)
    known = {f.name for f in fields(GatewayConfig)}
    for name in known:
        value = getattr(args, name, None)
        if value is not None and name not in ("policy_options", "api_keys", "admin_api_keys", "workers", "qos"):
            data[name] = value
    data["policy_options"] = {**data.get("policy_options", {}), **dict(args.policy_option)}
    keys = list(data.get("api_keys", [])) + list(args.api_key or [])
    if args.api_key_file:
        keys += [k.strip() for k in Path(args.api_key_file).read_text().splitlines() if k.strip()]
    data["api_keys"] = keys
    data["admin_api_keys"] = list(data.get("admin_api_keys", [])) + list(args.admin_api_key or [])
    workers += [WorkerSpec(url=u) for u in (getattr(args, "worker_urls", None) or [])]
    for item in getattr(args, "prefill", None) or []:
        if len(item) > 2:
            raise SystemExit(f"--prefill takes URL [BOOTSTRAP_PORT], got {item}")
        port = item[1] if len(item) == 2 else None
        workers.append(WorkerSpec(url=item[0], role="prefill",
                                  bootstrap_port=None if port in (None, "none") else int(port)))
    workers += [WorkerSpec(url=item[0], role="decode") for item in getattr(args, "decode", None) or []]
    workers += extra_workers or []
    data["workers"] = workers
    apply_router_args(args, data)
    try:
        cfg = GatewayConfig(**data)
    except ValueError as exc:  # a selector, allowlist entry, TLS option or tenants file that does not parse
        raise SystemExit(f"kvgate: error: {exc}") from None
    problem = discovery_problem(cfg)
    if problem:
        raise SystemExit(f"kvgate: error: {problem}")
    return cfg


def _install_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # uvloop is optional off Linux/macOS
        pass


async def serve_async(cfg: GatewayConfig, ready: asyncio.Event | None = None) -> None:
    from aiohttp import web

    from gateway import group, metrics_port
    from gateway.app import STATE, build_app

    app = build_app(cfg)
    # The grace period is spent in Drain (still listening, answering 503); what is left
    # after that is cancelled by the runner at once.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    member = group.in_group()
    tls = app[STATE].tls
    site = group.site(runner, cfg.host, cfg.port, 4096, tls.server) if member else \
        web.TCPSite(runner, cfg.host, cfg.port, backlog=4096, ssl_context=tls.server)
    await site.start()
    scrape = await metrics_port.start(app, cfg, member)  # --prometheus-port, if given
    options = "".join(f" {k}={v}" for k, v in sorted(cfg.policy_options.items()))
    log.info("kvgate listening on %s://%s:%d (policy=%s%s, workers=%d)", "https" if tls.server else "http", cfg.host,
             cfg.port, cfg.policy, options, len(cfg.workers))
    stop = asyncio.Event()
    retiring: list[bool] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if member:  # the supervisor's SIGHUP replaces the members, which load the certificates anew
        group.on_signals(loop, lambda: (retiring.append(True), stop.set()))
        orphaned = loop.create_task(group.until_orphaned(os.getppid()))
        orphaned.add_done_callback(lambda _t: stop.set())
        group.notify_ready()
    elif tls.server or tls.worker:  # else SIGHUP keeps its default (it ends the process)
        loop.add_signal_handler(signal.SIGHUP, tls.reload)  # new certificates, same listener
    if ready is not None:
        ready.set()
    await stop.wait()
    drain = app[STATE].drain
    if retiring:  # another member takes this one's place: the group's port keeps accepting
        await group.stop_accepting(runner, site, drain)
    log.info("shutting down: finishing %d in-flight requests (grace %gs)", drain.in_flight, cfg.shutdown_grace_secs)
    if not await drain.drain(cfg.shutdown_grace_secs):
        log.warning("grace period over with %d requests in flight: cancelling them", drain.in_flight)
    await runner.cleanup()
    if scrape is not None:
        await scrape.cleanup()
    log.info("shut down")


def serve(cfg: GatewayConfig, reload: Callable[[], GatewayConfig] | None = None) -> int:
    """Run the gateway until SIGTERM/SIGINT: in this process, or as a supervised group of
    ``cfg.processes`` (``reload`` gives the configuration a SIGHUP rolls out)."""
    log_setup.configure(cfg.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s", cfg.log_dir)
    if cfg.processes > 1:
        from gateway.processes import supervise

        return supervise(cfg, reload or (lambda: cfg))
    _install_uvloop()
    asyncio.run(serve_async(cfg))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    return serve(config_from_args(args), reload=lambda: config_from_args(args))


@contextlib.contextmanager
def _reserved(cfg: GatewayConfig) -> Iterator[None]:
    """Hold the gateway's port while the simulated workers pick theirs (the kernel never
    hands out a bound port), so none of them takes it before the gateway binds."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.port))
    except OSError:  # taken already, or a host this cannot bind: serve() will say so
        pass
    try:
        yield
    finally:
        sock.close()


def cmd_up(args: argparse.Namespace) -> int:
    from simulator.cluster import SimCluster

    engine_args = list(args.engine_arg or [])
    if args.profile:
        engine_args += ["--profile", args.profile]
    if args.time_scale:
        engine_args += ["--time-scale", str(args.time_scale)]
    if args.tokenizer and args.tokenizer != "byte":  # the simulated engines tokenize as that model would
        engine_args += ["--tokenizer", args.tokenizer]
        if args.chat_template:
            engine_args += ["--chat-template", args.chat_template]
    if args.pd:
        cluster = SimCluster(workers=0, prefill=args.prefill_workers, decode=args.decode_workers,
                             engine_args=engine_args, kv_events=args.kv_events, pool=args.pool)
    else:
        cluster = SimCluster(workers=args.workers, engine_args=engine_args, kv_events=args.kv_events, pool=args.pool)
    with _reserved(config_from_args(args)):  # the workers pick free ports: not the gateway's
        cluster.start()
    try:
        specs = [WorkerSpec(url=u) for u in cluster.urls]
        specs += [WorkerSpec(url=u, role="prefill", bootstrap_port=port) for u, port in cluster.prefill]
        specs += [WorkerSpec(url=u, role="decode") for u in cluster.decode]

        def build() -> GatewayConfig:
            cfg = config_from_args(args, extra_workers=specs)
            if args.pd:
                cfg.pd_disaggregation = True
            if args.kv_events and cfg.tokenizer is None:
                cfg.tokenizer = "byte"  # the simulator's tokenizer: precise routing needs the engine's ids
            return cfg

        cfg = build()
        for spec in specs:
            print(f"kvgate up: {spec.role:8s} {spec.url}" + (f" bootstrap {spec.bootstrap_port}" if spec.bootstrap_port else ""),
                  flush=True)
        print(f"kvgate up: gateway on http://{cfg.host}:{cfg.port} policy={cfg.policy} "
              f"(try: curl http://{cfg.host}:{cfg.port}/v1/models)", flush=True)
        return serve(cfg, reload=build)
    finally:
        cluster.stop()


def cmd_sim(argv: list[str]) -> int:
    from simulator.cli import main as sim_main

    return sim_main(argv)


def cmd_policies(args: argparse.Namespace) -> int:
    from policies.loader import available_policies, load_policy_class
    from wire.options import describe

    if args.name:
        cls = load_policy_class(args.name)
        rows = describe(cls.Options)
        if cls.Options is None:
            print(f"{args.name}: options are passed to the policy as given (it declares none)")
        elif not rows:
            print(f"{args.name}: no options")
        for name, default, doc in rows:
            print(f"{name:24s} {default:>12s}  {doc}")
        return 0
    for name, target in sorted(available_policies().items()):
        print(f"{name:20s} {target}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run the gateway in front of existing workers")
    add_gateway_args(p_serve)
    p_serve.set_defaults(func=cmd_serve)
    p_up = sub.add_parser("up", help="start simulated workers and the gateway in front of them")
    add_gateway_args(p_up)
    p_up.add_argument("--workers", type=int, default=4, help="simulated workers to start")
    p_up.add_argument("--profile", help="simulator timing profile")
    p_up.add_argument("--time-scale", type=float, help="simulator time compression factor")
    p_up.add_argument("--engine-arg", action="append", help="extra argument for each simulated worker (repeatable)")
    p_up.add_argument("--pd", action="store_true", help="prefill/decode disaggregation over Mooncake")
    p_up.add_argument("--prefill-workers", type=int, default=2)
    p_up.add_argument("--decode-workers", type=int, default=2)
    p_up.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True,
                      help="workers publish KV events and the gateway tokenizes like them, so cache-aware "
                           "policies use the precise index (default on)")
    p_up.add_argument("--pool", action="store_true",
                      help="start a mooncake_master and give the workers a shared HiCache L3 pool (Mooncake Store)")
    p_up.set_defaults(func=cmd_up)
    sub.add_parser("sim", help="start simulated SGLang workers (see 'kvgate sim --help')", add_help=False)
    p_pol = sub.add_parser("policies", help="list routing policies, or one policy's options")
    p_pol.add_argument("name", nargs="?", help="print this policy's options (--policy-option key=value)")
    p_pol.set_defaults(func=cmd_policies)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        return cmd_sim(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except OptionError as exc:  # a policy option the policy does not take, or cannot parse
        print(f"kvgate: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that left (`kvgate policies cost | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
