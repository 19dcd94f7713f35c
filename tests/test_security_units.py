"""The control plane's security rules as functions, without processes or connections: the
loopback check, the posture line for each combination, the worker URL policy (names resolved by
a stand-in resolver, so no test address leaves 127.0.0.0/8), the audit key names and the option
checks."""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import socket
from types import SimpleNamespace

import pytest

from gateway.audit import key_name
from gateway.config import GatewayConfig
from gateway.posture import Posture, is_loopback_host
from gateway.worker_policy import WorkerRefused, WorkerUrlPolicy, normalize_allow


# --- loopback --------------------------------------------------------------------------------

@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False), (None, False),
    ("10.1.2.3", False), ("192.168.0.1", False), ("fe80::1", False),
    ("no-such-host.invalid", False),  # does not resolve: counted as exposed
])
def test_loopback_check(host, loopback):
    assert is_loopback_host(host) is loopback


# --- posture ---------------------------------------------------------------------------------

def posture(host="127.0.0.1", **cfg) -> Posture:
    return Posture.of(GatewayConfig(host=host, **cfg))


CASES = [  # (config, expected surface states, level)
    (dict(), dict(data="open", admin="open", membership="open", metrics="open"), logging.INFO),
    (dict(host="0.0.0.0"), dict(data="open", admin="refused", membership="refused", metrics="open"), logging.WARNING),
    (dict(host="0.0.0.0", allow_open_admin=True), dict(admin="open", membership="open"), logging.WARNING),
    (dict(host="0.0.0.0", api_keys=["k"]), dict(data="key", admin="key", metrics="open"), logging.WARNING),
    (dict(host="0.0.0.0", api_keys=["k"], protect_metrics=True),
     dict(data="key", admin="key", membership="key", metrics="key"), logging.INFO),
    (dict(host="0.0.0.0", admin_api_keys=["a"], protect_metrics=True),
     dict(data="open", admin="key", membership="key", metrics="key"), logging.WARNING),
    (dict(host="0.0.0.0", protect_metrics=True), dict(metrics="open"), logging.WARNING),  # no key to ask for
    (dict(admin_api_keys=["a"]), dict(data="open", admin="key"), logging.INFO),
]


@pytest.mark.parametrize("cfg, states, level", CASES)
def test_posture_states_and_level(cfg, states, level):
    p = posture(**cfg)
    for surface, state in states.items():
        assert getattr(p, surface) == state, (surface, p)
        assert f" {surface}={state} " in p.line() + " "
    assert p.level == level
    assert p.labels()["bind"] == ("exposed" if cfg.get("host") == "0.0.0.0" else "loopback")


def test_posture_line_for_every_combination():
    hosts = ["127.0.0.1", "0.0.0.0"]
    keys = [{}, {"api_keys": ["k"]}, {"admin_api_keys": ["a"]}, {"api_keys": ["k"], "admin_api_keys": ["a"]}]
    for host, key, allow, protect, tls in itertools.product(hosts, keys, [False, True], [False, True], [False, True]):
        extra = {"tls_cert_file": "cert.pem"} if tls else {}
        p = posture(host, allow_open_admin=allow, protect_metrics=protect, **key, **extra)
        exposed = host == "0.0.0.0"
        admin_key = bool(key)
        line = p.line()
        assert line.startswith(f"security posture: bind={host} ({'exposed' if exposed else 'loopback'}) "
                               f"tls={'on' if tls else 'off'} "), line
        assert (p.admin == "refused") is (exposed and not admin_key and not allow), line
        assert p.membership == p.admin
        assert ("403" in line) is (p.admin == "refused")
        assert (p.data == "key") is ("api_keys" in key)
        assert (p.metrics == "key") is (protect and admin_key)
        opened = [s for s in ("data", "admin", "membership", "metrics") if getattr(p, s) == "open"]
        assert line.split("open_without_credential=")[1].split()[0] == (",".join(opened) or "none")
        assert p.level == (logging.WARNING if exposed and opened else logging.INFO), line


def test_posture_names_worker_tls_and_allowlist():
    p = Posture.of(GatewayConfig(), worker_tls="mtls", worker_allow="2 entries")
    assert "worker_tls=mtls worker_allow=2_entries" in p.line()
    assert p.labels()["worker_tls"] == "mtls" and p.labels()["worker_allow"] == "2 entries"


# --- worker URL policy -----------------------------------------------------------------------

def stub_resolver(table: dict[str, list[str]]):
    """Names answered from ``table``; anything else fails as DNS would."""
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list:
        asked.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ipaddress.ip_address(a) for a in table[host]]

    resolve.asked = asked
    return resolve


def verdict(policy: WorkerUrlPolicy, url: str) -> str | None:
    """None when ``url`` passes, else the refusal's reason."""
    try:
        asyncio.run(policy.check(url))
    except WorkerRefused as exc:
        return exc.reason
    return None


NAMES = {"worker.internal": ["127.0.0.2"], "meta.example": ["169.254.169.254"], "mixed.example": ["127.0.0.2", "fe80::1"],
         "loop.example": ["127.0.0.3"], "metadata.google.internal": ["169.254.169.254"]}


@pytest.mark.parametrize("url, reason", [
    ("http://127.0.0.2:8000", None),
    ("https://127.0.0.3", None),  # no allowlist: any address outside the refused ranges
    ("http://169.254.169.254/latest/meta-data", "link_local"),
    ("http://169.254.0.1:30000", "link_local"),
    ("http://[fe80::1]:30000", "link_local"),
    ("http://[::ffff:169.254.169.254]:80", "link_local"),  # IPv4-mapped
    ("http://[64:ff9b::a9fe:a9fe]:80", "link_local"),  # NAT64 of 169.254.169.254
    ("http://[fd00:ec2::254]", "metadata"),
    ("http://100.100.100.200", "metadata"),
    ("http://0.0.0.0:30000", "unspecified"),
    ("http://[::]:30000", "unspecified"),
    ("http://224.0.0.1", "multicast"),
    ("http://meta.example", "link_local"),  # a name is checked by its addresses
    ("http://mixed.example:1", "link_local"),  # every one of them
    ("http://metadata.google.internal", "metadata"),
    ("http://worker.internal:30000", None),
    ("http://nowhere.example", "unresolvable"),
    ("ftp://127.0.0.2", "malformed"),
    ("http://user:pw@127.0.0.2", "malformed"),
    ("http://127.0.0.2/?x=1", "malformed"),
    ("http://", "malformed"),
])
def test_refused_ranges_without_an_allowlist(url, reason):
    assert verdict(WorkerUrlPolicy([], resolve=stub_resolver(NAMES)), url) == reason


@pytest.mark.parametrize("url, reason", [
    ("http://127.0.0.2:30000", None),
    ("http://127.0.0.3:30000", "not_allowed"),
    ("http://[::ffff:127.0.0.2]:1", None),  # the IPv4 inside counts
    ("http://worker.internal", None),  # an unlisted name whose every address is listed
    ("http://loop.example", "not_allowed"),
    ("http://mixed.example", "link_local"),
    ("http://169.254.169.254", "link_local"),
])
def test_allowlist_of_networks(url, reason):
    policy = WorkerUrlPolicy(["127.0.0.2/32", "10.0.0.0/8"], resolve=stub_resolver(NAMES))
    assert verdict(policy, url) == reason


def test_allowlist_of_names_vouches_for_the_name_but_not_the_refused_ranges():
    resolve = stub_resolver({**NAMES, "a.svc.cluster.local": ["10.1.2.3"], "b.svc.cluster.local": ["169.254.1.1"]})
    policy = WorkerUrlPolicy(["*.svc.cluster.local", "Worker.Internal."], resolve=resolve)
    assert verdict(policy, "http://a.svc.cluster.local:30000") is None
    assert verdict(policy, "http://worker.internal") is None
    assert verdict(policy, "http://b.svc.cluster.local") == "link_local"
    assert verdict(policy, "http://svc.cluster.local") == "not_allowed"  # '*.' needs a label in front
    assert verdict(policy, "http://10.1.2.3") == "not_allowed"  # a listed name does not vouch for a literal
    before = list(resolve.asked)
    assert verdict(policy, "http://loop.example") == "not_allowed"
    assert resolve.asked == before, "a name refused by name alone is not even resolved"


def test_a_refused_range_is_allowed_only_by_a_network_inside_it():
    resolve = stub_resolver(NAMES)
    assert verdict(WorkerUrlPolicy(["0.0.0.0/0", "::/0"], resolve=resolve), "http://169.254.169.254") == "link_local"
    assert verdict(WorkerUrlPolicy(["169.254.0.0/16"], resolve=resolve), "http://169.254.169.254") is None
    narrow = WorkerUrlPolicy(["169.254.10.0/24"], resolve=resolve)
    assert verdict(narrow, "http://169.254.10.7:30000") is None
    assert verdict(narrow, "http://169.254.169.254") == "link_local"


def test_connect_time_verdict_applies_the_same_rules():
    policy = WorkerUrlPolicy(["127.0.0.2/32"])
    ip = ipaddress.ip_address
    assert policy.host_refusal("127.0.0.2", [ip("127.0.0.2")]) is None
    assert policy.host_refusal("127.0.0.3", [ip("127.0.0.3")]).reason == "not_allowed"
    assert policy.host_refusal("rebound.example", [ip("169.254.169.254")]).reason == "link_local"
    assert "rebound.example resolves to" in policy.host_refusal("rebound.example", [ip("127.0.0.3")]).detail


def test_policy_describes_itself_for_the_posture():
    assert WorkerUrlPolicy([]).describe() == "any"
    assert WorkerUrlPolicy(["127.0.0.2"]).describe() == "1 entry"
    assert WorkerUrlPolicy(["127.0.0.2", "*.svc", "worker-0"]).describe() == "3 entries"


def test_the_connector_checks_what_a_name_resolves_to_when_it_connects():
    """DNS rebinding: a name whose answer changed since it was added. The stand-in resolver
    answers 127.0.0.3, where a listening socket must accept nothing."""
    import aiohttp
    from aiohttp.abc import AbstractResolver

    from gateway.upstream import GuardedConnector, WorkerAddressRefused
    from gateway.worker_policy import WorkerGate
    from tests.test_gateway_control_plane import listener

    class Rebound(AbstractResolver):
        async def resolve(self, host, port=0, family=socket.AF_INET):
            return [{"hostname": host, "host": "127.0.0.3", "port": port, "family": socket.AF_INET, "proto": 0,
                     "flags": socket.AI_NUMERICHOST}]

        async def close(self):
            pass

    counted: list[tuple[str, str]] = []

    async def fetch(url: str) -> None:
        gate = WorkerGate(WorkerUrlPolicy(["127.0.0.2/32"]), lambda *k: counted.append(k))
        connector = GuardedConnector(gate, resolver=Rebound())
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(url) as resp:
                await resp.read()

    with listener("127.0.0.3") as target:
        with pytest.raises(WorkerAddressRefused, match="127.0.0.3 is not in --worker-url-allow"):
            asyncio.run(fetch(f"http://rebound.example:{target.port}/health"))
        assert target.accepted() == 0
    assert counted == [("connect", "not_allowed")]
    assert issubclass(WorkerAddressRefused, aiohttp.ClientConnectionError)  # the proxy's retry path handles it


@pytest.mark.parametrize("value, entries", [
    (None, []), ("127.0.0.2", ["127.0.0.2/32"]), ("10.0.0.0/8, *.Svc.Local.", ["10.0.0.0/8", "*.svc.local"]),
    (["fd00::/8", "worker-0"], ["fd00::/8", "worker-0"]), ("10.0.0.1/8", ["10.0.0.0/8"]),
])
def test_allowlist_entries_are_normalized(value, entries):
    assert normalize_allow(value) == entries
    assert GatewayConfig(worker_url_allow=value).worker_url_allow == entries


@pytest.mark.parametrize("bad", ["10.0.0.300", "http://x", "a b/c", "*", "1.2.3"])
def test_allowlist_entries_that_are_neither_networks_nor_names_are_refused(bad):
    with pytest.raises(ValueError, match="--worker-url-allow"):
        GatewayConfig(worker_url_allow=[bad])


# --- options and audit -----------------------------------------------------------------------

@pytest.mark.parametrize("cfg, flag", [
    (dict(tls_key_file="k.pem"), "--tls-key-file needs --tls-cert-file"),
    (dict(worker_client_key_file="k.pem"), "--worker-client-key-file needs --worker-client-cert-file"),
])
def test_tls_options_that_cannot_work_together(cfg, flag):
    with pytest.raises(ValueError, match=flag):
        GatewayConfig(**cfg)


def test_audit_names_the_key_by_position_never_the_key():
    cfg = GatewayConfig(api_keys=["data-0", "shared"], admin_api_keys=["admin-0", "shared"])
    assert key_name("Bearer data-0", cfg) == "api_key[0]"
    assert key_name("Bearer admin-0", cfg) == "admin_api_key[0]"
    assert key_name("Bearer shared", cfg) == "admin_api_key[1]"
    assert key_name("Bearer nope", cfg) == "invalid"
    assert key_name(None, cfg) == "missing"
    assert key_name("Bearer x", GatewayConfig()) == "none"


def test_worker_connection_errors_are_explained_only_where_tls_is_the_likely_cause():
    import aiohttp

    from gateway.tls import explain

    closed = aiohttp.ServerDisconnectedError()
    assert "client certificate" in explain(closed, "https://127.0.0.2:1", None)
    assert "may not trust c.pem" in explain(closed, "https://127.0.0.2:1", "c.pem")
    assert explain(closed, "http://127.0.0.2:1", None) == repr(closed)
    refused = aiohttp.ClientConnectorError(SimpleNamespace(ssl=True, host="127.0.0.2", port=1),
                                           ConnectionRefusedError(111, "Connection refused"))
    assert explain(refused, "https://127.0.0.2:1", None) == repr(refused)  # down, not a TLS problem
