"""Where the gateway may connect: the worker URL policy (``--worker-url-allow``).

Adding a worker at runtime makes the gateway connect to whatever URL it was given, so an
open ``POST /workers`` is a server-side request forgery surface. The policy is applied twice:

- before a runtime add (``/workers``, ``/add_worker``, Kubernetes discovery) makes any
  connection: the URL's host, or every address its name resolves to, must pass, or the add is
  refused (``WorkerRefused``); workers named in the configuration are the operator's own and
  are not checked here;
- whenever the upstream session opens a connection to any worker (``upstream.GuardedConnector``):
  the addresses it is about to use, after DNS and redirects, must pass, so a name that resolves
  elsewhere later (DNS rebinding) or a redirect to another host does not get around the check.

Rules, for each address (an IPv4 address inside an IPv6 one, mapped or NAT64, is checked too):

- link-local (169.254.0.0/16, fe80::/10), the cloud metadata services that sit outside it, the
  unspecified address and multicast are refused unless a listed network *inside* that range
  names them (``169.254.10.0/24``); ``0.0.0.0/0`` does not count as naming them;
- with no allowlist, every other address passes;
- with an allowlist, an IP literal must be inside a listed network; a name must be listed
  (exactly, or under a ``*.suffix`` entry) or resolve only to addresses inside listed networks.
  A listed name vouches for its addresses except for the refused ranges above.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from yarl import URL

log = logging.getLogger("kvgate.security")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolve = Callable[[str, int], Awaitable[list[IPAddress]]]

# (reason, network): refused unless a listed network inside it names the address.
REFUSED_RANGES: tuple[tuple[str, IPNetwork], ...] = tuple(
    (reason, ipaddress.ip_network(net)) for reason, net in (
        ("link_local", "169.254.0.0/16"),  # includes 169.254.169.254, the usual metadata service
        ("link_local", "fe80::/10"),
        ("metadata", "fd00:ec2::254/128"),  # AWS instance metadata over IPv6
        ("metadata", "100.100.100.200/32"),  # Alibaba Cloud metadata
        ("metadata", "168.63.129.16/32"),  # Azure host (WireServer)
        ("unspecified", "0.0.0.0/32"),  # connecting to it reaches this host
        ("unspecified", "::/128"),
        ("multicast", "224.0.0.0/4"),
        ("multicast", "ff00::/8"),
    ))
METADATA_NAMES = frozenset({"metadata.google.internal"})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAME = re.compile(r"^(\*\.)?([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*$")


class WorkerRefused(Exception):
    """A worker URL the policy refuses; ``reason`` is a short metric label."""

    def __init__(self, url: str, reason: str, detail: str) -> None:
        super().__init__(f"worker URL {url!r} refused: {detail}")  # repr: the URL is untrusted input
        self.url, self.reason, self.detail = url, reason, detail


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str
    detail: str


def normalize_allow(value: object) -> list[str]:
    """``--worker-url-allow`` entries as given (repeatable flags, a YAML list or one string
    separated by commas or spaces), each checked and written canonically: networks as
    ``ipaddress`` prints them (``10.0.0.7`` becomes ``10.0.0.7/32``), names in lower case."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)  # type: ignore[call-overload]
    out: list[str] = []
    for entry in (t for item in items for t in str(item).replace(",", " ").split()):
        net = _network(entry)
        if net is not None:
            out.append(str(net))
            continue
        name = entry.lower().rstrip(".")
        if not _NAME.match(name) or name.replace(".", "").isdigit():
            raise ValueError(f"--worker-url-allow {entry!r}: expected a CIDR, an address or a host name "
                             "(a leading '*.' allows every name under it)")
        out.append(name)
    return out


def _network(entry: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None


def embedded(addr: IPAddress) -> list[IPAddress]:
    """``addr`` and the IPv4 address an IPv6 one carries (mapped ``::ffff:a.b.c.d``, NAT64)."""
    out: list[IPAddress] = [addr]
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            out.append(addr.ipv4_mapped)
        elif addr in _NAT64:
            out.append(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
    return out


def ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


async def default_resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to, through aiohttp's own resolver (the one the upstream
    session connects with)."""
    from aiohttp import DefaultResolver

    resolver = DefaultResolver()
    try:
        found = await resolver.resolve(host, port, family=socket.AF_UNSPEC)
    finally:
        await resolver.close()
    addrs = [ip_literal(r["host"]) for r in found]
    if None in addrs:
        raise OSError(f"the resolver answered {host} with something that is not an IP address")
    return [a for a in addrs if a is not None]


class WorkerUrlPolicy:
    """The rules in the module's docstring for one allowlist (empty: only the refused ranges)."""

    def __init__(self, allow: Sequence[str] = (), resolve: Resolve = default_resolve) -> None:
        self.networks: list[IPNetwork] = []
        self.names: set[str] = set()
        self.suffixes: list[str] = []  # ".example.com" for "*.example.com"
        for entry in normalize_allow(allow):
            net = _network(entry)
            if net is not None:
                self.networks.append(net)
            elif entry.startswith("*."):
                self.suffixes.append(entry[1:])
            else:
                self.names.add(entry)
        self.restricted = bool(self.networks or self.names or self.suffixes)
        self.resolve = resolve

    def describe(self) -> str:
        n = len(self.networks) + len(self.names) + len(self.suffixes)
        return "any" if not n else f"{n} {'entry' if n == 1 else 'entries'}"

    def name_listed(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        return name in self.names or any(name.endswith(s) for s in self.suffixes)

    def _named_explicitly(self, addr: IPAddress, refused: IPNetwork) -> bool:
        return any(addr in net and net.version == refused.version and net.subnet_of(refused)  # type: ignore[arg-type]
                   for net in self.networks)

    def address_refusal(self, addr: IPAddress, vouched: bool = False) -> Refusal | None:
        """Why ``addr`` may not be connected to, or None. ``vouched``: it came from a listed name."""
        views = embedded(addr)
        for view in views:
            for reason, refused in REFUSED_RANGES:
                if view in refused and not self._named_explicitly(view, refused):
                    return Refusal(reason, f"{addr} is {reason.replace('_', '-')} ({refused}); list a network "
                                           "inside it in --worker-url-allow to allow it")
        if self.restricted and not vouched and not any(v in net for v in views for net in self.networks):
            return Refusal("not_allowed", f"{addr} is not in --worker-url-allow")
        return None

    def host_refusal(self, host: str, addrs: Iterable[IPAddress]) -> Refusal | None:
        """The verdict on connecting to ``host`` (a name or an IP literal) at ``addrs``."""
        name = host.lower().rstrip(".")
        literal = ip_literal(name)
        vouched = literal is None and self.name_listed(name)
        if literal is None and name in METADATA_NAMES and not vouched:
            return Refusal("metadata", f"{name} is a cloud metadata service")
        if literal is None and self.restricted and not vouched and not self.networks:
            return Refusal("not_allowed", f"host name {name} is not in --worker-url-allow")
        for addr in addrs:
            refusal = self.address_refusal(addr, vouched)
            if refusal is not None:
                return refusal if literal is not None else Refusal(refusal.reason, f"{name} resolves to "
                                                                                   f"{refusal.detail}")
        return None

    async def check(self, url: str) -> None:
        """Raise ``WorkerRefused`` unless ``url`` is a plain http(s) URL whose host passes.
        Makes no connection; a name is resolved (through DNS) and every address checked."""
        try:
            parsed = URL(url)
        except (ValueError, TypeError) as exc:
            raise WorkerRefused(url, "malformed", f"not a URL ({exc})") from None
        host = parsed.raw_host
        if parsed.scheme not in ("http", "https") or not host:
            raise WorkerRefused(url, "malformed", "expected http:// or https:// and a host")
        if parsed.user is not None or parsed.password is not None or parsed.query_string or parsed.fragment:
            raise WorkerRefused(url, "malformed", "expected scheme://host[:port][/path], without user, query "
                                                  "or fragment")
        literal = ip_literal(host)
        if literal is not None:
            addrs = [literal]
        else:
            early = self.host_refusal(host, [])
            if early is not None:
                raise WorkerRefused(url, early.reason, early.detail)
            try:
                addrs = await self.resolve(host, parsed.port or 80)
            except OSError as exc:
                raise WorkerRefused(url, "unresolvable", f"{host} does not resolve ({exc}); a name is allowed "
                                                         "by its addresses") from None
            if not addrs:
                raise WorkerRefused(url, "unresolvable", f"{host} resolves to no address")
        refusal = self.host_refusal(host, addrs)
        if refusal is not None:
            raise WorkerRefused(url, refusal.reason, refusal.detail)


class WorkerGate:
    """The policy plus what a refusal leaves behind: a log line and a count
    (``kvgate_worker_url_refused_total{stage, reason}``)."""

    def __init__(self, policy: WorkerUrlPolicy, count: Callable[[str, str], None]) -> None:
        self.policy = policy
        self.count = count
        self._warned: set[str] = set()  # hosts refused at connect time and logged at WARNING already

    async def vet(self, url: str) -> None:
        """Before a runtime add: raise ``WorkerRefused`` (logged and counted) or return."""
        try:
            await self.policy.check(url)
        except WorkerRefused as exc:
            self.count("add", exc.reason)
            log.warning("worker add refused: %s", exc)
            raise

    def connect_refusal(self, host: str, addrs: list[IPAddress]) -> Refusal | None:
        """At connect time (``upstream.GuardedConnector``): the refusal, logged and counted, or None."""
        refusal = self.policy.host_refusal(host, addrs)
        if refusal is not None:
            self.count("connect", refusal.reason)
            # Health checks retry every few seconds: one WARNING per host, then DEBUG. The set is
            # bounded because redirect targets come from workers.
            first = host not in self._warned
            if first and len(self._warned) < 1024:
                self._warned.add(host)
            log.log(logging.WARNING if first else logging.DEBUG, "connection to %r refused: %s", host, refusal.detail)
        return refusal
