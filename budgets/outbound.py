"""Where Ceiling's own HTTP calls may go: provider servers (the workers) and alert webhooks.

    check_url(url, PROVIDER)             # on save (the forms): ValidationError-ready OutboundRefused
    policy_client(WEBHOOK, timeout=10)   # an httpx client that checks every address it connects to

The rule, by address:
- link-local (169.254.0.0/16, fe80::/10; cloud metadata lives there) and the other metadata
  addresses (100.100.100.200, fd00:ec2::254) and host names: always refused;
- loopback, private, shared (CGNAT), unspecified and other non-global addresses: allowed for
  providers (a vLLM on the same host or network is normal), refused for webhooks unless
  CEILING_WEBHOOK_ALLOW_PRIVATE is true (a webhook URL must not reach Redis or PostgreSQL);
- anything else (the public internet): allowed.

A host name is checked on save where it resolves, and again at connect time, in the client's
network backend: the name is resolved once, every address it gives is checked, and the socket
connects to a checked address, so DNS that changes after the save (or between a check and the
connect) cannot lead anywhere else. The clients follow no redirects and ignore proxy variables.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

import httpcore2
import httpx2 as httpx
from django.conf import settings

PROVIDER = "provider"
WEBHOOK = "webhook"

METADATA_HOSTS = {
    "metadata", "metadata.google.internal", "metadata.goog", "metadata.azure.com",
    "instance-data", "instance-data.ec2.internal",
}
ALWAYS_REFUSED = [
    ipaddress.ip_network("169.254.0.0/16"),  # link-local: AWS, GCP, Azure, OpenStack metadata
    ipaddress.ip_network("fe80::/10"),
    ipaddress.ip_network("100.100.100.200/32"),  # Alibaba Cloud metadata
    ipaddress.ip_network("fd00:ec2::254/128"),  # AWS metadata over IPv6
]
ERROR_EXCERPT_CHARS = 200


class OutboundRefused(ValueError):
    """The URL or an address it resolves to is not allowed for this purpose; the text says why."""


def private_allowed(purpose: str) -> bool:
    return purpose == PROVIDER or bool(getattr(settings, "CEILING_WEBHOOK_ALLOW_PRIVATE", False))


def check_address(address: str, purpose: str, host: str = "") -> None:
    """Raise OutboundRefused when `address` (an IP) is not allowed for `purpose`."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # fe80::1%eth0: the zone is not part of the address
    if getattr(ip, "ipv4_mapped", None) is not None:
        ip = ip.ipv4_mapped  # ::ffff:169.254.169.254 is 169.254.169.254
    named = f"{host} ({ip})" if host and host != str(ip) else str(ip)
    if any(ip in network for network in ALWAYS_REFUSED):
        raise OutboundRefused(f"{named} is a link-local or cloud metadata address, which Ceiling never calls")
    if not ip.is_global and not private_allowed(purpose):
        raise OutboundRefused(
            f"{named} is a loopback or private address; webhooks may not call those "
            "(set CEILING_WEBHOOK_ALLOW_PRIVATE=true to allow them)"
        )


def check_host(host: str, purpose: str) -> None:
    """The checks that need no DNS: metadata names, and a literal address."""
    name = host.strip("[]").rstrip(".").lower()
    if name in METADATA_HOSTS:
        raise OutboundRefused(f"{host} is a cloud metadata host, which Ceiling never calls")
    try:
        ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        if name == "localhost" or name.endswith(".localhost"):
            check_address("127.0.0.1", purpose, host)
        return
    check_address(name, purpose)


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (OSError when it does not)."""
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def check_url(url: str, purpose: str) -> None:
    """The save-time check of a URL: scheme, host, and every address the host resolves to now.

    A name that does not resolve here is accepted (the workers may see another DNS); the connect-time
    check decides when it is called.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OutboundRefused("the URL must start with http:// or https:// and name a host")
    check_host(parts.hostname, purpose)
    try:
        addresses = resolve(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except (OSError, UnicodeError):
        return
    for address in addresses:
        check_address(address, purpose, parts.hostname)


def error_excerpt(text: str, limit: int = ERROR_EXCERPT_CHARS) -> str:
    """A server's error body as staff may see it: one line, no control characters, at most `limit`
    characters. (Templates escape it; this keeps a megabyte of HTML or a terminal escape off the page.)"""
    flat = " ".join(re.sub(r"[\x00-\x1f\x7f-\x9f]", " ", text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class PolicyBackend(httpcore2.SyncBackend):
    """httpcore's network backend with the policy at connect time: resolve, check all, connect to a checked address."""

    def __init__(self, purpose: str) -> None:
        self.purpose = purpose

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        check_host(host, self.purpose)
        try:
            addresses = resolve(host, port)
        except OSError as exc:
            raise httpcore2.ConnectError(f"{host} does not resolve ({exc})") from None
        for address in addresses:  # every one: a name with one bad address among good ones is refused
            check_address(address, self.purpose, host)
        last_error: Exception | None = None
        for address in addresses:
            try:
                return super().connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout) as exc:
                last_error = exc
        raise last_error or httpcore2.ConnectError(f"{host} gave no address")


class PolicyTransport(httpx.HTTPTransport):
    def __init__(self, purpose: str, **kwargs) -> None:
        super().__init__(trust_env=False, **kwargs)
        # httpx builds its httpcore pool without a network_backend argument; the pool hands this
        # attribute to every connection it opens, so each connect goes through the policy.
        self._pool._network_backend = PolicyBackend(purpose)


def policy_client(purpose: str, **kwargs) -> httpx.Client:
    """An httpx client for `purpose` whose every connection is checked; no redirects, no proxies from the environment."""
    limits = kwargs.pop("limits", httpx.Limits())
    return httpx.Client(transport=PolicyTransport(purpose, limits=limits), follow_redirects=False, trust_env=False, **kwargs)
