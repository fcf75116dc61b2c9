"""Content-Security-Policy on every response: scripts only from our own static files, never inline.

Django 5.2 has no CSP of its own and the policy is one fixed header, so a small middleware beats a
dependency. Every page loads its JavaScript from static/ and hands data over with `json_script`
(a `<script type="application/json">` block is data, not executed, so no nonce is needed).

'unsafe-inline' is allowed for styles only: Plotly sets `style` attributes and injects `<style>`
rules while it draws, and a style cannot run code. 'unsafe-eval' is not needed (plotly.js 4
renders our bar, line and scatter charts without `eval`/`new Function`).
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse

POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "font-src 'self'",
        # 'self' covers ws:// and wss:// to our own host (CSP level 3), which /ws/chat/ needs.
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
HEADER = "Content-Security-Policy"


class ContentSecurityPolicyMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if iscoroutinefunction(self):
            return self._acall(request)
        return with_policy(self.get_response(request))

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        return with_policy(await self.get_response(request))


def with_policy(response: HttpResponse) -> HttpResponse:
    response.headers.setdefault(HEADER, POLICY)
    return response
