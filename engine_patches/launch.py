"""Start one real SGLang server configured the way the kvgate gateway expects.

    python -m engine_patches.launch --role prefill --model /models/qwen --port 30000 \\
        --transport rdma --ib-device mlx5_0 --kv-events-port 5557 \\
        --hicache --mooncake-master mooncake-master:50051 \\
        --mooncake-metadata http://mooncake-master:8080/metadata -- --tp-size 2

Every knob the gateway relies on is switched on in one place, so a deployment cannot
forget one: metrics and cache reports (load and hit-rate signals), KV events on ZMQ
(the precise prefix index), PD disaggregation over Mooncake, and HiCache with the
Mooncake Store as L3. ``build_command`` is pure so tests can check the result against
SGLang's own argument parser; ``main`` only prints it (``--dry-run``) or execs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from engine_patches.versions import DEFAULT_SGLANG, Version, fmt, installed_sglang, parse_version

ROLES = ("prefill", "decode", "unified")
REPO_ROOT = Path(__file__).resolve().parent.parent
STANDINS = Path(__file__).resolve().parent / "standins"
CPU_KV_TOKENS = 4096

# The patched entrypoint re-imports itself in SGLang's spawned scheduler processes,
# which is how the L3 event patch reaches the process that owns the KV publisher.
PATCHED_ENTRY = "engine_patches.run_server"
PLAIN_ENTRY = "sglang.launch_server"

# Version knobs. Release numbers are estimated from the merge dates of the SGLang PRs:
# the Mooncake store reads --hicache-storage-backend-extra-config since PR #10213 (Sept
# 2025, ~0.5.3); a decode engine's offload manager passed it on as a string (crash) until
# PR #16808 (Jan 2026, ~0.5.8). Older targets get MOONCAKE_* env only.
MOONCAKE_EXTRA_CONFIG_SINCE: Version = (0, 5, 3)
DECODE_EXTRA_CONFIG_SINCE: Version = (0, 5, 8)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine_patches.launch",
        description="Build (and exec) the SGLang command line for one kvgate engine; "
        "arguments after '--' go to SGLang unchanged.",
    )
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--model", help="model path or hub id (SGLang --model-path)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--page-size", type=int, help="KV page size; the gateway's prefix index uses the same")
    p.add_argument("--served-model-name")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: SGLang's CPU engine (torch only, no GPU kernels), with the stand-ins and "
                   "patches of engine_patches/cpu_engine.py; for small models and tests")
    p.add_argument("--max-total-tokens", type=int,
                   help="KV pool size in tokens (SGLang's flag; on cpu the default is 4096)")

    pd = p.add_argument_group("PD disaggregation (prefill/decode roles)")
    pd.add_argument("--bootstrap-port", type=int, default=8998)
    pd.add_argument("--transport", choices=("rdma", "tcp"), default="tcp",
                    help="Mooncake transfer protocol; tcp needs no NIC (default)")
    pd.add_argument("--ib-device", default="",
                    help="RDMA device(s), e.g. mlx5_0 or mlx5_0,mlx5_1; empty = Mooncake auto-detect")

    ev = p.add_argument_group("KV events (gateway precise index)")
    ev.add_argument("--kv-events-port", type=int, help="ZMQ PUB base port (one per DP rank: base + dp_rank)")
    ev.add_argument("--kv-events-replay-port", type=int,
                    help="ZMQ ROUTER replay base port (default: kv-events-port + 100)")
    ev.add_argument("--kv-events-topic", default="")
    ev.add_argument("--kv-events-host", default="*",
                    help="address the ZMQ sockets bind (default every interface; 127.0.0.1 for one host)")

    hc = p.add_argument_group("HiCache (host tier, Mooncake Store as L3 when a master is given)")
    hc.add_argument("--hicache", action="store_true")
    hc.add_argument("--hicache-ratio", type=float)
    hc.add_argument("--hicache-size", type=int, help="host pool in GB (overrides the ratio)")
    hc.add_argument("--hicache-write-policy", choices=("write_back", "write_through", "write_through_selective"))
    hc.add_argument("--prefetch-policy", choices=("best_effort", "wait_complete", "timeout"))
    hc.add_argument("--mooncake-master", help="host:port of mooncake_master (enables the L3 tier)")
    hc.add_argument("--mooncake-metadata", default="P2PHANDSHAKE",
                    help="metadata server URL (mooncake_master --enable_http_metadata_server) or P2PHANDSHAKE")
    hc.add_argument("--global-segment-size", default="4gb", help="memory this engine lends to the store")
    hc.add_argument("--local-hostname", help="address peers reach this engine at (MOONCAKE_LOCAL_HOSTNAME)")
    hc.add_argument("--mooncake-config", choices=("auto", "both", "env", "extra-config"), default="auto",
                    help="how Mooncake settings reach SGLang: MOONCAKE_* env vars (every 0.5.x), the "
                    "--hicache-storage-backend-extra-config JSON, or both; auto = both where the "
                    "target release reads the JSON for this role, else env")

    sc = p.add_argument_group("scheduling")
    sc.add_argument("--priority-scheduling", action="store_true",
                    help="order the engine's queue by each request's priority (SGLang's "
                    "--enable-priority-scheduling; larger first): the gateway's priority classes reach "
                    "the engine when its tenants file sets engine_priority")

    ops = p.add_argument_group("process")
    ops.add_argument("--sglang-version", help="target SGLang release (default: the installed one, else "
                     f"{fmt(DEFAULT_SGLANG)})")
    ops.add_argument("--python", default=sys.executable, help="interpreter that has sglang installed")
    ops.add_argument("--no-patches", action="store_true",
                     help="run sglang.launch_server directly, without kvgate's engine patches")
    ops.add_argument("--dry-run", action="store_true", help="print the environment and command, do not run")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments passed to SGLang as they are")
    return p


def _target_version(args: argparse.Namespace) -> Version:
    if args.sglang_version:
        return parse_version(args.sglang_version)
    return installed_sglang() or DEFAULT_SGLANG


def _extra(args: argparse.Namespace) -> list[str]:
    extra = list(args.extra or [])
    return extra[1:] if extra[:1] == ["--"] else extra


def _json(obj: Mapping[str, object]) -> str:
    return json.dumps(obj, separators=(",", ":"))


def kv_events_config(args: argparse.Namespace) -> str:
    replay = args.kv_events_replay_port or args.kv_events_port + 100
    config: dict[str, object] = {
        "publisher": "zmq",
        "endpoint": f"tcp://{args.kv_events_host}:{args.kv_events_port}",
        "topic": args.kv_events_topic,
        "replay_endpoint": f"tcp://{args.kv_events_host}:{replay}",
    }
    if args.kv_events_host != "*":  # SGLang binds a wildcard endpoint and connects to any other
        config["bind"] = True
    return _json(config)


def mooncake_settings(args: argparse.Namespace) -> dict[str, str]:
    """One source for both spellings SGLang reads: extra-config keys and MOONCAKE_* env."""
    return {
        "master_server_address": args.mooncake_master,
        "metadata_server": args.mooncake_metadata,
        "global_segment_size": args.global_segment_size,
        "protocol": args.transport,
        # Mooncake treats an empty device list as "discover"; with tcp it is ignored.
        "device_name": args.ib_device if args.transport == "rdma" else "",
    }


_ENV_NAMES = {
    "master_server_address": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
}


def _python_path(env: Mapping[str, str], standins: bool = False) -> str | None:
    """Make ``engine_patches`` importable in SGLang's children when kvgate runs from a checkout,
    and the CPU stand-ins with ``standins``."""
    if REPO_ROOT.name != "engine_patches" and (REPO_ROOT / "engine_patches").is_dir() and \
            (REPO_ROOT / "pyproject.toml").is_file():
        parts = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    else:  # pip-installed: site-packages already has engine_patches
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if standins:  # after everything else: a real sgl_kernel/triton/torchvision wins
        parts = [p for p in parts if p != str(STANDINS)] + [str(STANDINS)]
    return os.pathsep.join(dict.fromkeys(parts)) or None


def build_command(
    args: argparse.Namespace, base_env: Mapping[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Return ``(argv, env)`` for one engine; ``env`` holds only what this adds to ``base_env``."""
    base_env = os.environ if base_env is None else base_env
    version = _target_version(args)
    extra = _extra(args)
    if not args.model and "--model-path" not in extra and "--model" not in extra:
        raise SystemExit("launch: --model is required (or pass --model-path after --)")

    # The CPU engine always runs through the patched entry: its patches live there.
    entry = PLAIN_ENTRY if args.no_patches and args.device != "cpu" else PATCHED_ENTRY
    argv = [args.python, "-m", entry]
    if args.model:
        argv += ["--model-path", args.model]
    argv += ["--host", args.host, "--port", str(args.port)]
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    if args.page_size:
        argv += ["--page-size", str(args.page_size)]
    # Load and cache-hit signals the gateway's policies and metrics read.
    argv += ["--enable-metrics", "--enable-cache-report"]
    if args.priority_scheduling:
        argv.append("--enable-priority-scheduling")

    env: dict[str, str] = {}
    if args.device == "cpu":
        argv += cpu_flags(args)
        env.update(cpu_env(args))
    elif args.max_total_tokens:
        argv += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.role != "unified":
        argv += [
            "--disaggregation-mode", args.role,
            "--disaggregation-transfer-backend", "mooncake",
            "--disaggregation-bootstrap-port", str(args.bootstrap_port),
        ]
        if args.transport == "rdma":
            if args.ib_device:
                argv += ["--disaggregation-ib-device", args.ib_device]
        else:
            env["MC_FORCE_TCP"] = "1"

    if args.kv_events_port:
        argv += ["--kv-events-config", kv_events_config(args)]

    if args.hicache:
        argv.append("--enable-hierarchical-cache")
        if args.hicache_ratio is not None:
            argv += ["--hicache-ratio", str(args.hicache_ratio)]
        if args.hicache_size is not None:
            argv += ["--hicache-size", str(args.hicache_size)]
        if args.hicache_write_policy:
            argv += ["--hicache-write-policy", args.hicache_write_policy]
        if args.mooncake_master:
            argv += ["--hicache-storage-backend", "mooncake"]
            if args.prefetch_policy:
                argv += ["--hicache-storage-prefetch-policy", args.prefetch_policy]
            settings = mooncake_settings(args)
            mode = args.mooncake_config
            if mode == "auto":
                since = DECODE_EXTRA_CONFIG_SINCE if args.role == "decode" else MOONCAKE_EXTRA_CONFIG_SINCE
                mode = "both" if version >= since else "env"
            if mode in ("both", "extra-config"):
                argv += ["--hicache-storage-backend-extra-config", _json(settings)]
            if mode in ("both", "env"):
                env.update({_ENV_NAMES[k]: v for k, v in settings.items()})
            if args.transport == "tcp":
                env["MC_FORCE_TCP"] = "1"
        elif args.prefetch_policy:
            raise SystemExit("launch: --prefetch-policy needs an L3 tier (--mooncake-master)")
    elif args.mooncake_master:
        raise SystemExit("launch: --mooncake-master needs --hicache (the store is HiCache's L3 tier)")

    if args.local_hostname:
        env["MOONCAKE_LOCAL_HOSTNAME"] = args.local_hostname
    if entry == PATCHED_ENTRY:
        pp = _python_path(base_env, standins=args.device == "cpu")
        if pp:
            env["PYTHONPATH"] = pp
    return argv + extra, env


def cpu_flags(args: argparse.Namespace) -> list[str]:
    """SGLang's CPU engine: torch attention, no graphs, a small fixed KV pool; host-tier copies
    by plain torch indexing (``direct``) in the layout that path supports; a decode engine
    keeps a retracted request's KV in a CPU tensor (its default backup is a CUDA buffer)."""
    flags = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
             "--mem-fraction-static", "0.1", "--max-total-tokens", str(args.max_total_tokens or CPU_KV_TOKENS)]
    if args.hicache:
        flags += ["--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first"]
    if args.role == "decode":
        flags += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return flags


def cpu_env(args: argparse.Namespace) -> dict[str, str]:
    """``SGLANG_USE_CPU_ENGINE`` keeps Llama's rotary embedding off vllm and tells
    ``run_server`` to apply ``cpu_engine``'s patches; the stand-ins go last on the path (a real
    package always wins). A prefill engine must not send its cached prefix early: that path
    records a CUDA event."""
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    if args.role == "prefill":
        env["SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"] = "false"
    if args.role != "unified" and args.host not in ("0.0.0.0", "::"):
        env["SGLANG_HOST_IP"] = args.host  # the address a PD peer reaches this engine's KV at
    return env


def render(argv: Sequence[str], env: Mapping[str, str]) -> str:
    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines.append(shlex.join(argv))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    # Flags shared by every engine of a deployment can come from the environment (compose
    # anchors cannot concatenate lists); the command line, parsed after them, wins.
    shared = shlex.split(os.environ.get("KVGATE_LAUNCH_ARGS", ""))
    args = build_parser().parse_args([*shared, *(sys.argv[1:] if argv is None else argv)])
    cmd, env = build_command(args)
    if args.dry_run:
        print(render(cmd, env))
        return
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main()
