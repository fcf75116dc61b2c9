"""Websocket handshakes only from the page's own origin: Django's CSRF origin rule, applied to sockets.

Channels' AllowedHostsOriginValidator compares the Origin's host name with ALLOWED_HOSTS and ignores
its port. Browsers send a site's cookies to every port of its host, so a page served from another
port of the same host (another app, a dev server, anything a user can be lured to) could open a
chat or dashboard socket as the logged-in user. A handshake is accepted here only when its Origin
is the address the browser connected to (scheme's default port filled in, compared with the Host
header, as Django's CsrfViewMiddleware does for POSTs) or is listed in CSRF_TRUSTED_ORIGINS (the
same escape hatch Django offers behind a proxy that rewrites Host). It runs inside Channels'
AllowedHostsOriginValidator (project/asgi.py), so a trusted origin's host must be in ALLOWED_HOSTS too.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import is_same_domain

DEFAULT_PORTS = {"http": 80, "https": 443}


class SameOriginValidator:
    """ASGI middleware for websocket routes: deny (403) any handshake whose Origin is not our own."""

    def __init__(self, application) -> None:
        self.application = application

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers", []))
        if origin_allowed(_header(headers, b"origin"), _header(headers, b"host")):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)


def _header(headers: dict[bytes, bytes], name: bytes) -> str:
    return headers.get(name, b"").decode("latin1")


def origin_allowed(origin: str, host: str) -> bool:
    """True if `origin` is the site at `host` itself, or one of CSRF_TRUSTED_ORIGINS."""
    try:
        page = urlsplit(origin)
        if page.scheme not in DEFAULT_PORTS or not page.hostname:
            return False  # "null", file://, chrome-extension://…, or no Origin at all
        page_port = page.port or DEFAULT_PORTS[page.scheme]
        server = urlsplit(f"//{host}")
        # A browser leaves the default port of the page's scheme out of Host (and a TLS proxy in
        # front forwards the public Host), so a Host without a port means that default.
        server_port = server.port or DEFAULT_PORTS[page.scheme]
    except ValueError:  # a port that is not a number, a malformed IPv6 literal
        return False
    if (page.hostname, page_port) == (server.hostname, server_port):
        return True
    return any(_trusted(page.scheme, page.netloc, trusted) for trusted in settings.CSRF_TRUSTED_ORIGINS)


def _trusted(scheme: str, netloc: str, trusted: str) -> bool:
    """Django's rule for CSRF_TRUSTED_ORIGINS: same scheme, and the netloc equal or under a "*." wildcard."""
    pattern = urlsplit(trusted)
    if pattern.scheme != scheme:
        return False
    if pattern.netloc.startswith("*."):
        return is_same_domain(netloc, pattern.netloc[1:])
    return netloc == pattern.netloc
