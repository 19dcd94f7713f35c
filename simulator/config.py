"""Command-line options of one simulated worker (``python -m simulator serve``).

Option names follow SGLang's ``launch_server`` where SGLang has one, so launch scripts
written for SGLang mostly run unchanged against the simulator.
"""

from __future__ import annotations

import argparse
import json
import os

from .profiles import DEFAULT_PROFILE, PROFILES

DEFAULT_VERSION = "0.5.23"


def version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulator serve", description="SGLang-compatible engine simulator")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model-name", "--served-model-name", dest="model_name", default="sim-llama-8b")
    p.add_argument("--model-path", default=None, help="reported as model_path (default: the profile's)")
    p.add_argument("--tokenizer", "--tokenizer-path", dest="tokenizer", default=None,
                   help="a model directory (tokenizer.json + tokenizer_config.json) or tokenizer.json to tokenize "
                        "and apply chat templates with, as SGLang does with the model's (default: one token per byte)")
    p.add_argument("--chat-template", default=None, help="a .jinja chat template overriding the model's")
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated seconds per wall second")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool tokens (default: profile)")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed chunk (SGLang's option)")
    p.add_argument("--sglang-version", default=DEFAULT_VERSION)
    p.add_argument("--dp-size", type=int, default=1,
                   help="independent DP ranks in this process (own pool, cache, scheduler, KV publisher)")
    p.add_argument("--tp-size", type=int, default=None)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"])
    p.add_argument("--enable-priority-scheduling", action="store_true")
    p.add_argument("--schedule-low-priority-values-first", action="store_true")
    p.add_argument("--enable-cache-report", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-metrics", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--log-requests", action="store_true", help="one log line per finished request")
    # TLS: SGLang's flag names; --ssl-cert-reqs is uvicorn's (SGLang leaves it at 0: client
    # certificates are never required there), here so that tests can run mTLS against a worker.
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate (chain)")
    p.add_argument("--ssl-keyfile", default=None, help="its private key (default: in --ssl-certfile)")
    p.add_argument("--ssl-keyfile-password", default=None)
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates that client certificates are verified against")
    p.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="simulator only (uvicorn's option): client certificate 0 not asked, 1 optional, 2 required")
    p.add_argument("--is-embedding", action="store_true",
                   help="an embedding model: serves embeddings, encode, classify, rerank and score; refuses generation")
    p.add_argument("--embedding-dim", type=int, default=64, help="simulator only: length of an embedding vector")
    p.add_argument("--enable-response-store", action="store_true",
                   help="keep Responses for retrieval, previous_response_id, cancel and background (SGLang's option)")
    p.add_argument("--response-store-size", type=int, default=10_000,
                   help="simulator only: stored Responses kept, the least recently used dropped first")
    # HiCache
    p.add_argument("--enable-hierarchical-cache", action="store_true")
    p.add_argument("--hicache-ratio", type=float, default=None, help="host pool = ratio x device pool")
    p.add_argument("--hicache-size", type=float, default=None, help="host pool in GB (uses KV bytes/token)")
    p.add_argument("--hicache-write-policy", default="write_through", choices=["write_through", "write_back"])
    p.add_argument("--hicache-storage-backend", default=None, choices=["mooncake"],
                   help="HiCache L3: a real Mooncake Store shared by the workers (implies hierarchical cache)")
    p.add_argument("--hicache-storage-backend-extra-config", default=None,
                   help="JSON: master_server_address, metadata_server, global_segment_size, protocol, "
                        "device_name[, prefetch_timeout_base, prefetch_timeout_per_ki_token]; "
                        "MOONCAKE_* env vars fill what it leaves out")
    p.add_argument("--hicache-storage-prefetch-policy", default="best_effort",
                   choices=["best_effort", "wait_complete", "timeout"])
    p.add_argument("--storage-speedup", type=float, default=None,
                   help="simulator only: pool loads take the measured get time scaled to the profile's KV "
                        "bytes, divided by this (default: calibrated at start to --storage-bandwidth-gbps)")
    p.add_argument("--storage-bandwidth-gbps", type=float, default=5.0,
                   help="simulator only: what an uncontended pool load should run at (RDMA Mooncake pool)")
    p.add_argument("--storage-timing", default="measured", choices=["measured", "link"],
                   help="simulator only: charge a pool load its measured get time scaled to the model's bytes "
                        "(measured: real contention here costs more), or the model's bytes over "
                        "--storage-bandwidth-gbps (link: independent of this machine's load)")
    # KV events
    p.add_argument("--kv-events-port", type=int, default=None, help="shortcut for a zmq publisher on this port")
    p.add_argument("--kv-events-config", default=None, help="SGLang's JSON kv-events config")
    # PD
    p.add_argument("--disaggregation-mode", default="null", choices=["null", "prefill", "decode"])
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--disaggregation-transfer-backend", default="mooncake")
    p.add_argument("--disaggregation-ib-device", default=None)
    p.add_argument("--kv-bytes-per-token", type=int, default=4096,
                   help="bytes really moved per prompt token in PD (small so tests are fast)")
    p.add_argument("--kv-pool-mb", type=int, default=64, help="registered transfer buffer per worker")
    p.add_argument("--transfer-bandwidth-gbps", type=float, default=25.0,
                   help="simulator only: the link a PD transfer is charged at (GB/s, one 200 Gb/s RDMA NIC per "
                        "prefill): prompt tokens x the profile's KV bytes/token over this, in simulated time")
    p.add_argument("--disaggregation-waiting-timeout", type=float,
                   default=float(os.environ.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)))
    p.add_argument("--disaggregation-bootstrap-timeout", type=float,
                   default=float(os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)))
    # faults
    p.add_argument("--fault-latency-ms", type=float, default=0.0, help="extra wall latency before answering")
    p.add_argument("--fault-fail-rate", type=float, default=0.0, help="fraction of requests answered 500")
    p.add_argument("--fault-crash-after", type=int, default=0,
                   help="exit hard (os._exit) when generation request N+1 arrives; in-flight streams break")
    p.add_argument("--fault-health-flap-secs", type=float, default=0.0, help="/health alternates 200/503")
    p.add_argument("--fault-transfer-fail-rate", type=float, default=0.0)
    p.add_argument("--fault-hang-rate", type=float, default=0.0, help="accept and never answer")
    p.add_argument("--fault-mid-stream", default=None, choices=["crash", "error", "hang"],
                   help="what a stream meets once it has sent --fault-mid-stream-after tokens: the process exits "
                        "hard (os._exit, every stream breaks), an error event then [DONE], or silence")
    p.add_argument("--fault-mid-stream-after", type=int, default=8,
                   help="tokens a stream sends before --fault-mid-stream acts")
    p.add_argument("--fault-garbage-rate", type=float, default=0.0,
                   help="fraction of generation requests answered 200 with bytes that are not JSON")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.ssl_keyfile or args.ssl_ca_certs or args.ssl_cert_reqs) and not args.ssl_certfile:
        parser.error("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        parser.error("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to verify client certificates with")
    args.kv_events = kv_events_config(args)
    return args


def kv_events_config(args: argparse.Namespace) -> dict | None:
    """SGLang's kv-events-config dict, from either flag; the replay socket sits next door."""
    if args.kv_events_config:
        cfg = json.loads(args.kv_events_config)
        cfg.setdefault("publisher", "zmq")
        cfg.setdefault("topic", "kv")
        return cfg
    if args.kv_events_port:
        port = args.kv_events_port
        return {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv",
                "replay_endpoint": f"tcp://*:{port + 1}"}
    return None
