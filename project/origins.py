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
        if origin_allowed(_header(headers, b"origin"), _header(headers, b"host"), server_scheme(scope, headers)):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)


def _header(headers: dict[bytes, bytes], name: bytes) -> str:
    return headers.get(name, b"").decode("latin1")


def server_scheme(scope: dict, headers: dict[bytes, bytes]) -> str:
    """The scheme of the page that may open our sockets: https when the socket came over TLS, when
    the site is served over HTTPS (CEILING_HTTPS: a TLS proxy in front), or when a trusted proxy
    says so (SECURE_PROXY_SSL_HEADER); else http."""
    if scope.get("scheme") in ("wss", "https") or getattr(settings, "CEILING_HTTPS", False):
        return "https"
    proxy_header = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy_header:
        name, value = proxy_header
        sent = _header(headers, name.removeprefix("HTTP_").lower().replace("_", "-").encode())
        if sent.split(",")[0].strip() == value:
            return "https"
    return "http"


def origin_allowed(origin: str, host: str, scheme: str = "http") -> bool:
    """True if `origin` is the site at `host` itself, served over `scheme`, or one of CSRF_TRUSTED_ORIGINS.

    The scheme is compared too: the plain-HTTP page of an HTTPS site's host (port 80, open to anyone
    on the network path) must not open a socket with the user's cookies.
    """
    try:
        page = urlsplit(origin)
        if page.scheme not in DEFAULT_PORTS or not page.hostname:
            return False  # "null", file://, chrome-extension://…, or no Origin at all
        page_port = page.port or DEFAULT_PORTS[page.scheme]
        server = urlsplit(f"//{host}")
        # A browser leaves the default port of the scheme out of Host (and a TLS proxy in front
        # forwards the public Host), so a Host without a port means the server's scheme's default.
        server_port = server.port or DEFAULT_PORTS.get(scheme, 80)
    except ValueError:  # a port that is not a number, a malformed IPv6 literal
        return False
    if (page.scheme, page.hostname, page_port) == (scheme, server.hostname, server_port):
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
