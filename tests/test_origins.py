"""project/origins.py: a websocket Origin must be the address connected to, port included, or trusted."""

import pytest
from django.test import override_settings

from project.origins import origin_allowed


@pytest.mark.parametrize(
    ("origin", "host", "scheme"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", "http"),
        ("http://localhost:8000", "localhost:8000", "http"),
        ("https://ceiling.example", "ceiling.example", "https"),  # a TLS proxy in front: default ports on both sides
        ("https://ceiling.example", "ceiling.example:443", "https"),
        ("http://ceiling.example", "ceiling.example:80", "http"),
        ("http://[::1]:8000", "[::1]:8000", "http"),
        ("http://CEILING.example:8000", "ceiling.example:8000", "http"),  # host names compare case-insensitively
    ],
)
def test_the_page_s_own_origin_is_allowed(origin, host, scheme):
    assert origin_allowed(origin, host, scheme)


@pytest.mark.parametrize(
    ("origin", "host", "scheme"),
    [
        # Before, the scheme was not compared: an HTTPS site's plain-HTTP page (port 80, which anyone on
        # the path can write) opened sockets with the user's cookies.
        ("http://ceiling.example", "ceiling.example", "https"),
        ("http://ceiling.example:443", "ceiling.example:443", "https"),
        ("https://127.0.0.1:8000", "127.0.0.1:8000", "http"),
    ],
)
def test_an_origin_of_another_scheme_is_refused(origin, host, scheme):
    assert not origin_allowed(origin, host, scheme)


def test_the_server_scheme_comes_from_the_socket_the_https_setting_or_a_trusted_proxy(settings):
    from project.origins import server_scheme

    settings.CEILING_HTTPS = False
    assert server_scheme({"scheme": "ws"}, {}) == "http"
    assert server_scheme({"scheme": "wss"}, {}) == "https"
    assert server_scheme({"scheme": "ws"}, {b"x-forwarded-proto": b"https"}) == "http"  # not trusted
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    assert server_scheme({"scheme": "ws"}, {b"x-forwarded-proto": b"https"}) == "https"
    settings.SECURE_PROXY_SSL_HEADER = None
    settings.CEILING_HTTPS = True
    assert server_scheme({"scheme": "ws"}, {}) == "https"


@pytest.mark.parametrize(
    ("origin", "host"),
    [
        ("http://127.0.0.1:9999", "127.0.0.1:8000"),  # another app on our host: the browser sends it our cookies
        ("http://127.0.0.1", "127.0.0.1:8000"),
        ("http://ceiling.example:8443", "ceiling.example"),
        ("http://localhost:8000", "127.0.0.1:8000"),
        ("http://evil.example:8000", "127.0.0.1:8000"),
        ("null", "127.0.0.1:8000"),
        ("file://", "127.0.0.1:8000"),
        ("chrome-extension://abcdef", "127.0.0.1:8000"),
        ("", "127.0.0.1:8000"),
        ("http://127.0.0.1:8000", ""),
        ("http://127.0.0.1:port", "127.0.0.1:8000"),
        ("http://[::1", "[::1]:8000"),
    ],
)
def test_any_other_origin_is_refused(origin, host):
    assert not origin_allowed(origin, host)


@override_settings(CSRF_TRUSTED_ORIGINS=["https://ceiling.example:8443", "https://*.corp.example"])
def test_trusted_origins_are_allowed_as_django_allows_them_for_posts():
    # Behind a proxy that rewrites Host (nginx's $host drops the port) the page's origin differs from Host.
    assert origin_allowed("https://ceiling.example:8443", "ceiling.example")
    assert origin_allowed("https://chat.corp.example", "10.0.0.5:8000")
    assert origin_allowed("https://corp.example", "10.0.0.5:8000")
    assert not origin_allowed("http://ceiling.example:8443", "ceiling.example"), "the scheme must match too"
    assert not origin_allowed("https://ceiling.example:9443", "ceiling.example")
    assert not origin_allowed("https://corp.example.evil", "10.0.0.5:8000")
