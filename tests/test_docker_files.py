"""docker/: schema and lint (docker/validate.sh), plus what a schema cannot see.

No Docker engine runs here, so the compose files are checked the way the engine would
read them: every service command is parsed by the real parser of the program it runs
(engine_patches.launch, the simulator, the gateway), service references resolve, and the
mooncake_master command line starts the real binary.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine_patches.launch import build_command, build_parser
from tests.requires import missing
from tests.support import FREE_PORT, ROOT, Proc, fill_ports, launch

DOCKER = ROOT / "docker"
VALIDATORS_MISSING = 3  # validate.sh's exit status when a tool is not installed


def run_validate(folder: Path) -> subprocess.CompletedProcess:
    out = subprocess.run(["bash", str(folder / "validate.sh")], capture_output=True, text=True,
                         timeout=120, env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                                           "PYTHON": sys.executable})
    if out.returncode == VALIDATORS_MISSING:
        missing(out.stderr.strip() + ' (pip install -e ".[docker]")')
    return out


def interpolate(text: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR-default}`` with nothing set, and ``$$``."""
    text = re.sub(r"\$\{[A-Z_][A-Z0-9_]*:?-([^}]*)\}", r"\1", text)
    return text.replace("$$", "$")


def load(name: str) -> dict:
    return yaml.safe_load(interpolate((DOCKER / name).read_text()))  # merge keys resolve here


def command(svc: dict) -> list[str]:
    cmd = svc.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def test_validate_script_passes():
    out = run_validate(DOCKER)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "compose files and Dockerfiles OK" in out.stdout


def test_validate_script_fails_on_a_bad_compose_file_and_a_bad_dockerfile(tmp_path):
    for f in ["validate.sh", "Dockerfile", "compose.sim.yml"]:
        shutil.copy(DOCKER / f, tmp_path / f)
    (tmp_path / "compose.broken.yml").write_text("services:\n  a:\n    image: x\n    ports: 30000\n")
    out = run_validate(tmp_path)
    assert out.returncode != 0 and "ports" in out.stdout + out.stderr
    (tmp_path / "compose.broken.yml").unlink()
    (tmp_path / "Dockerfile.bad").write_text("FROM debian\nRUN apt-get install -y curl\n")
    out = run_validate(tmp_path)
    assert out.returncode != 0 and "DL3" in out.stdout + out.stderr


@pytest.mark.parametrize("name", ["compose.gpu.yml", "compose.sim.yml"])
def test_services_reference_each_other_consistently(name):
    services = load(name)["services"]
    for svc_name, svc in services.items():
        assert "image" in svc or "build" in svc, svc_name
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{svc_name} depends on unknown {dep}"
    gateway = command(services["kvgate"])
    urls = [gateway[i + 1] for i, a in enumerate(gateway) if a in ("--prefill", "--decode")]
    assert urls, "the gateway names no workers"
    for url in urls:
        host = re.match(r"http://([^:/]+):30000$", url)[1]
        assert host in services and services[host].get("hostname") == host
    engines = {re.match(r"http://([^:]+)", u)[1] for u in urls}
    assert set(services["kvgate"]["depends_on"]) - {"nats"} == engines
    assert services["kvgate"]["ports"] == ["30000:30000"]


def test_sim_gateway_replicas_share_state_on_the_compose_nats():
    services = load("compose.sim.yml")["services"]
    replicas = {n: s for n, s in services.items() if n.startswith("kvgate")}
    assert sorted(replicas) == ["kvgate", "kvgate-1"]
    assert replicas["kvgate"]["command"] == replicas["kvgate-1"]["command"]
    assert replicas["kvgate-1"]["ports"] == ["30001:30000"]
    cmd = command(replicas["kvgate"])
    assert re.fullmatch(r"nats://nats:4222", cmd[cmd.index("--state-url") + 1])
    assert "nats" in replicas["kvgate-1"]["depends_on"] and "8222" in services["nats"]["command"]


def test_every_top_level_package_is_in_the_image():
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name not in ("tests",))
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert [p for p in packages if f"COPY {p} ./{p}" not in dockerfile] == []


def test_gpu_engines_are_valid_launcher_invocations():
    services = load("compose.gpu.yml")["services"]
    engines = {n: s for n, s in services.items() if n.startswith(("prefill-", "decode-"))}
    assert len(engines) == 4
    for name, svc in engines.items():
        shared = shlex.split(svc["environment"]["KVGATE_LAUNCH_ARGS"])
        args = build_parser().parse_args([*shared, *command(svc)])
        argv, env = build_command(args, base_env={})
        assert args.role == name.split("-")[0] and args.local_hostname == name
        assert argv[argv.index("--disaggregation-mode") + 1] == args.role
        assert env["MOONCAKE_MASTER"] == "mooncake-master:50051" and "MC_FORCE_TCP" not in env
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert "/dev/infiniband:/dev/infiniband" in svc["devices"] and svc["ulimits"]["memlock"] == -1


def test_gateway_commands_parse_with_the_gateway_cli():
    import gateway.cli as cli
    for name in ("compose.gpu.yml", "compose.sim.yml"):
        gw = load(name)["services"]["kvgate"]
        args = cli.build_parser().parse_args(command(gw))
        cfg = cli.config_from_args(args)
        roles = sorted((w.role, w.bootstrap_port) for w in cfg.workers)
        assert roles == [("decode", None)] * 2 + [("prefill", 8998)] * 2, name
        assert cfg.host == "0.0.0.0" and cfg.port == 30000 and cfg.policy == "cost"


def test_kubernetes_example_grants_discovery_what_it_asks_for():
    """docker/kubernetes.yml: the gateway's arguments parse with its CLI, and its service account
    may get, list and watch pods in the namespace it watches (no API server here to apply it to)."""
    import gateway.cli as cli
    docs = {d["kind"]: d for d in yaml.safe_load_all((DOCKER / "kubernetes.yml").read_text())}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    cfg = cli.config_from_args(cli.build_parser().parse_args([str(a) for a in pod["containers"][0]["args"]]))
    assert cfg.service_discovery and cfg.selector and cfg.service_discovery_port_name == "http"
    namespace = cfg.service_discovery_namespace
    role, binding = docs["Role"], docs["RoleBinding"]
    assert {d["metadata"]["namespace"] for d in docs.values()} == {namespace}
    assert any(r["apiGroups"] == [""] and "pods" in r["resources"] and {"get", "list", "watch"} <= set(r["verbs"])
               for r in role["rules"])
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": namespace} in binding["subjects"]
    assert docs["ServiceAccount"]["metadata"]["name"] == pod["serviceAccountName"]


def test_sim_workers_parse_with_the_simulator_cli():
    import simulator.config as config
    services = load("compose.sim.yml")["services"]
    for name, svc in services.items():
        if name.startswith("kvgate") or name == "nats":
            continue
        cmd = command(svc)
        assert svc["entrypoint"] == ["python", "-m", "simulator"] and cmd[0] == "serve"
        args = config.build_parser().parse_args(cmd[1:])
        assert args.host == name and args.disaggregation_mode == name.split("-")[0]
        assert svc["environment"]["KVGATE_HEALTH_URL"] == f"http://{name}:30000/health"


def test_mooncake_master_command_starts_the_real_binary():
    exe = shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) or shutil.which("mooncake_master")
    if not exe:
        missing("mooncake_master not installed (pip install mooncake-transfer-engine-non-cuda)")
    svc = load("compose.gpu.yml")["services"]["mooncake-master"]
    assert svc["entrypoint"] == ["mooncake_master"]
    # The compose file's own flags, with every port (the metrics one too, 9003 by default) free on loopback.
    local = {"--rpc_address": "127.0.0.1", "--rpc_port": FREE_PORT, "--http_metadata_server_host": "127.0.0.1",
             "--http_metadata_server_port": FREE_PORT}
    argv = []
    for arg in command(svc):
        key, _, value = arg.partition("=")
        argv.append(f"{key}={local.get(key, value)}")
    assert set(local) <= {a.split("=")[0] for a in argv}
    argv += ["--metrics_host=127.0.0.1", f"--metrics_port={FREE_PORT}"]

    def start() -> Proc:
        args, ports = fill_ports([exe, *argv])
        proc = Proc(args, name="mooncake-master")
        proc.url = f"http://127.0.0.1:{ports[1]}"  # rpc, http metadata, metrics
        return proc

    # The HTTP metadata server answers 404 for an unknown key once it is up.
    proc = launch(start, lambda p: p.wait_http(p.url + "/metadata?key=kvgate-probe", timeout=20, ok=(200, 404)))
    proc.stop()
