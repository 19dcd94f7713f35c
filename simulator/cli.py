"""``kvgate sim``: run a fleet of simulated SGLang workers until Ctrl-C / SIGTERM.

Options not listed here pass through to every worker (``python -m simulator serve``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .cluster import SimCluster


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate sim", description="Run simulated SGLang workers",
                                epilog="Other options are passed to every worker (see python -m simulator serve -h).")
    p.add_argument("--workers", type=int, default=None, help="unified workers (default 2 unless PD is asked)")
    p.add_argument("--prefill", type=int, default=0)
    p.add_argument("--decode", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--base-port", type=int, default=None)
    p.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True,
                   help="give every worker a ZMQ KV-event publisher (default on)")
    p.add_argument("--startup-timeout", type=float, default=30.0)
    p.add_argument("--log-dir", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args, engine_args = build_parser().parse_known_args(argv)
    if args.prefill or args.decode:
        if not (args.prefill and args.decode):
            print("kvgate sim: PD needs both --prefill and --decode", file=sys.stderr)
            return 2
    workers = args.workers if args.workers is not None else (0 if args.prefill else 2)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = SimCluster(workers=workers, prefill=args.prefill, decode=args.decode, host=args.host,
                         base_port=args.base_port, engine_args=engine_args, startup_timeout=args.startup_timeout,
                         kv_events=args.kv_events, log_dir=args.log_dir)
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as e:
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 1
    try:
        for url in cluster.urls:
            print(f"worker  {url}" + (f"  kv-events {cluster.kv_event_endpoints[url]}" if url in cluster.kv_event_endpoints else ""))
        for url, bport in cluster.prefill:
            print(f"prefill {url}  bootstrap-port {bport}")
        for url in cluster.decode:
            print(f"decode  {url}")
        print(f"logs in {cluster.log_dir}; Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            dead = cluster.dead()
            if dead:
                for url, rc in dead:
                    print(f"kvgate sim: worker {url} exited with {rc}", file=sys.stderr)
                return 1
        return 0
    finally:
        cluster.stop()
