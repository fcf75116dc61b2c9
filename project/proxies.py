"""The client's address behind trusted proxies, for the login throttle (django-axes) and the logs.

Behind a reverse proxy every request comes from the proxy's address, so keying the login throttle
on REMOTE_ADDR let five bad passwords from anyone lock any account out for everyone (staff
included). X-Forwarded-For is only believed from CEILING_TRUSTED_PROXIES: the client is the
right-most address in it that is not itself a trusted proxy (each proxy appends the address it
received from; anything to its left may be forged by the client).
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_trusted_proxies(values: list[str]) -> tuple[Network, ...]:
    """CEILING_TRUSTED_PROXIES: addresses or networks ("10.0.0.0/8", "127.0.0.1"); nonsense refuses to start."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ImproperlyConfigured(
                f"CEILING_TRUSTED_PROXIES: {value!r} is not an IP address or network (such as 10.0.0.0/8)"
            ) from None
    return tuple(networks)


@lru_cache(maxsize=1)
def _trusted(values: tuple[str, ...]) -> tuple[Network, ...]:
    return parse_trusted_proxies(list(values))


def is_trusted(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in _trusted(tuple(settings.CEILING_TRUSTED_PROXIES)))


def client_address(request: HttpRequest) -> str:
    """REMOTE_ADDR, or, when that is a trusted proxy, the right-most forwarded address that is not one."""
    remote = request.META.get("REMOTE_ADDR", "")
    if not is_trusted(remote):
        return remote
    forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if part.strip()]
    for address in reversed(forwarded):
        if not is_trusted(address):
            return address if _is_ip(address) else remote
    return forwarded[0] if forwarded and _is_ip(forwarded[0]) else remote


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True
