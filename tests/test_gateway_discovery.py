"""Worker discovery from Kubernetes (gateway/discovery.py).

No real Kubernetes API server can run on this machine: kube-apiserver is shipped by no PyPI,
npm or Debian package (Debian has only kubectl and etcd), and the tools that bring one up
(kind, k3s, minikube, envtest) pull container images or download release binaries, which
cannot be fetched here. So the end-to-end tests run the real gateway process, with
``--service-discovery``, against ``tests/kube_api.py``: a loopback aiohttp server that
answers the pod list and watch calls in the API's wire format, from realistic pod JSON
(hand-assembled as the API returns it, not recorded from a live cluster), with watch events
as chunked JSON lines, bookmarks and a 410 ``Status`` for an expired resourceVersion. The
gateway finds it through a kubeconfig file the test writes, as it would find a cluster.
The pods' IP is 127.0.0.1 and their ``http`` container ports are simulated SGLang workers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import MODEL
from tests.kube_api import NAMESPACE, POD_JSON, KubeAPI, make_pod, set_ready
from tests.requires import need
from tests.support import Proc, free_port, get_text, metric_value, request_json, wait_until

need("kubernetes_asyncio", "pip install -e '.[k8s]'")

from gateway.cli import build_parser, config_from_args  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.discovery import PodRules, spec_for  # noqa: E402

DISCOVERY = ("--service-discovery", "--selector", "app=sglang-sim", "--service-discovery-namespace", NAMESPACE,
             "--service-discovery-port-name", "http", "--policy", "round_robin")


# --- flags and configuration ------------------------------------------------------------------

def _cfg(*argv: str) -> GatewayConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_sglang_router_discovery_command_line_means_the_same_here():
    """The command line sglang-router takes for discovery gives kvgate the same selectors, port
    and namespace, so switching routers is a change of binary name."""
    router_args = need("sglang_router.router_args", "the anchor router: pip install -e '.[test]'")
    import argparse

    argv = ["--service-discovery", "--selector", "app=sglang", "tier=gpu", "--service-discovery-port", "8000",
            "--service-discovery-namespace", "inference", "--pd-disaggregation",
            "--prefill-selector", "app=sglang", "role=prefill", "--decode-selector", "app=sglang", "role=decode"]
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser)
    theirs = router_args.RouterArgs.from_cli_args(parser.parse_args(argv))
    ours = _cfg(*argv)
    assert ours.service_discovery and theirs.service_discovery
    assert ours.selector == theirs.selector == {"app": "sglang", "tier": "gpu"}
    assert ours.prefill_selector == theirs.prefill_selector
    assert ours.decode_selector == theirs.decode_selector == {"app": "sglang", "role": "decode"}
    assert ours.service_discovery_port == theirs.service_discovery_port == 8000
    assert ours.service_discovery_namespace == theirs.service_discovery_namespace == "inference"
    assert ours.bootstrap_port_annotation == theirs.bootstrap_port_annotation == "sglang.ai/bootstrap-port"


def test_yaml_keys_and_selector_spellings(tmp_path: Path):
    path = tmp_path / "kvgate.yaml"
    path.write_text("service_discovery: true\nselector: {app: sglang}\nservice_discovery_port: 30000\n"
                    "service_discovery_port_name: http\n")
    cfg = _cfg("--config", str(path))
    assert (cfg.selector, cfg.service_discovery_port, cfg.service_discovery_port_name) == \
        ({"app": "sglang"}, 30000, "http")
    assert _cfg("--service-discovery", "--selector", "app=a,tier==b").selector == {"app": "a", "tier": "b"}
    assert _cfg("--service-discovery", "--selector", "app=a tier=b").selector == {"app": "a", "tier": "b"}


@pytest.mark.parametrize("argv, message", [
    (("--service-discovery",), "needs --selector"),
    (("--service-discovery", "--pd-disaggregation", "--selector", "app=a"), "--prefill-selector"),
    (("--service-discovery", "--selector", "app!=a"), "expected key=value"),
    (("--service-discovery", "--selector", "app"), "expected key=value"),
    (("--service-discovery", "--selector", "app=a", "--service-discovery-port", "0"), "not a TCP port"),
])
def test_discovery_options_that_cannot_work_are_refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        _cfg(*argv)


# --- which pods are which workers -----------------------------------------------------------------

def _pods(*raws: dict[str, Any]) -> list[Any]:
    """Pods as the client library hands them to discovery (its own model, from the API's JSON)."""
    from kubernetes_asyncio.client import ApiClient

    async def decode():
        async with ApiClient() as api:
            return [api.deserialize(SimpleNamespace(data=json.dumps(raw)), "V1Pod") for raw in raws]

    return asyncio.run(decode())


def _rules(**cfg: Any) -> PodRules:
    return PodRules.from_config(GatewayConfig(service_discovery=True, **cfg))


def test_a_pod_is_a_worker_while_running_ready_and_not_terminating():
    recorded = json.loads(POD_JSON.read_text())  # as the API returned it: Running, Ready, port "http"
    rules = _rules(selector={"app": "sglang-worker"}, service_discovery_port=8000)
    named = _rules(selector={"app": "sglang-worker"}, service_discovery_port_name="http")
    pending = make_pod("p", 30000, ip=None, labels={"app": "sglang-worker"})
    terminating = json.loads(POD_JSON.read_text())
    terminating["metadata"]["deletionTimestamp"] = "2025-03-11T10:02:13Z"
    not_ready = set_ready(json.loads(POD_JSON.read_text()), False)
    succeeded = json.loads(POD_JSON.read_text())
    succeeded["status"]["phase"] = "Succeeded"
    ipv6 = json.loads(POD_JSON.read_text())
    ipv6["status"]["podIP"] = "fd00::17"
    pod, pending, terminating, not_ready, succeeded, ipv6 = _pods(recorded, pending, terminating, not_ready,
                                                                  succeeded, ipv6)
    assert spec_for(pod, rules).url == "http://10.244.3.17:8000"  # never contacted: only compared
    assert spec_for(pod, named).url == "http://10.244.3.17:30000"
    assert spec_for(pod, named).role == "unified" and spec_for(pod, named).bootstrap_port is None
    assert spec_for(ipv6, rules).url == "http://[fd00::17]:8000"
    for pod in (pending, terminating, not_ready, succeeded):
        assert spec_for(pod, rules) is None
    assert spec_for(_pods(make_pod("x", 1, labels={"app": "other"}))[0], rules) is None


def test_pd_roles_from_selectors_and_bootstrap_port_from_annotation():
    rules = _rules(pd_disaggregation=True, prefill_selector={"app": "sglang", "role": "prefill"},
                   decode_selector={"app": "sglang", "role": "decode"}, service_discovery_port=30000)
    assert rules.list_selector == "app=sglang"  # the API filters on what both roles share
    prefill, bad_port, decode, other = _pods(
        make_pod("p", 1, labels={"app": "sglang", "role": "prefill"}, annotations={"sglang.ai/bootstrap-port": "8998"}),
        make_pod("q", 1, labels={"app": "sglang", "role": "prefill"}, annotations={"sglang.ai/bootstrap-port": "x"}),
        make_pod("d", 1, labels={"app": "sglang", "role": "decode"}, annotations={"sglang.ai/bootstrap-port": "8998"}),
        make_pod("o", 1, labels={"app": "sglang", "role": "router"}))
    assert (spec_for(prefill, rules).role, spec_for(prefill, rules).bootstrap_port) == ("prefill", 8998)
    assert spec_for(bad_port, rules).bootstrap_port is None  # then the registry asks the engine
    assert (spec_for(decode, rules).role, spec_for(decode, rules).bootstrap_port) == ("decode", None)
    assert spec_for(other, rules) is None


# --- end to end: the gateway process against the loopback API ---------------------------------------

@pytest.fixture(scope="module")
def sims() -> Iterator[list[Any]]:
    from tests.conftest import _start_sim

    procs: list[Any] = []
    try:
        for i in range(2):
            proc = _start_sim(procs, "--time-scale", "20", name=f"sim{i}")
            proc.port = int(proc.url.rsplit(":", 1)[1])
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeAPI]:
    api = KubeAPI().start()
    api.config_path = api.kubeconfig(tmp_path / "kubeconfig")
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
def gateway(start_gateway, kube: KubeAPI) -> Callable[..., Any]:
    def start(*urls: str, ready: bool = True) -> Any:
        env = {"KUBECONFIG": str(kube.config_path), "KUBERNETES_SERVICE_HOST": ""}  # the kubeconfig, not in-cluster
        return start_gateway(*urls, args=DISCOVERY, ready=ready, env=env)

    return start


def _listed(gw: Any) -> dict[str, bool]:
    """GET /workers: url -> healthy."""
    status, body = request_json("GET", gw.url + "/workers", timeout=5)
    assert status == 200, body
    return {w["url"]: w["healthy"] for w in body["workers"]}


def _workers(gw: Any) -> set[str]:
    return set(_listed(gw))


def _metric(gw: Any, name: str, **labels: str) -> float:
    return metric_value(get_text(gw.url + "/metrics"), name, **labels)




def _wait(gw: Any, check: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    return wait_until(check, what, timeout, gw)


def _wait_workers(gw: Any, expected: set[str], what: str) -> None:
    """Until the gateway lists exactly ``expected``, each one healthy (a worker is listed from the
    moment it is added, and healthy once its first probe passed)."""
    def done() -> bool:
        listed = _listed(gw)
        return set(listed) == expected and all(listed.values())

    try:
        _wait(gw, done, what)
    except AssertionError as exc:
        raise AssertionError(f"workers {_listed(gw)}, want {sorted(expected)}: {exc}") from None


def copy_of(pod: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(pod))


def _chat(gw: Any) -> int:
    status, body = request_json("POST", gw.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}, timeout=30)
    assert status == 200, body
    return status


def test_ready_pods_serve_and_leave_as_they_stop(sims, kube, gateway):
    a, b = sims
    kube.put(make_pod("worker-a", a.port))
    kube.put(make_pod("worker-b", b.port))
    kube.put(make_pod("other-app", a.port + 1, labels={"app": "something-else"}))  # not selected
    kube.put(make_pod("worker-pending", a.port + 2, ip=None))  # selected, not scheduled yet
    gw = gateway()
    _wait_workers(gw, {a.url, b.url}, "both ready pods registered")
    for _ in range(4):
        _chat(gw)
    for sim in (a, b):  # round robin: both took requests
        assert _metric(gw, "kvgate_routed_total", worker=sim.url) >= 1

    kube.put(set_ready(copy_of(kube.pods["worker-b"]), False))
    _wait_workers(gw, {a.url}, "a pod turning NotReady removes its worker")
    kube.put(set_ready(copy_of(kube.pods["worker-b"]), True))
    _wait_workers(gw, {a.url, b.url}, "Ready again: added again")

    kube.terminate("worker-a")
    _wait_workers(gw, {b.url}, "a terminating pod (deletionTimestamp) is removed before it is gone")
    kube.delete("worker-a")
    kube.delete("worker-b")
    _wait_workers(gw, set(), "a DELETED event removes the worker")
    kube.put(make_pod("worker-a2", a.port))
    _wait_workers(gw, {a.url}, "a new pod is added from its ADDED event")
    _chat(gw)
    assert _metric(gw, "kvgate_discovery_connected") == 1
    assert _metric(gw, "kvgate_discovery_events_total", type="DELETED") >= 2
    assert _metric(gw, "kvgate_discovery_workers") == 1
    assert len(kube.calls("list")) == 1  # one list, then one watch all along
    assert len(kube.calls("watch")) == 1, kube.calls("watch")


def test_expired_resource_version_relists_and_converges(sims, kube, gateway):
    a, b = sims
    kube.put(make_pod("worker-a", a.port))
    gw = gateway()
    _wait_workers(gw, {a.url}, "first pod registered")
    kube.paused = True  # the watch misses these, then its version is compacted away
    kube.delete("worker-a")
    kube.put(make_pod("worker-b", b.port))
    kube.expire()
    _wait_workers(gw, {b.url}, "after the 410 the relist shows only worker-b")
    assert len(kube.calls("list")) == 2
    assert _metric(gw, "kvgate_discovery_relists_total") == 2
    kube.paused = False
    kube.put(make_pod("worker-a", a.port))
    _wait_workers(gw, {a.url, b.url}, "the watch after the relist follows new pods")


def test_dropped_watch_resumes_from_the_last_bookmark(sims, kube, gateway):
    a, b = sims
    kube.put(make_pod("worker-a", a.port))
    gw = gateway()
    _wait_workers(gw, {a.url}, "first pod registered")
    kube.put(make_pod("unrelated", 1, labels={"app": "something-else"}))  # moves the version, unseen
    mark = kube.bookmark()
    _wait(gw, lambda: _metric(gw, "kvgate_discovery_events_total", type="BOOKMARK") >= 1, "bookmark received")
    kube.drop_watches()
    kube.put(make_pod("worker-b", b.port))
    _wait_workers(gw, {a.url, b.url}, "a pod added around the cut is seen by the new watch")
    watches = kube.calls("watch")
    assert len(watches) >= 2 and watches[1]["resourceVersion"] == str(mark), watches
    assert len(kube.calls("list")) == 1  # resumed, not relisted


def test_api_outage_keeps_workers_and_flag_workers_stay(sims, kube, gateway):
    a, b = sims
    kube.put(make_pod("worker-a", a.port))
    kube.put(make_pod("worker-b", b.port))  # also given by --worker-urls: the flag's, not discovery's
    gw = gateway(b.url)
    _wait_workers(gw, {a.url, b.url}, "discovered and flag workers side by side")
    kube.set_down(True)
    _wait(gw, lambda: _metric(gw, "kvgate_discovery_connected") == 0, "the outage is reported")
    assert _workers(gw) == {a.url, b.url}  # nothing is dropped for want of news
    _chat(gw)
    kube.set_down(False)
    kube.delete("worker-b")
    kube.delete("worker-a")
    _wait_workers(gw, {b.url}, "after the outage the watch resumes; the flag's worker stays")
    assert _metric(gw, "kvgate_discovery_connected") == 1
    assert len(kube.calls("list")) == 1


def test_discovered_pods_go_through_the_worker_url_policy(sims, kube, start_gateway):
    """A pod outside --worker-url-allow is refused before any connection (a listening socket at
    its address accepts nothing), counted, and audited; an allowed pod beside it serves."""
    from tests.test_gateway_control_plane import audit_lines, listener

    a, _ = sims
    with listener("127.0.0.3") as refused:
        kube.put(make_pod("worker-a", a.port))
        kube.put(make_pod("worker-x", refused.port, ip="127.0.0.3"))
        env = {"KUBECONFIG": str(kube.config_path), "KUBERNETES_SERVICE_HOST": ""}
        gw = start_gateway(args=(*DISCOVERY, "--worker-url-allow", "127.0.0.1/32"), env=env)
        _wait_workers(gw, {a.url}, "the allowed pod registered")
        _wait(gw, lambda: _metric(gw, "kvgate_worker_url_refused_total", stage="add", reason="not_allowed") >= 1,
              "the refused pod counted")
        _chat(gw)
        assert _workers(gw) == {a.url}
        assert refused.accepted() == 0, "the refused pod's address was connected to"
    added = audit_lines(gw, "add_worker")
    assert any(f'target="{a.url}"' in ln and "key=discovery" in ln and "status=added" in ln for ln in added), added
    assert any(f'target="{refused.url}"' in ln and "status=refused:not_allowed" in ln for ln in added), added


def test_without_credentials_the_gateway_does_not_start(tmp_path: Path):
    proc = Proc.python("gateway", "serve", "--port", str(free_port()), "--service-discovery", "--selector", "app=x",
                       name="gateway", KUBECONFIG=str(tmp_path / "missing"), KUBERNETES_SERVICE_HOST="")
    try:
        assert proc.popen.wait(30) != 0
        assert "no usable kubeconfig at" in proc.output(), proc.output()[-3000:]
    finally:
        proc.stop()
