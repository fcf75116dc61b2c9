"""The management API's request pipeline: method → staff token → JSON body → view → JSON answer.

Every refusal is a JSON body `{"error": {"code", "message", "field"}}` with a sentence a person
understands: 400 (with the field at fault), 401 (no token, or one that does not work), 403 (the
token's owner is not staff any more), 404, 405 (with Allow), 409 (a conflict with the current
state), 413 (the body limit, answered at the ASGI edge by project/bodylimit.py).

Only a Bearer staff token authenticates: never a session cookie, so a page in a staff member's
browser cannot call this API on their behalf, and CSRF does not apply.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from accounts.models import KEY_PREFIX
from inference.web.frames import FrameError, loads_limited

from .actions import do_touch_staff_token
from .models import StaffToken

BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")


class ApiError(Exception):
    """A refusal the view raises; the pipeline answers it as JSON."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field


def error_response(status: int, code: str, message: str, field: str | None = None, headers: dict | None = None) -> JsonResponse:
    return JsonResponse({"error": {"code": code, "message": message, "field": field}}, status=status, headers=headers)


def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", what)


def bad_field(field: str, message: str) -> ApiError:
    return ApiError(400, "invalid_field", message, field)


def staff_api(*methods: str) -> Callable:
    """The pipeline around a view `view(request, *args)` that returns (status, payload) or raises ApiError.

    request.actor is the token's owner (every audit row names them), request.body_json the parsed body.
    """

    def decorate(view: Callable) -> Callable:
        @csrf_exempt
        @wraps(view)
        def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if request.method not in methods:
                message = f"{request.method} is not allowed on {request.path}; use {' or '.join(methods)}."
                return error_response(405, "method_not_allowed", message, headers={"Allow": ", ".join(methods)})
            try:
                request.staff_token = authenticate(request)
                request.actor = request.staff_token.user
                request.body_json = parse_body(request) if request.method in BODY_METHODS else {}
                status, payload = view(request, *args, **kwargs)
            except ApiError as exc:
                headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
                return error_response(exc.status, exc.code, exc.message, exc.field, headers)
            response = JsonResponse(payload, status=status)
            response["Cache-Control"] = "no-store"  # answers can hold a key shown once
            return response

        return wrapper

    return decorate


def authenticate(request: HttpRequest) -> StaffToken:
    """The working staff token of this request, or ApiError 401/403 saying what is wrong."""
    scheme, _, plaintext = request.headers.get("Authorization", "").partition(" ")
    plaintext = plaintext.strip()
    if scheme.lower() != "bearer" or not plaintext:
        raise ApiError(401, "missing_token", "Send a staff API token as 'Authorization: Bearer cst_…'. "
                       "Staff create one at /staff/tokens/ or with `manage.py create_staff_token`.")
    if plaintext.startswith(KEY_PREFIX):
        raise ApiError(401, "invalid_token", "This is an API key for /v1 (ck_…); the management API takes a staff "
                       "token (cst_…).")
    token = StaffToken.objects.for_plaintext(plaintext)
    if token is None or not token.user.is_active:
        raise ApiError(401, "invalid_token", "This staff token is not valid: it is unknown, revoked, or its owner "
                       "is deactivated.")
    if not token.user.is_staff:
        raise ApiError(403, "not_staff", f"The token's owner {token.user.get_username()!r} is not staff; only "
                       "staff may use the management API.")
    do_touch_staff_token(token)
    return token


def parse_body(request: HttpRequest) -> dict:
    """The body as a JSON object (an empty body is {}), within the /v1 API's depth limit."""
    if not request.body:
        return {}
    try:
        body = loads_limited(request.body, "request body")
    except FrameError as exc:
        raise ApiError(400, "invalid_json", exc.message) from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "The request body must be a JSON object.")
    return body
