"""engine_patches.launch: the SGLang command lines it builds, checked against SGLang's parser."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

import pytest

from engine_patches.launch import PATCHED_ENTRY, PLAIN_ENTRY, build_command, build_parser
from tests.sglang_cpu import child_pythonpath, require
from tests.support import ROOT, child_env

MASTER = ["--hicache", "--mooncake-master", "mooncake-master:50051",
          "--mooncake-metadata", "http://mooncake-master:8080/metadata"]

ROLE_CASES = {
    "prefill-rdma": ["--role", "prefill", "--transport", "rdma", "--ib-device", "mlx5_0",
                     "--kv-events-port", "5557", *MASTER, "--prefetch-policy", "timeout"],
    "decode-tcp": ["--role", "decode", "--port", "30001", "--bootstrap-port", "9000",
                   "--kv-events-port", "5560", "--hicache", "--hicache-ratio", "2"],
    "unified": ["--role", "unified", "--kv-events-port", "5570", "--page-size", "64", *MASTER,
                "--hicache-write-policy", "write_through", "--global-segment-size", "8gb", "--priority-scheduling"],
}


def build(*argv: str, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    args = build_parser().parse_args(["--model", "/models/m", "--sglang-version", "0.5.23", *argv])
    return build_command(args, base_env=env or {})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_prefill_rdma_carries_pd_events_and_store_settings():
    argv, env = build(*ROLE_CASES["prefill-rdma"], "--", "--tp-size", "2")
    assert argv[1:3] == ["-m", PATCHED_ENTRY]
    assert flag(argv, "--disaggregation-mode") == "prefill"
    assert flag(argv, "--disaggregation-transfer-backend") == "mooncake"
    assert flag(argv, "--disaggregation-bootstrap-port") == "8998"
    assert flag(argv, "--disaggregation-ib-device") == "mlx5_0"
    assert "MC_FORCE_TCP" not in env
    assert {"--enable-metrics", "--enable-cache-report", "--enable-hierarchical-cache"} <= set(argv)
    assert json.loads(flag(argv, "--kv-events-config")) == {
        "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "", "replay_endpoint": "tcp://*:5657"}
    extra = json.loads(flag(argv, "--hicache-storage-backend-extra-config"))
    assert extra == {"master_server_address": "mooncake-master:50051",
                     "metadata_server": "http://mooncake-master:8080/metadata",
                     "global_segment_size": "4gb", "protocol": "rdma", "device_name": "mlx5_0"}
    assert env["MOONCAKE_MASTER"] == "mooncake-master:50051"
    assert env["MOONCAKE_PROTOCOL"] == "rdma" and env["MOONCAKE_DEVICE"] == "mlx5_0"
    assert argv[-2:] == ["--tp-size", "2"]


def test_tcp_transport_forces_tcp_and_empty_device():
    argv, env = build("--role", "prefill", "--ib-device", "mlx5_0", *MASTER)
    assert env["MC_FORCE_TCP"] == "1"
    assert "--disaggregation-ib-device" not in argv
    extra = json.loads(flag(argv, "--hicache-storage-backend-extra-config"))
    assert extra["protocol"] == "tcp" and extra["device_name"] == ""


def test_unified_has_no_pd_flags_and_hicache_without_master_has_no_l3():
    argv, env = build("--role", "unified", "--hicache")
    assert not [a for a in argv if a.startswith("--disaggregation")]
    assert "--enable-hierarchical-cache" in argv and "--hicache-storage-backend" not in argv
    assert not [k for k in env if k.startswith(("MOONCAKE", "MC_"))]


def test_priority_scheduling_only_when_asked():
    assert "--enable-priority-scheduling" in build("--role", "unified", "--priority-scheduling")[0]
    assert "--enable-priority-scheduling" not in build("--role", "unified")[0]


def test_mooncake_config_knob_selects_env_or_flag():
    argv, env = build("--role", "unified", *MASTER, "--mooncake-config", "env")
    assert "--hicache-storage-backend-extra-config" not in argv and env["MOONCAKE_MASTER"]
    argv, env = build("--role", "unified", *MASTER, "--mooncake-config", "extra-config")
    assert "--hicache-storage-backend-extra-config" in argv and "MOONCAKE_MASTER" not in env


@pytest.mark.parametrize("version, role, expect_flag", [
    ("0.5.23", "decode", True), ("0.5.7", "decode", False), ("0.5.7", "prefill", True),
    ("0.5.2", "unified", False),
])
def test_mooncake_config_follows_the_target_release(version, role, expect_flag):
    args = build_parser().parse_args(["--model", "/m", "--role", role, *MASTER, "--sglang-version", version])
    argv, env = build_command(args, base_env={})
    assert ("--hicache-storage-backend-extra-config" in argv) is expect_flag
    assert env["MOONCAKE_MASTER"] == "mooncake-master:50051"  # env works on every 0.5.x


def test_no_patches_runs_plain_sglang_and_checkout_gets_pythonpath():
    argv, env = build("--role", "unified", "--no-patches")
    assert argv[1:3] == ["-m", PLAIN_ENTRY] and "PYTHONPATH" not in env
    _, env = build("--role", "unified", env={"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(":")[:2] == [str(ROOT), "/x"]


@pytest.mark.parametrize("argv, message", [
    (["--role", "unified", "--mooncake-master", "m:1"], "needs --hicache"),
    (["--role", "unified", "--hicache", "--prefetch-policy", "timeout"], "needs an L3 tier"),
])
def test_inconsistent_options_are_refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        build(*argv)


def test_model_is_required_unless_passed_through():
    with pytest.raises(SystemExit, match="--model is required"):
        build_command(build_parser().parse_args(["--role", "unified"]), base_env={})
    args = build_parser().parse_args(["--role", "unified", "--", "--model-path", "/m"])
    assert build_command(args, base_env={})[0][-2:] == ["--model-path", "/m"]


def test_dry_run_prints_a_runnable_shell_form():
    out = subprocess.run(
        [sys.executable, "-m", "engine_patches.launch", *ROLE_CASES["prefill-rdma"],
         "--model", "/models/m", "--dry-run"],
        capture_output=True, text=True, timeout=30, env=child_env(), cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "export MOONCAKE_MASTER=mooncake-master:50051" in lines
    argv = shlex.split(lines[-1])
    assert argv[1:3] == ["-m", PATCHED_ENTRY] and flag(argv, "--disaggregation-ib-device") == "mlx5_0"


# --- against SGLang's own argument parser (needs the real sglang package) ---------------


@pytest.mark.parametrize("case", sorted(ROLE_CASES))
def test_sglang_parser_accepts_every_role(case):
    server_args = require("sglang.srt.server_args")
    kv_events = require("sglang.srt.disaggregation.kv_events")
    argv, _ = build(*ROLE_CASES[case])
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv[3:])  # drops "python -m entry"; unknown flags exit here
    sa = server_args.ServerArgs.from_cli_args(ns)
    role = ROLE_CASES[case][1]
    assert sa.disaggregation_mode == ("null" if role == "unified" else role)
    assert sa.enable_metrics and sa.enable_cache_report and sa.enable_hierarchical_cache
    cfg = kv_events.KVEventsConfig.from_cli(sa.kv_events_config)
    assert cfg.publisher == "zmq" and cfg.endpoint.startswith("tcp://*:")
    if role != "unified":
        assert sa.disaggregation_transfer_backend == "mooncake"
        assert sa.disaggregation_bootstrap_port == int(flag(argv, "--disaggregation-bootstrap-port"))
    if "--mooncake-master" in ROLE_CASES[case]:
        assert sa.hicache_storage_backend == "mooncake"
    assert sa.enable_priority_scheduling == ("--priority-scheduling" in ROLE_CASES[case])


def test_mooncake_store_reads_the_same_settings_from_flag_and_env(monkeypatch):
    store = require("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store")
    argv, env = build(*ROLE_CASES["prefill-rdma"])
    from_flag = store.MooncakeStoreConfig.load_from_extra_config(
        json.loads(flag(argv, "--hicache-storage-backend-extra-config")))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from_env = store.MooncakeStoreConfig.load_from_env()
    for cfg in (from_flag, from_env):
        assert cfg.master_server_address == "mooncake-master:50051"
        assert cfg.metadata_server == "http://mooncake-master:8080/metadata"
        assert cfg.protocol == "rdma" and cfg.device_name == "mlx5_0"
        assert cfg.global_segment_size == 4 * 1024**3


def test_run_server_passes_arguments_to_sglang_launch_server():
    require("sglang.launch_server")
    env = child_env(PYTHONPATH=child_pythonpath(ROOT))
    out = subprocess.run([sys.executable, "-m", PATCHED_ENTRY, "--model-path", "/m", "--no-such-flag"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    # SGLang's own parser answered: its usage lists its flags, its error names ours.
    assert out.returncode == 2, out.stderr[-3000:]
    assert "--disaggregation-mode" in out.stderr and "unrecognized arguments: --no-such-flag" in out.stderr
