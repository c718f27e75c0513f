"""Which HTTP provider URLs the operator may call: the administrator's allow-list.

A tenant names the URLs its envelope's provider is called at; the operator makes the calls
from inside the cluster, with its own network position. Without a list, a tenant could make
it GET (and POST, for cancels) loopback, the cloud's metadata service, the API server, the
kubelet or another tenant's Services. So the administrator lists what may be called (the
chart's `providers.allowedHosts`, the operator's `--provider-allow`):

- a DNS name, `inference.example.com`, or every name under a domain, `*.example.com`
  (not the domain itself);
- an IP address or a CIDR, `10.20.0.0/16`, for URLs whose host is an IP literal.

A name is matched as a name, never by the addresses it resolves to, so that admission (which
cannot resolve names) and the operator decide alike. Whatever the list says, the operator
never connects to loopback, link-local, unspecified, multicast or cloud metadata addresses:
a name that resolves to one (at any lookup: DNS rebinding) is refused, and the address
connected to is the one checked. Nothing here does I/O.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Never called, whatever the allow-list says (the chart's admission policy refuses the
# same literals).
ALWAYS_REFUSED: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",  # "this network": 0.0.0.0 reaches the host itself
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local: 169.254.169.254 is the metadata service
        "100.100.100.200/32",  # Alibaba Cloud metadata
        "192.0.0.192/32",  # Oracle Cloud metadata
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the broadcast address
        "::/128",  # unspecified
        "::1/128",  # loopback
        "fe80::/10",  # link-local
        "fd00:ec2::254/128",  # AWS metadata over IPv6
        "ff00::/8",  # multicast
    )
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")

_NAME_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_NAME = re.compile(rf"{_NAME_LABEL}(\.{_NAME_LABEL})*")
_WILDCARD = re.compile(rf"\*\.{_NAME.pattern}")


class RefusedByPolicyError(Exception):
    """The operator will not call this URL or address (why: for the operator's log only)."""


def always_refused(address: Address) -> bool:
    """Loopback, link-local, unspecified, multicast or metadata, also when spelled as an
    IPv4-mapped or IPv4-compatible IPv6 address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        low = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is None and (int(address) >> 32 == 0 or address in _NAT64):
            embedded = low  # ::a.b.c.d (deprecated), or 64:ff9b::a.b.c.d through NAT64
        if embedded is not None and always_refused(embedded):
            return True
    return any(address in network for network in ALWAYS_REFUSED) or (
        address.is_loopback or address.is_link_local or address.is_unspecified
    )


def parse_address(text: str) -> Address | None:
    """An IP address (IPv6 without brackets, no zone), or None for anything else."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class AllowList:
    """The administrator's list. Empty: no HTTP provider may be called at all."""

    names: frozenset[str] = frozenset()
    suffixes: frozenset[str] = frozenset()  # from "*.example.com": ".example.com"
    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        """Entries as the chart and the CLI give them; ValueError names a bad one."""
        names: set[str] = set()
        suffixes: set[str] = set()
        networks: list[Network] = []
        for raw in entries:
            entry = raw.strip().lower().rstrip(".")
            if not entry:
                continue
            if _WILDCARD.fullmatch(entry):
                suffixes.add(entry[1:])
            elif "/" in entry or parse_address(entry) is not None:
                try:
                    networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError:
                    raise ValueError(f"{raw!r} is not an IP address or CIDR") from None
            elif _NAME.fullmatch(entry) and len(entry) <= 253:
                names.add(entry)
            else:
                raise ValueError(
                    f"{raw!r} is not a DNS name, '*.' and a domain, an IP address or a CIDR"
                )
        return cls(frozenset(names), frozenset(suffixes), tuple(networks))

    def __bool__(self) -> bool:
        return bool(self.names or self.suffixes or self.networks)

    def allows_name(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        return name in self.names or any(name.endswith(s) for s in self.suffixes)

    def allows_address(self, address: Address) -> bool:
        return not always_refused(address) and any(
            address.version == n.version and address in n for n in self.networks
        )


@dataclass(frozen=True)
class Target:
    """Where a checked URL goes: its host as a name, or as an address."""

    host: str
    port: int
    address: Address | None  # the host is an IP literal


def check_url(allow: AllowList, url: str) -> Target:
    """The host and port `url` may be called at, or RefusedByPolicyError (saying why)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise RefusedByPolicyError(f"unreadable URL: {error}") from None
    if parts.scheme not in ("http", "https"):
        raise RefusedByPolicyError(f"scheme {parts.scheme!r} is not http or https")
    if "@" in parts.netloc or "\\" in parts.netloc or "{" in parts.netloc:
        raise RefusedByPolicyError("credentials, a backslash or a template in the URL's authority")
    host = parts.hostname
    if not host:
        raise RefusedByPolicyError("no host")
    address = parse_address(host)
    if address is not None:
        if always_refused(address):
            raise RefusedByPolicyError(f"{address} is loopback, link-local or metadata")
        if not allow.allows_address(address):
            raise RefusedByPolicyError(f"{address} is in no allowed CIDR")
    elif not _NAME.fullmatch(host.rstrip(".")) or not allow.allows_name(host):
        raise RefusedByPolicyError(f"{host} is not an allowed host")
    default = 443 if parts.scheme == "https" else 80
    return Target(host=host, port=port or default, address=address)


def check_resolved(host: str, addresses: Iterable[str]) -> list[str]:
    """The addresses `host` resolved to (maybe none), if every one may be connected to;
    else RefusedByPolicyError (one bad answer refuses the name: a connection might pick it)."""
    checked = []
    for text in addresses:
        address = parse_address(text.split("%", 1)[0])
        if address is None or always_refused(address):
            raise RefusedByPolicyError(f"{host} resolves to {text}: never called")
        checked.append(text)
    return checked


def check_template(template: str) -> None:
    """A provider URL template ("{operationId}" substituted later) whose authority names no
    placeholder: a claim's operation id must never pick the host or port called."""
    authority = template.split("://", 1)[-1].split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    if "{" in authority or "}" in authority:
        raise RefusedByPolicyError("a template in the URL's host or port")
