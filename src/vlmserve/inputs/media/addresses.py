"""Which resolved addresses a fetch may connect to (SSRF guard).

Default: public unicast only. IPv6 forms that embed an IPv4 address (mapped, NAT64, 6to4) are
judged by the embedded address too, since a router or the kernel may deliver them to it.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPAT = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d form
_CGNAT = ipaddress.ip_network("100.64.0.0/10")  # not is_global, but spelled out: older Pythons differ


def is_public(addr: IPAddress) -> bool:
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return is_public(addr.ipv4_mapped)
        if addr in _NAT64:
            return is_public(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
        if addr in _IPV4_COMPAT:
            return False
        if addr.sixtofour is not None and not is_public(addr.sixtofour):
            return False
        if addr.teredo is not None:
            return False  # tunnels to an obfuscated IPv4 client address; never needed for images
    elif addr in _CGNAT:
        return False
    return addr.is_global and not (
        addr.is_multicast
        or addr.is_private
        or addr.is_loopback
        or addr.is_link_local
        or addr.is_reserved
        or addr.is_unspecified
    )


@lru_cache(maxsize=32)
def _parse_allowed(entries: tuple[str, ...]) -> tuple[frozenset[str], tuple]:
    names: set[str] = set()
    nets = []
    for entry in entries:
        try:
            nets.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            names.add(entry.strip().rstrip(".").lower())
    return frozenset(names), tuple(nets)


def host_is_allowlisted(host: str, allowed: tuple[str, ...]) -> bool:
    names, _ = _parse_allowed(allowed)
    return host.rstrip(".").lower() in names


def address_permitted(addr: IPAddress, allowed: tuple[str, ...]) -> bool:
    _, nets = _parse_allowed(allowed)
    if any(addr.version == net.version and addr in net for net in nets):
        return True
    return is_public(addr)


def parse_ip(text: str) -> IPAddress:
    # getaddrinfo may append an IPv6 zone ("fe80::1%eth0"); ipaddress keeps it as scope_id.
    return ipaddress.ip_address(text)
